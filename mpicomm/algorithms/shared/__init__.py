"""What several families share: gossip averaging, gradient buckets, the periodic step, codec options and the
public copies of compressed gossip."""

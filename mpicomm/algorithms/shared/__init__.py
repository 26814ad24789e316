"""What several families share: gossip averaging, gradient buckets, the periodic step, codec options, the
public copies of compressed gossip and the exact sum of compressed payloads."""

"""The shared training loop and app plumbing: options, schedule, metrics, checkpoints, graceful stop."""

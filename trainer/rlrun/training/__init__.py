"""The trainer: reads shipped batches, optimizes the policy, publishes weights and checkpoints."""

"""Training from scratch: the trainer, its checkpoints, and loading a trained run."""

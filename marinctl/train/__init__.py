"""Training: the step, checkpoints, metrics, monitors, distributed runtime."""

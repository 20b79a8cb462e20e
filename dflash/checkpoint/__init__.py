"""Checkpoint I/O: training checkpoints, the state tree, drafter dirs, the served format,
export and init-from."""

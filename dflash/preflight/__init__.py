"""Checks made before torch loads: inputs, run dir, checkpoint files, layer ids, launch.

Nothing here imports torch: bad input is one line and exit 2 in milliseconds."""

"""Checks made before torch loads: inputs, run dir, layer ids, launch; and what dflash
writes, in one place (checkpoint_files.py: names, bounds, reading back, modes, removal).

Nothing here imports torch: bad input is one line and exit 2 in milliseconds."""

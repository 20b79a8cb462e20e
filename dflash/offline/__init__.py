"""Capture once, train many: the target's fused-layer features on disk (`dflash capture`),
and training that reads them instead of running the target (`dflash train --features`)."""

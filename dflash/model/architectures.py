"""The drafter a DrafterConfig names (``cfg.arch``): DFlash (model/drafter.py) or DFlash2
(model/dflash2.py). Every place that builds a drafter from a config builds it here."""
from __future__ import annotations

import torch

from .dflash2 import DFlash2Drafter
from .drafter import DFlashDrafter


def make_drafter(cfg) -> DFlashDrafter:
    return DFlash2Drafter(cfg) if getattr(cfg, "arch", "dflash") == "dflash2" else DFlashDrafter(cfg)


def expected_shapes(cfg) -> dict:
    """Our state-dict names -> shapes of the drafter ``cfg`` describes, built on the meta
    device: no memory, whatever the sizes (the bounds were checked first)."""
    with torch.device("meta"):
        model = make_drafter(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}

"""The drafter a DrafterConfig names (``cfg.arch``): one network per drafter family, registered
here once (their torch-free halves, config fields and served format: dflash/family/).
Every place that builds a drafter from a config builds it here."""
from __future__ import annotations

import torch

from .dflash2 import DFlash2Drafter
from .drafter import DFlashDrafter
from .dspark import DSparkDrafter

NETWORKS = {"dflash": DFlashDrafter, "dflash2": DFlash2Drafter, "dspark": DSparkDrafter}


def make_drafter(cfg) -> DFlashDrafter:
    return NETWORKS[getattr(cfg, "arch", "dflash") or "dflash"](cfg)


def expected_shapes(cfg) -> dict:
    """Our state-dict names -> shapes of the drafter ``cfg`` describes, built on the meta
    device: no memory, whatever the sizes (the bounds were checked first)."""
    with torch.device("meta"):
        model = make_drafter(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}

"""`dflash train --init-from DIR`: fine-tune a drafter someone else trained.

DIR is a served-format DFlash drafter (a published one, a SpecForge or `dflash export`
output) or a `dflash train` checkpoint. Its shape decides the run's: the number of drafter
layers, the block size, the fused target layers and the sliding-window layout come from DIR (`init_flags`, torch-free,
applied over the config before validation), its weights from `load_into_run` once the
target is loaded (a drafter that does not fit the target is one line, exit 2). Optimizer
and schedule start fresh: this is a new run from those weights, not a resume.
"""
from __future__ import annotations

from . import drafter_dirs


def init_flags(path: str) -> dict:
    """Config keys DIR fixes (dotted, as the CLI's flags are)."""
    d = drafter_dirs.inspect(path)
    f = drafter_dirs.fields(d)
    return {"model.init_from": str(d.path), "model.num_layers": int(f["num_hidden_layers"]),
            "model.block_size": int(f["block_size"]), "model.target_layer_ids": list(f["target_layer_ids"]),
            "model.layer_types": list(f.get("layer_types") or []), "model.sliding_window": int(f.get("sliding_window") or 0)}


def load_into_run(cfg, target):
    """The run's drafter, initialised from cfg.model.init_from (float32, on the CPU)."""
    from dataclasses import replace

    from ..model.drafter import DFlashDrafter

    d = drafter_dirs.inspect(cfg.model.init_from)
    drafter_dirs.check_fits(drafter_dirs.fields(d), f"--init-from {cfg.model.init_from!r}", target=target)
    # set in a YAML file rather than by --init-from, the run's shape may disagree with DIR's
    for key, want in init_flags(cfg.model.init_from).items():
        have = getattr(cfg.model, key.split(".")[1])
        if key != "model.init_from" and have != want:
            raise drafter_dirs.DrafterDirError(f"{key}={have}: model.init_from={cfg.model.init_from!r} has {want} "
                                               f"(dflash train --init-from DIR takes DIR's shape)")
    src = drafter_dirs.load(d)
    drafter = DFlashDrafter(replace(src.cfg, copy_head=cfg.model.copy_head, target=cfg.model.target))
    # a copy head the source lacks starts fresh (its own init); one it has but the run
    # does not want is dropped
    state = {k: v for k, v in src.state_dict().items() if cfg.model.copy_head or not k.startswith("copy.")}
    drafter.load_state_dict(state, strict=not cfg.model.copy_head or src.copy is not None)
    return drafter

"""Launch checks shared by the commands that load a target (`dflash train`, `dflash
capture`): torchrun's environment, and what can be known about the target without loading
a model. One line, exit 2, before torch is imported."""
from __future__ import annotations

import os


def check_torchrun_env() -> None:
    """torchrun sets RANK, LOCAL_RANK and WORLD_SIZE together; a hand-made half of them is
    one line, not a KeyError from deep inside the set-up."""
    from ..errors import ConfigError

    env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    for k, v in env.items():
        if v is not None and not v.strip().isdigit():
            raise ConfigError(f"{k}={v!r}: expected a non-negative integer (torchrun sets it)")
    world = int(env["WORLD_SIZE"] or 1)
    if world > 1 and env["RANK"] is None:
        raise ConfigError(f"WORLD_SIZE={world} but RANK is not set: launch with torchrun --nproc_per_node N "
                          "-m dflash train ... (it sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
    if env["RANK"] is not None and int(env["RANK"]) >= world:
        raise ConfigError(f"RANK={env['RANK']}: expected < WORLD_SIZE={world}")


def check_target(cfg) -> None:
    """What can be known about the target without loading a model: a hub id that does not
    exist or cannot be reached. (The data set is loaded, and so checked, by the command:
    commands/train.py's load_data.)"""
    from .inputs import check_target_spec

    check_target_spec(cfg.model.target, probe_hub=True)

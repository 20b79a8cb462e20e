"""Launch checks shared by the commands that load a target (`dflash train`, `dflash
capture`): torchrun's environment, and what can be known about the target without loading
a model. One line, exit 2, before torch is imported. And one once the target's sizes are
known, before the drafter is allocated: that its training state fits the device it trains
on (`check_training_memory`; torch only for a CUDA device's free memory)."""
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


def available_memory(device: str) -> tuple[int, str] | None:
    """(bytes free now, what that figure is) where a drafter trains: a CUDA device's free
    memory (torch.cuda.mem_get_info), else the host's MemAvailable (/proc/meminfo; elsewhere
    free pages from sysconf). None when the platform says nothing."""
    if str(device).startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return free, f"{device} has {_gib(free)} free of {_gib(total)}"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, f"the host has {_gib(int(line.split()[1]) * 1024)} " \
                                                        f"available (MemAvailable)"
    except (OSError, ValueError, IndexError):
        pass
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return free, f"the host has {_gib(free)} free"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def training_memory_error(fields: dict, available: tuple[int, str] | None) -> str | None:
    """One line when a drafter of these DrafterConfig fields cannot train within ``available``
    (available_memory's), naming the estimate (checkpoint_files.training_bytes) and what there is."""
    from .checkpoint_files import parameter_count, training_bytes

    need = training_bytes(fields)
    if available is None or need <= available[0]:
        return None
    dflash2 = ", model.selector_rank and model.conv_group_size / conv_kernel_size" \
        if fields.get("arch") == "dflash2" else ""
    return (f"the drafter has {parameter_count(fields):,} parameters: training it needs at least {_gib(need)} "
            f"(float32 weights, gradients and AdamW's two moments, 16 bytes a parameter), and {available[1]}; "
            f"make it smaller (model.num_layers{dflash2}) or train on a device with more memory")


def check_training_memory(fields: dict, device: str) -> None:
    """`training_memory_error` on ``device`` now (the target already loaded where it shares it)."""
    from ..errors import ConfigError

    err = training_memory_error(fields, available_memory(device))
    if err:
        raise ConfigError(err)

"""Launch checks shared by the commands that load a target (`dflash train`, `dflash
capture`): torchrun's environment, and what can be known about the target without loading
a model. One line, exit 2, before torch is imported. And one once the target's sizes are
known, before the drafter is allocated: that its training state fits the device it trains
on (`check_training_memory`; torch only for a CUDA device's free memory)."""
from __future__ import annotations

import os

from . import memory


def check_torchrun_env() -> None:
    """torchrun sets RANK, LOCAL_RANK and WORLD_SIZE together; a hand-made half of them is
    one line, not a KeyError from deep inside the set-up."""
    from ..errors import ConfigError

    env = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    for k, v in env.items():
        if v is not None and not (v.strip().isascii() and v.strip().isdigit()):  # "²" is a digit to isdigit()
            raise ConfigError(f"{k}={v!r}: expected a non-negative integer (torchrun sets it)")
    world = int(env["WORLD_SIZE"] or 1)
    if world > 1 and env["RANK"] is None:
        raise ConfigError(f"WORLD_SIZE={world} but RANK is not set: launch with torchrun --nproc_per_node N "
                          "-m dflash train|capture ... (it sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
    if env["RANK"] is not None and int(env["RANK"]) >= world:
        raise ConfigError(f"RANK={env['RANK']}: expected < WORLD_SIZE={world}")
    if world > 1:  # the env:// rendezvous reads them: without, a 40-line traceback from torch.distributed
        for k in ("MASTER_ADDR", "MASTER_PORT"):
            if not (os.environ.get(k) or "").strip():
                raise ConfigError(f"WORLD_SIZE={world} but {k} is not set: launch with torchrun --nproc_per_node N "
                                  "-m dflash train|capture ... (it sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
        port = os.environ["MASTER_PORT"].strip()
        if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
            raise ConfigError(f"MASTER_PORT={port!r}: expected a port in 1..65535 (torchrun sets it)")


def check_target(cfg) -> None:
    """What can be known about the target without loading a model: a hub id that does not
    exist or cannot be reached. (The data set is loaded, and so checked, by the command:
    commands/train.py's load_data.)"""
    from .inputs import check_target_spec

    check_target_spec(cfg.model.target, probe_hub=True)


def available_memory(device: str, *, cgroup_root: str = "/sys/fs/cgroup") -> tuple[int, str] | None:
    """(bytes this process may still take, what limits it) where a drafter trains: a CUDA
    device's free memory (torch.cuda.mem_get_info), else the smaller of the host's
    MemAvailable and its memory cgroup's room (memory.headroom: a container's limit is
    what its OOM killer enforces). None when the platform says nothing."""
    if str(device).startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return free, f"{device} has {memory.gib(free)} free of {memory.gib(total)}"
    return memory.headroom(cgroup_root)


def training_memory_error(fields: dict, shape: memory.RunShape, available: tuple[int, str] | None, *,
                          now: int = 0, device: str = "cpu", est: dict | None = None) -> tuple[dict, str | None]:
    """(memory.estimate of the run, or ``est``; one line when its peak does not fit ``available``
    (available_memory's) on top of ``now``, naming the peak's phase, its parts and the limit)."""
    from .. import family

    knobs = family.of(fields).size_knobs  # its family's own sizes (dflash/family/)
    est = est if est is not None else memory.estimate(fields, shape)
    return est, memory.refusal(est, available, now=now, knobs=knobs, device=device, steps=shape.steps)


def check_training_memory(fields: dict, device: str, shape: memory.RunShape) -> dict:
    """`training_memory_error` on ``device`` now (the target already loaded where it shares it):
    on the host the estimate is on top of what this process holds now (its resident set);
    a CUDA drafter's state is checked against its device, and the host copies of its saves
    against the host. Returns the estimate with what the process held (summary.json's
    "memory"); raises ConfigError with the one line."""
    from ..errors import ConfigError

    rss, hwm = memory.process_memory()
    cuda = str(device).startswith("cuda")
    room = available_memory(device)
    est, err = training_memory_error(fields, shape, room, now=0 if cuda else rss, device=device)
    if not err and cuda:
        _, err = training_memory_error(fields, shape, memory.headroom(), now=rss,
                                       est=memory.host_copies(fields, shape))
    if err:
        raise ConfigError(err)
    est["held_at_check"], est["hwm_at_check"] = rss, hwm
    if room is not None:
        est["room_at_check"], est["room"] = room
    return est

"""The CUDA devices a command names exist on this host: one line, exit 2, before the target
loads (`dflash train`, `dflash capture`). Without this a CPU-only host (or a GPU index past
the host's count) ended in a long traceback from deep in the target's load, minutes in.

torch is imported only when a CUDA device is named: a run on the CPU is still checked whole
before torch loads. torch's own count is the answer (CUDA_VISIBLE_DEVICES, a CPU-only torch
build, a missing driver all show in it); a driver file or /dev node would miss some of them."""
from __future__ import annotations

import re

_FORM = re.compile(r"cpu|cuda(:[0-9]+)?")


def check_devices(named: dict[str, list[str]], *, attention: str | None = None) -> None:
    """``named``: the config key -> the devices it names (pipeline.target_devices, ...). Each is
    cpu, cuda or cuda:N, and every CUDA one is a device torch can use here (`cuda` is this
    rank's, LOCAL_RANK's). ``attention``: train.attention, named in the message where flex
    is what asked for CUDA."""
    import os

    from ..errors import ConfigError

    for key, devs in named.items():
        for d in devs:
            if not _FORM.fullmatch(str(d)):
                raise ConfigError(f"{key}={devs}: expected cpu, cuda or cuda:N for each device (got {d!r})")
    cuda = {key: devs for key, devs in named.items() if any(str(d).startswith("cuda") for d in devs)}
    if not cuda:
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for key, devs in cuda.items():
        for d in devs:
            if not str(d).startswith("cuda"):
                continue
            # plain `cuda` is this rank's GPU (LOCAL_RANK, as config.local_device says)
            index = int(str(d).partition(":")[2] or (os.environ.get("LOCAL_RANK", "0") if d == "cuda" else 0))
            if index < count:
                continue
            if count == 0:
                build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
                why = f"this host has no CUDA device torch can use (torch {torch.__version__}, {build})"
            else:
                why = f"this host has {count} CUDA device(s), cuda:0..cuda:{count - 1}"
            flex = (" (train.attention=flex needs a CUDA drafter device: on a CPU host use train.attention=sdpa)"
                    if attention == "flex" and count == 0 else "")
            raise ConfigError(f"{key}={devs}: {why}; expected cpu{' or cuda:0..' + str(count - 1) if count else ''}"
                              f"{flex}")

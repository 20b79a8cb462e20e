"""Placement as data: which workers this process builds, on which devices, and which
channel joins them. Everything else about a run is the same code for every placement.

    one process, reference loop   target + drafter on one thread, "direct": no channel, the
                                  loop hands each batch's features over (run_loop.reference_loop)
    one process, pipelined        prefetch + a target worker per target device, queue channel
    torchrun, no layout           every rank one of the above (a replica), DDP over all ranks
    torchrun, --layout T:N,D:M    target ranks: a target worker; drafter ranks: a drafter
                                  worker (DDP among them); ranks channel (roles/handoff.py)
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..config import Config, local_device
from .roles.layout import DRAFTER, TARGET, Layout

BOTH = "both"


@dataclass
class Placement:
    role: str                      # both | target | drafter
    channel: str                   # direct | queue | ranks
    rank: int = 0
    world: int = 1
    index: int = 0                 # position among the ranks of its role
    layout: Layout | None = None
    target_devices: list[str] = field(default_factory=list)  # this process's target workers
    drafter_device: str | None = None
    load_device: str = "cpu"       # where the target is loaded (a drafter rank: the host, briefly)

    @property
    def has_drafter(self) -> bool:
        return self.role in (BOTH, DRAFTER)

    @property
    def has_target(self) -> bool:
        return self.role in (BOTH, TARGET)

    @property
    def drafter_world(self) -> int:
        """Ranks that train the drafter together (DDP)."""
        return self.layout.drafters if self.layout else self.world

    @property
    def lead(self) -> bool:
        """Saves checkpoints and writes summary.json: rank 0, or a layout's first drafter rank."""
        return self.rank == (self.layout.drafter_rank(0) if self.layout else 0)

    @property
    def worker(self) -> str:
        """The name of this process's drafter worker in spans and metrics."""
        if self.channel == "direct":
            return "main"
        return f"drafter{self.index if self.layout else 0}"


def _role_device(devs: list[str], index: int) -> str:
    """A role's device: `cuda` is this rank's GPU; an explicit list (`cuda:0,cuda:1`) is
    taken round robin by position among the role's ranks; `cpu` the CPU."""
    if not devs[0].startswith("cuda"):
        return "cpu"
    if devs[0] == "cuda":
        return local_device("cuda")
    return devs[index % len(devs)]


def resolve(cfg: Config) -> Placement:
    p = cfg.pipeline
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    rank = int(os.environ.get("RANK", "0") or 0) if world > 1 else 0
    if p.layout:
        layout = Layout.parse(p.layout)
        layout.check_world(world)
        role = layout.role(rank)
        index = rank if role == TARGET else layout.drafter_index(rank)
        if role == TARGET:
            dev = _role_device(p.target_devices, index)
            return Placement(TARGET, "ranks", rank, world, index, layout, target_devices=[dev], load_device=dev)
        dev = _role_device(p.drafter_devices, index)
        return Placement(DRAFTER, "ranks", rank, world, index, layout, drafter_device=dev, load_device="cpu")
    tdevs = [local_device(d) for d in p.target_devices]
    ddev = local_device(p.drafter_devices[rank % len(p.drafter_devices)])
    return Placement(BOTH, "queue" if p.pipelined else "direct", rank, world, rank,
                     target_devices=tdevs if p.pipelined else tdevs[:1], drafter_device=ddev,
                     load_device=tdevs[0])


def handoff_backend(cfg: Config) -> str:
    """nccl | gloo for a layout's payload. auto: NCCL when every rank is on CUDA, unless the
    two roles name the same GPU explicitly (NCCL refuses two ranks of one communicator on
    one device; gloo then carries it through the host)."""
    p = cfg.pipeline
    if p.handoff != "auto":
        return p.handoff
    both = p.target_devices[0].startswith("cuda") and p.drafter_devices[0].startswith("cuda")
    shared = set(p.target_devices) & set(p.drafter_devices) - {"cuda"}
    return "nccl" if both and not shared else "gloo"

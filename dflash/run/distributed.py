"""torchrun / torch.distributed: rank discovery, a run id shared by all ranks, DDP."""
from __future__ import annotations

import os
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import interruptible

AGREE_TIMEOUT_S = 60.0  # reaching torchrun's own store: it is up before any rank starts


def agent_store() -> bool:
    """Whether torchrun's agent store is there to agree on a run id before the ranks join (the
    same answer on every rank of a launch: an environment variable torchrun sets for all)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def early_run_id(world: int) -> str | None:
    """The run id, before the ranks join, so that the telemetry (and the run's trace, whose
    ids derive from it) starts first: `DFLASH_RUN_ID`; a single process's own; under torchrun,
    the first rank's to reach torchrun's store (`compare_set` there: nobody waits for another
    rank); None where no such store is shared (a launch without torchrun): join() agrees on it."""
    own = os.environ.get("DFLASH_RUN_ID")
    if own:
        return own
    if world <= 1:
        return uuid.uuid4().hex
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not agent_store() or not addr or not port.isdigit():
        return None
    try:
        store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=AGREE_TIMEOUT_S))
        # a key of torchrun's store for this attempt (a restart gets a new store): first writer wins
        return store.compare_set("dflash/run_id", "", uuid.uuid4().hex).decode()
    except (RuntimeError, OSError, ValueError):  # no store after all: the join agrees on it
        return None


def join(cfg, place, run_id: str | None = None) -> tuple[str, object]:
    """(run id, layout groups or None). Under torchrun joins the process group: gloo on the
    CPU, NCCL where the drafter (replicas) or any rank (a layout) is on CUDA; a layout also
    makes its hand-off, DDP and vote groups (every rank, same order: torch.distributed's
    rule). The run id, from which every trace id derives, is ``run_id`` (early_run_id: the
    same on every rank), else made by rank 0; broadcast either way, so all ranks' spans join
    the same traces."""
    own = run_id or os.environ.get("DFLASH_RUN_ID") or uuid.uuid4().hex
    if place.world <= 1:
        return own, None
    p = cfg.pipeline
    timeout = timedelta(seconds=p.rank_timeout_s)
    use_local_device(place)
    groups = None
    if place.layout is None:
        cuda = any(d.startswith("cuda") for d in p.drafter_devices)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if cuda else "gloo")
        setup_group = None
    else:
        from .placement import handoff_backend
        from .roles.handoff import make_groups
        drafters_cuda = p.drafter_devices[0].startswith("cuda")
        any_cuda = drafters_cuda or p.target_devices[0].startswith("cuda")
        if not dist.is_initialized():
            dist.init_process_group(backend="cpu:gloo,cuda:nccl" if any_cuda else "gloo", timeout=timeout)
        groups = make_groups(place.layout, handoff_backend(cfg) == "nccl", drafters_cuda, p.rank_timeout_s)
        setup_group = groups.setup
    box = [own if place.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=setup_group)
    return box[0], groups


def use_local_device(place) -> None:
    """This rank's CUDA device as the calling thread's current one (NCCL's communicators and
    the collectives' buffers go where it points); nothing on the CPU."""
    mine = place.drafter_device or place.target_devices[0]
    if mine.startswith("cuda"):
        torch.cuda.set_device(torch.device(mine))


def broadcast(obj, src: int, groups):
    """An object from rank `src` to every rank (the set-up group of a layout: long timeout)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]  # set-up only: a rank may wait here for rank 0's data and regeneration, a signal still stops it
    interruptible(dist.broadcast_object_list, box, src=src, group=groups.setup if groups is not None else None)
    return box[0]


def broadcast_in(obj, src: int, group):
    """An object from global rank `src` to every rank of `group` (each of them calls this)."""
    box = [obj]
    interruptible(dist.broadcast_object_list, box, src=src, group=group)  # set-up only, as broadcast()
    return box[0]


def wrap_ddp(module, device: str, group=None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = torch.device(device)
    return DDP(module, device_ids=[dev.index] if dev.type == "cuda" else None, process_group=group)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class StopVote:
    """All ranks stop at the same step (Ctrl-C / SIGTERM reach ranks at different moments;
    a rank that stops alone leaves the others hanging in DDP's all-reduce). Every step each
    rank adds its local stop flag to a non-blocking MAX all-reduce on a CPU (gloo) group
    and reads the previous step's result: ranks already meet once per step in DDP, so
    the wait is free, and nothing touches the GPU."""

    def __init__(self, world_size: int, group=None):
        # group: the ranks that vote (a layout's drafter ranks); default: a new gloo group of all
        self.group = group if group is not None else dist.new_group(backend="gloo") if world_size > 1 else None
        self._pending = None

    def __call__(self, local_stop: bool) -> bool:
        if self.group is None:
            return local_stop
        decided = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            decided = bool(flag[0])  # a CPU tensor: no device sync
        flag = torch.tensor([int(local_stop)], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag)
        return decided


def sum_over_ranks(value: float, group) -> float:
    """End-of-run totals (tokens) over all ranks, on the CPU group; identity for one rank."""
    if group is None:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.item()  # a CPU tensor

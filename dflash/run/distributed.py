"""torchrun / torch.distributed: rank discovery, a run id shared by all ranks, DDP."""
from __future__ import annotations

import os
import uuid

import torch
import torch.distributed as dist


def init_from_env(cfg, out) -> tuple[int, int, str]:
    """(rank, world_size, run_id). Under torchrun (WORLD_SIZE > 1) joins the process group:
    gloo on CPU, nccl when the drafter lives on CUDA. The run id, from which every trace id
    derives, is made by rank 0 and broadcast so all ranks' spans join the same traces."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, os.environ.get("DFLASH_RUN_ID") or uuid.uuid4().hex
    rank = int(os.environ["RANK"])
    cuda = any(d.startswith("cuda") for d in cfg.pipeline.drafter_devices)
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    box = [os.environ.get("DFLASH_RUN_ID") or uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return rank, world, box[0]


def wrap_ddp(module, device: str):
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = torch.device(device)
    return DDP(module, device_ids=[dev.index] if dev.type == "cuda" else None)


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

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

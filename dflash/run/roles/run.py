"""`dflash train` under torchrun with a layout: set up this rank's role and run it.

    torchrun --nproc_per_node 8 -m dflash train --layout target:5,drafter:3 \
        --target-devices cuda --drafter-devices cuda ...

Set-up order (every rank, same order: torch.distributed's rule for making groups):
1. join the world (gloo; plus NCCL for CUDA tensors), check WORLD_SIZE against the layout,
   make the hand-off, DDP and vote groups (handoff.make_groups);
2. rank 0, a target rank, prepares the data once (regenerating replies with its target
   when the config asks for it) and broadcasts the samples: no other rank loads the data
   set or generates, and nodes need no shared file system;
3. the first drafter rank (the lead: it saves checkpoints and writes summary.json) reads
   the resume point and broadcasts it;
4. target ranks load one target replica on their device; drafter ranks build the drafter
   from the target's config and copy out the frozen embedding and lm_head, and let the
   rest of the target go before training starts (see `held_parameters` in the rank file).

Each rank writes OUT/ranks/rank{r}.json (role, device, held parameters, counts). A
failure on any rank raises here with the rank named; torchrun then stops the others,
and the hand-off's waits fail fast when a peer's connection closes (or after
`pipeline.rank_timeout_s` when it hangs).
"""
from __future__ import annotations

import gc
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ...config import Config, dump, resolve_dtype
from ...data.prepare import prepare
from ...model import checkpoint as ckpt
from ...model import target as target_mod
from ...model.trainer import DrafterStep, build_drafter
from .. import distributed as dist_mod
from ..context import RunContext
from ..saving import save, wait_for_checkpoint
from .handoff import Groups, make_groups
from .layout import DRAFTER, TARGET, Layout


@dataclass
class RoleContext:
    cfg: Config
    layout: Layout
    rank: int
    role: str
    index: int                 # position among the ranks of its role
    device: str
    groups: Groups
    tokenizer: object
    samples: list
    start_step: int
    end_step: int
    run_id: str
    tel: object = None
    target: object = None      # target ranks only
    layer_ids: list = field(default_factory=list)
    sync_timer: object = None  # drafter ranks: DDP all-reduce wait
    stop: threading.Event = field(default_factory=threading.Event)


def _device(cfg: Config, role: str, index: int = 0) -> str:
    """`cuda`: this rank's GPU (cuda:LOCAL_RANK, torchrun's convention); an explicit list
    (`cuda:0,cuda:1,...`): entry `index` of the role's list (round robin), e.g. both roles on
    cuda:0 to try a layout on one GPU; `cpu`: the CPU."""
    devs = cfg.pipeline.target_devices if role == TARGET else cfg.pipeline.drafter_devices
    if not devs[0].startswith("cuda"):
        return "cpu"
    if devs[0] == "cuda":
        return f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    return devs[index % len(devs)]


def handoff_backend(cfg: Config) -> str:
    """nccl | gloo for the payload. auto: NCCL when every rank is on CUDA, unless the two
    roles name the same GPU explicitly (NCCL refuses two ranks of one communicator on one
    device; gloo then carries it through the host)."""
    p = cfg.pipeline
    if p.handoff != "auto":
        return p.handoff
    both = p.target_devices[0].startswith("cuda") and p.drafter_devices[0].startswith("cuda")
    shared = set(p.target_devices) & set(p.drafter_devices) - {"cuda"}
    return "nccl" if both and not shared else "gloo"


def held_parameters() -> int:
    """Every parameter alive in this process (garbage collector's view): what the rank
    really holds, not what it meant to keep."""
    import warnings

    gc.collect()
    seen, total = set(), 0
    with warnings.catch_warnings():  # isinstance() on some module objects warns of deprecations
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            if isinstance(o, torch.nn.Parameter) and id(o) not in seen:
                seen.add(id(o))
                total += o.numel()
    return total


def _join(cfg: Config, layout: Layout) -> tuple[int, int, str, Groups]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    layout.check_world(world)
    rank = int(os.environ["RANK"])
    role = layout.role(rank)
    index = rank if role == TARGET else layout.drafter_index(rank)
    mine = _device(cfg, role, index)
    nccl = handoff_backend(cfg) == "nccl"
    drafters_cuda = cfg.pipeline.drafter_devices[0].startswith("cuda")
    any_cuda = drafters_cuda or cfg.pipeline.target_devices[0].startswith("cuda")
    if mine.startswith("cuda"):
        torch.cuda.set_device(torch.device(mine))
    timeout = timedelta(seconds=cfg.pipeline.rank_timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if any_cuda else "gloo", timeout=timeout)
    groups = make_groups(layout, nccl, drafters_cuda, cfg.pipeline.rank_timeout_s)
    box = [os.environ.get("DFLASH_RUN_ID") or uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=groups.setup)
    return rank, world, box[0], groups


def _make_telemetry(cfg: Config, out: Path, rc: RoleContext):
    import otel

    from ...analysis.idle_rules import DFLASH_RULES
    if not cfg.telemetry.enabled:
        return otel.Telemetry.disabled()
    dev = torch.device(rc.device)
    from ..train import rank_prometheus_port
    with rank_prometheus_port():
        return otel.Telemetry.from_env(
            service_name="dflash", run_id=rc.run_id, file_dir=str(out / "telemetry" / f"rank{rc.rank}"),
            resource_attributes={"rank": rc.rank, "world_size": rc.layout.world_size, "role": rc.role,
                                 "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                                 "host.name": socket.gethostname(), "dflash.layout": str(rc.layout),
                                 "dflash.target": cfg.model.target},
            console=False, mode=cfg.telemetry.mode,
            gpu_indices=[dev.index or 0] if dev.type == "cuda" else None, idle_rules=DFLASH_RULES,
            root_spans=rc.role == DRAFTER)  # a batch's root: on the rank that trains on it


def train_with_layout(cfg: Config, *, resume: bool = False) -> dict:
    layout = Layout.parse(cfg.pipeline.layout)
    out = Path(cfg.out)
    rank, world, run_id, groups = _join(cfg, layout)
    role = layout.role(rank)
    index = rank if role == TARGET else layout.drafter_index(rank)
    lead = layout.drafter_rank(0)
    dev = _device(cfg, role, index)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ranks").mkdir(exist_ok=True)
    torch.manual_seed(cfg.train.seed)
    tok = target_mod.load_tokenizer(cfg.model.target)
    dtype = resolve_dtype(cfg, _device(cfg, TARGET))

    # target replica (target ranks), or the target on the host just long enough to build
    # the drafter and copy out what it needs (drafter ranks)
    holder = [target_mod.load_target(cfg.model.target, device=dev if role == TARGET else "cpu", dtype=dtype,
                                     seed=cfg.model.target_seed)[0]]
    target = holder[0]
    L = target_mod.num_layers(target)
    layer_ids = cfg.model.target_layer_ids or target_mod.default_layer_ids(L, cfg.model.num_target_layers)

    box = [prepare(cfg, target, tok, device=dev).samples if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=groups.setup)
    samples = box[0]
    del target, box  # from here on only `holder` references it: a drafter rank lets it go

    state = [None]
    if rank == lead and resume:
        state = [{"step": ckpt.load_training_state(out / "checkpoint")[0]["step"]}]
    dist.broadcast_object_list(state, src=lead, group=groups.setup)
    start = state[0]["step"] if state[0] else 0
    rc = RoleContext(cfg=cfg, layout=layout, rank=rank, role=role, index=index, device=dev, groups=groups,
                     tokenizer=tok, samples=samples, start_step=start, end_step=cfg.train.steps,
                     run_id=run_id, layer_ids=layer_ids)
    if rank == lead:
        dump(cfg, out / "config.yaml")

    prev = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def on_signal(signum, frame):  # finish the step, save, stop every rank at the same step
        if rc.stop.is_set():
            raise KeyboardInterrupt
        print(f"\nrank {rank}: interrupt: stopping all ranks after the current step, then saving",
              file=sys.stderr)
        rc.stop.set()

    for s in prev:
        signal.signal(s, on_signal)
    (out / "ranks" / f"rank{rank}.pid").write_text(str(os.getpid()))
    report = {"rank": rank, "role": role, "index": index, "device": dev, "layout": str(layout),
              "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "host": socket.gethostname()}
    summary: dict = {}
    bridge = None
    try:
        if role == TARGET:
            rc.target = target = holder.pop()
            from ...model.warmup import warm_up
            warm_up(target, batch_size=cfg.train.batch_size, seq_len=cfg.data.max_len, quiet=True)
            report["held_parameters"] = held_parameters()
            report["target_parameters"] = sum(p.numel() for p in target.parameters())
            rc.tel = _make_telemetry(cfg, out, rc)
            from .target_rank import run_target_rank
            try:
                report.update(run_target_rank(rc))
            finally:
                rc.tel.shutdown(timeout_s=2.0)
                report["telemetry"] = rc.tel.summary()["health"]
        else:
            summary, bridge = _run_drafter(cfg, rc, holder, resume, out, lead)
            report.update({k: summary[k] for k in ("steps", "tokens", "held_parameters", "drafter_parameters",
                                                   "frozen_parameters", "interrupted") if k in summary})
    finally:
        for s, h in prev.items():
            signal.signal(s, h)
        (out / "ranks" / f"rank{rank}.json").write_text(json.dumps(report, indent=2))
        dist_mod.shutdown()
    if rank == lead:
        summary["layout"] = str(layout)
        summary["ranks"] = _rank_reports(out, world)
        from ..train import balance_from_files
        summary["balance"] = balance_from_files(out)  # every rank's spans are on disk by now
        if bridge is not None:
            _close_bridge(bridge, summary)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    # only the lead reports an interrupted run (exit 130), and it is the last to finish:
    # torchrun tears every rank down as soon as one exits non-zero
    return summary if rank == lead else {"rank": rank, "role": role}


def _close_bridge(bridge, summary) -> None:
    from ... import wandb_bridge
    try:
        bridge.close(summary)
    except Exception as e:
        print(f"dflash: W&B bridge: {wandb_bridge.redact(repr(e))}", file=sys.stderr)


def _rank_reports(out: Path, world: int) -> list:
    """The other ranks' reports, as far as they are written (they end at about the same time)."""
    deadline = time.monotonic() + 30
    reps = []
    for r in range(world):
        f = out / "ranks" / f"rank{r}.json"
        while not f.is_file() and time.monotonic() < deadline:
            time.sleep(0.2)
        if f.is_file():
            try:
                reps.append(json.loads(f.read_text()))
            except ValueError:
                reps.append({"rank": r, "missing": True})
    return reps


def _run_drafter(cfg, rc, holder, resume, out, lead):
    import copy

    target = holder.pop()
    dev = rc.device
    dtype = resolve_dtype(cfg, _device(cfg, TARGET))
    # one deepcopy of the pair: a target that ties lm_head to the embedding stays tied
    embed, head = copy.deepcopy((target.get_input_embeddings(), target.get_output_embeddings()))
    embed, head = embed.to(dev, dtype), head.to(dev, dtype)
    history, tokens = [], 0
    if resume:
        drafter, _ = ckpt.load_drafter(out / "checkpoint", device=dev, dtype=torch.float32)
        tstate, jstate = ckpt.load_training_state(out / "checkpoint")
    else:
        drafter = build_drafter(cfg, target, rc.tokenizer, rc.layer_ids).to(dev)
    target_config = target.config  # for the served export at the end
    del target  # the drafter rank keeps no target: only the copies above
    from torch.nn.parallel import DistributedDataParallel as DDP
    d = torch.device(dev)
    ddp = DDP(drafter, device_ids=[d.index] if d.type == "cuda" else None, process_group=rc.groups.drafters)
    from .sync_timing import attach
    rc.sync_timer = attach(ddp, rc.groups.drafters)
    step = DrafterStep(cfg, drafter, embed, head, dev, ddp=ddp)
    step.use_loss_vocab(rc.samples)  # every rank holds all samples: the same set everywhere
    if resume:
        step.load_state(tstate)
        tokens = jstate.get("tokens", 0) if rc.rank == lead else 0
        history = [tuple(h) for h in jstate.get("history", [])]
    rc.tel = _make_telemetry(cfg, out, rc)
    ctx = RunContext(cfg=cfg, tel=rc.tel, target=None, tokenizer=rc.tokenizer, layer_ids=rc.layer_ids,
                     step=step, samples=rc.samples, eval_convs=[], out=out, rank=rc.rank,
                     world_size=rc.layout.drafters, start_step=rc.start_step, history=history, tokens=tokens,
                     lead=rc.rank == lead, worker=f"drafter{rc.index}")
    ctx.stop = rc.stop
    ctx.vote = dist_mod.StopVote(rc.layout.drafters, group=rc.groups.drafter_votes)
    held = held_parameters()
    from ... import wandb_bridge
    from .drafter_rank import DrafterRank
    bridge = wandb_bridge.start(ctx)  # lead drafter only, and only with --wandb
    summary: dict = {}
    try:
        t0 = time.perf_counter()
        step0, tokens0 = step.step, ctx.tokens
        DrafterRank(ctx, rc).run()
        ctx.finish_readback()
        wall = time.perf_counter() - t0
        save(ctx)
        wait_for_checkpoint(ctx)
        from ..train import summarize
        summary = summarize(ctx, wall, step0, tokens0)
        summary.update({"held_parameters": held, "drafter_parameters": sum(p.numel() for p in drafter.parameters()),
                        "frozen_parameters": sum(p.numel() for p in {id(p): p for p in (embed.weight, head.weight)}.values()), "role": DRAFTER})
        from ...analysis.learning_curve import write_png
        if ctx.lead and ctx.history:
            write_png(out / "learning_curve.png", ctx.history, [], cfg.model.block_size,
                      f"{cfg.model.target}: drafter training ({rc.layout})")
        if ctx.lead:  # a servable copy: OUT/export/ (or why not)
            from ...export import export_after_run
            summary["export"] = export_after_run(ctx, summary, target_config=target_config)
    finally:
        rc.tel.shutdown(timeout_s=2.0)
        summary["telemetry"] = rc.tel.summary()
    return summary, bridge

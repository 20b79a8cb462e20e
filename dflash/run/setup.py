"""A run's set-up, once for every placement (placement.py says what this process does):
join the ranks, load the target, prepare the data, build or resume the drafter and make
the telemetry. A drafter-only rank keeps no target, only its copies of the embedding and
lm_head; every target worker gets a frozen replica (and a feature cache) on its device."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import family
from ..checkpoint import checkpoint as ckpt
from ..checkpoint.drafter_dirs import check_fits
from ..config import Config, local_device, regenerates, resolve_dtype
from ..data import chat_template
from ..errors import interruptible
from ..model import target as target_mod
from ..model.build import build_drafter, drafter_config
from ..model.feature_cache import FeatureCache
from ..model.features import replicate_target
from ..model.losses import feature_ids
from ..prep.prepare import prepare
from .. import phases
from . import distributed as dist_mod
from . import placement as placement_mod
from .context import RunSpec, RunState
from .placement import Placement
from .step import TrainStep
from .telemetry_setup import make_telemetry

if TYPE_CHECKING:
    from otel import TelemetryAPI

    from .roles.handoff import Groups


def setup(cfg: Config, *, resume: bool, tel: TelemetryAPI | None = None,
          argv: list[str] | None = None) -> tuple[RunSpec, RunState]:
    """The run's telemetry starts first (before the ranks join, where torchrun's store lets
    the ranks agree on the run id at once; else right after), then every step of the set-up
    is a phase of the run's trace (dflash/phases.py)."""
    place = placement_mod.resolve(cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    phases.inject_delays(cfg.pipeline.inject_delay, place.rank)
    run_id = dist_mod.early_run_id(place.world)
    if tel is None and run_id is not None:
        tel = make_telemetry(cfg, out, place, run_id, argv=argv)
    if tel is not None:
        phases.use(tel)
    if place.world > 1:
        with phases.phase("join_ranks", collective=True, world_size=place.world):
            dist_mod.use_local_device(place)  # thread-local: here, and in the join's own thread
            run_id, groups = interruptible(dist_mod.join, cfg, place, run_id)  # a signal stops a waiting rank
    else:
        run_id, groups = dist_mod.join(cfg, place, run_id)
    if tel is None:  # a launch without torchrun's store: the ranks agreed on the run id by joining
        tel = make_telemetry(cfg, out, place, run_id, argv=argv)
        phases.use(tel)
    with phases.phase("open_capture" if cfg.data.features else "load_target", target=cfg.model.target) as ph:
        target, tok, store, features_dtype, dtype = _load_target(cfg, place)
        ph.set(parameters=sum(p.numel() for p in target.parameters()), dtype=str(dtype).removeprefix("torch."),
               device=place.load_device)
    return _setup_rest(cfg, place, out, run_id, groups, target, tok, store, features_dtype, dtype, resume, tel)


def _load_target(cfg: Config, place: Placement):
    if any(d and d.startswith("cuda") for d in place.target_devices + [place.drafter_device]):
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    torch.manual_seed(cfg.train.seed)
    # the target's dtype is the target role's, also where a drafter rank borrows it on the host
    dtype = resolve_dtype(cfg, local_device(cfg.pipeline.target_devices[0]))
    if cfg.data.features:  # a capture: no target forward, no data preparation
        from ..offline.train_from_features import open_capture
        target, tok, store, features_dtype = open_capture(cfg, device=place.load_device, dtype=dtype)
        return target, tok, store, features_dtype, dtype
    target, tok = target_mod.load_target(cfg.model.target, device=place.load_device, dtype=dtype,
                                         seed=cfg.model.target_seed)
    chat_template.configure_from(tok, cfg.data)  # data.chat_template(_kwargs): every render from here on
    return target, tok, None, None, dtype


def _setup_rest(cfg, place, out, run_id, groups, target, tok, store, features_dtype, dtype, resume, tel):
    if store is not None:  # a capture: no target forward, no data preparation
        from ..offline.train_from_features import training_samples
        warmup_s, layer_ids = None, store.layer_ids
        memory = _check_memory(cfg, place, target, tok, layer_ids, resume=resume, dtype=dtype, features=True)
        from ..prep.prepare import Prepared
        with phases.phase("read_capture") as ph:
            prep = Prepared(samples=training_samples(cfg, store), eval_convs=[], regenerated=False)
            ph.set(samples=len(prep.samples))
    else:
        from ..model.warmup import warm_up
        warmup_s = None
        if place.has_target:  # CUDA only: Triton compile/autotune and first-call costs, before anything is timed
            with phases.phase("warm_up_target"):
                warmup_s = warm_up(target, batch_size=cfg.train.batch_size, seq_len=cfg.data.max_len,
                                   quiet=place.rank != 0 or place.layout is not None)
        L = target_mod.num_layers(target)
        layer_ids = cfg.model.target_layer_ids or target_mod.default_layer_ids(L, cfg.model.num_target_layers)
        if place.has_drafter and not resume and not cfg.model.init_from:
            # the family's checks against the target's sizes (DFlash2's conv groups, say) on the meta
            # device: one line now, not after data preparation
            from ..model.architectures import expected_shapes
            expected_shapes(drafter_config(cfg, target, tok, layer_ids))
        # before data preparation and the drafter
        memory = _check_memory(cfg, place, target, tok, layer_ids, resume=resume, dtype=dtype, features=False)
        # what regeneration keeps for the feature cache: what the target side would compute
        with phases.phase("prepare_data") as ph:
            prep = _prepare_data(cfg, place, groups, target, tok, resume,
                                 feature_ids(cfg.train, layer_ids, False, cfg.model.arch))
            ph.set(**prep.span_attributes())
        if cfg.train.feature_cache and place.has_target:  # its size needs the prepared samples
            memory = _check_feature_cache(cfg, place, target, prep, memory,
                                          feature_ids(cfg.train, layer_ids, False, cfg.model.arch), dtype)
    start_step = _start_step(place, out, groups, resume)
    samples, held_out = prep.samples, []
    train_step = vote = sync_timer = None
    tokens, history = 0, []
    # the acceptance estimate walks the held-out eval prompts (run/acceptance_estimate.py); a
    # capture run has none (nor a target to continue them): it keeps some samples back instead
    walk_prompts = bool(cfg.train.estimate_every) and store is None and bool(prep.eval_convs)
    if place.has_drafter:
        if cfg.train.estimate_every and not walk_prompts and len(samples) > cfg.train.estimate_samples:
            # kept out of training: the acceptance estimate must measure held-out replies
            samples, held_out = samples[:-cfg.train.estimate_samples], samples[-cfg.train.estimate_samples:]
        with phases.phase("resume_drafter" if resume else "build_drafter", layers=cfg.model.num_layers,
                          arch=cfg.model.arch):
            train_step, vote, sync_timer, jstate = _setup_drafter(cfg, place, out, groups, target, tok, layer_ids,
                                                                  samples, resume, dtype)
        if resume:  # the saved count is the all-rank total: the lead carries it, so sums stay exact
            tokens = jstate.get("tokens", 0) if place.lead else 0
            history = [tuple(h) for h in jstate.get("history", [])]
    spec = RunSpec(cfg=cfg, placement=place, out=out, run_id=run_id, tokenizer=tok, layer_ids=layer_ids,
                   feature_ids=feature_ids(cfg.train, layer_ids, store is not None, cfg.model.arch), start_step=start_step,
                   target_config=target.config, samples=samples, held_out=held_out, eval_convs=prep.eval_convs,
                   feature_store=store, groups=groups, warmup_s=warmup_s, regen_counts=prep.counts,
                   memory=memory)
    targets, caches, estimate = [], [], None
    if place.has_target:
        if store is not None:
            from ..offline.train_from_features import feature_sides
            targets = feature_sides(target, place.target_devices, features_dtype)
            caches = [None] * len(targets)
        else:
            with phases.phase("replicate_targets", devices=len(place.target_devices)):
                targets, caches = _setup_targets(spec, target, resume, prep.features)
        if place.has_drafter and (walk_prompts or held_out):
            from . import acceptance_estimate as est_mod
            # the held-out estimate's prompts (walked: the target's greedy continuations, batched as
            # regeneration batches them) and the target's features on them (one forward, seconds)
            with phases.phase("estimate_prompts", walked=bool(walk_prompts)) as ph:
                if walk_prompts:
                    from ..preflight.inputs import cache_dir
                    from ..prep.regen_cache import RegenCache

                    gen_batch = cfg.data.regen_batch_size or (64 if str(targets[0].device).startswith("cuda") else 16)
                    length = est_mod.continuation_length(cfg.eval.max_new_tokens, cfg.model.block_size)
                    rows = est_mod.eval_prompt_rows(targets[0], tok, prep.eval_convs, n=cfg.train.estimate_samples,
                                                    max_prompt_len=cfg.eval.max_prompt_len,
                                                    max_new_tokens=cfg.eval.max_new_tokens,
                                                    block_size=cfg.model.block_size, pad_id=tok.pad_token_id,
                                                    batch_size=gen_batch,
                                                    cache=RegenCache.for_continuations(
                                                        cache_dir() / "continuations", cfg, targets[0], length))
                    ph.set(continuations_cached=rows.source.get("continuations_cached", 0))
                else:
                    rows = est_mod.held_out_rows(held_out, pad_id=tok.pad_token_id)
                estimate = est_mod.AcceptanceEstimate(train_step, targets[0], rows, layer_ids=layer_ids,
                                                      feature_store=store, every=cfg.train.estimate_every)
                ph.set(prompts=len(rows.start))  # walked or held out: the rows the estimate reads
            if resume and jstate:  # the earlier part's points: the summary's history is the whole run's
                estimate.restore(jstate.get("estimate_history"))
    del target  # a drafter rank keeps no target: only its copies of the embedding and lm_head
    if estimate is not None:
        from .best import BestKeeper
        estimate.keeper = BestKeeper(out, cfg, train_step, spec.target_config, tel, lead=place.lead,
                                     resume=start_step > 0)
        est = estimate
        tel.observable_gauge("dflash.train.acceptance_estimate",
                             lambda: [(e[1], {})] if (e := est.latest()) else [], "1",
                             "Held-out acceptance length per verify step, walked from one drafter pass "
                             "(no decoding).")
    state = RunState(tel=tel, train_step=train_step, targets=targets, feature_caches=caches, vote=vote,
                     sync_timer=sync_timer, estimate=estimate, tokens=tokens, history=history)
    return spec, state


def _check_memory(cfg, place, target, tok, layer_ids, *, resume: bool, dtype, features: bool) -> dict:
    """A drafter whose run cannot fit its device (or, on CPU, the host's memory and this
    process's memory cgroup) is one line (exit 2) now, from its config alone, not an OOM kill
    (rc 137, no word) later. The estimate (preflight/memory.py: the peak phase by phase, on
    top of what this process holds now) goes to summary.json's "memory"."""
    if not place.has_drafter:
        return {}
    from ..model.objective import loss_chunk_rows
    from ..preflight.launch_checks import check_training_memory
    from ..preflight.memory import RunShape

    fields = drafter_config(cfg, target, tok, layer_ids).to_dict()
    dev = torch.device(place.drafter_device)
    tr = cfg.train
    # the head runs chunked where the loss allows it (model/objective.py `DraftLoss.chunked`: no copy head,
    # not a family whose own terms read the full logits)
    chunk = 0 if cfg.model.copy_head or family.of(fields).reads_full_logits else loss_chunk_rows(tr.loss_chunk, dev)
    tshare = {}
    if not features and place.has_target and place.drafter_device in place.target_devices:
        tc = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        tshare = {k: getattr(tc, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                 "num_attention_heads")}
    shape = RunShape(steps=max(tr.steps, 1) if resume else tr.steps, batch_size=tr.batch_size,
                     num_anchors=tr.num_anchors, max_len=cfg.data.max_len, save_every=tr.save_every,
                     estimate_every=tr.estimate_every, eval_after=True, loss_chunk=chunk, loss_vocab=tr.loss_vocab,
                     act_bytes=torch.finfo(dtype).bits // 8, host=dev.type != "cuda",
                     queue_size=cfg.pipeline.queue_size, target=tshare)
    return check_training_memory(fields, place.drafter_device, shape)


def _check_feature_cache(cfg, place, target, prep, est: dict, fids, dtype, room=None) -> dict:
    """`train.feature_cache` keeps every training sequence's target features to the end of the
    run, once per target device: when that does not fit beside the drafter's estimated peak
    (``est``, `_check_memory`'s) where it lives, one line (exit 2) now, not an OOM kill in the
    first epoch. Returns ``est`` with the cache among its parts (summary.json's "memory").
    ``room``: `available_memory` (a test's stand-in)."""
    from ..errors import ConfigError
    from ..preflight import memory as mem
    from ..preflight.launch_checks import available_memory

    room = room or available_memory
    topk = cfg.train.kl_topk if fids[-1] == target_mod.FINAL else 0
    tc = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    width = (len(fids) - (1 if topk else 0)) * tc.hidden_size
    n = cfg.data.max_len
    seqs = {s.ids[:n].tobytes(): min(len(s.ids), n) for s in prep.samples}  # the cache's keys: one per sequence
    total = mem.feature_cache_bytes(sum(seqs.values()), width=width, elem_bytes=torch.finfo(dtype).bits // 8,
                                    topk=topk)
    # what regeneration kept is on the host already (in this process's resident set)
    held = sum(r[:n].nbytes for r in (prep.features or {}).values())
    drafter_dev = torch.device(place.drafter_device) if place.has_drafter else None
    beside = 0  # the cache where the drafter's estimate is: summary.json's peak of that memory
    for dev in dict.fromkeys(torch.device(d) for d in place.target_devices):
        need = max(total - held, 0) if dev.type == "cpu" else total
        shared = drafter_dev is not None and (dev == drafter_dev or dev.type == drafter_dev.type == "cpu")
        peak = est.get("peak", 0) if shared else 0
        beside += total if shared else 0
        now = mem.process_memory()[0] if dev.type == "cpu" else 0
        avail = room(str(dev))
        if avail is not None and peak + need > avail[0]:
            beside = f" beside the drafter's {mem.gib(peak)} at its peak" if peak else ""
            held_now = f" on top of the {mem.gib(now)} this process holds now" if now else ""
            raise ConfigError(
                f"train.feature_cache=true keeps every training sequence's target features: {len(seqs):,} "
                f"sequences, {sum(seqs.values()):,} tokens, {mem.gib(total)} on {dev}{beside}{held_now}, and "
                f"{avail[1]}; set train.feature_cache=false (the target then runs in every epoch), or train "
                f"on fewer samples (data.max_samples) or shorter ones (data.max_len)")
    if est and beside:  # the estimate counts from the first check, before regeneration kept any of it
        est = dict(est, parts=dict(est["parts"], **{"the feature cache": beside}), peak=est["peak"] + beside)
    return est


def _prepare_data(cfg, place, groups, target, tok, resume, layer_ids):
    """Every process of a single-process run or a replica prepares; replicas split the
    regeneration (each rank its shard, replies all-gathered). In a layout rank 0 (a target
    rank) reads the data set, the target ranks split the regeneration and gather the replies
    to rank 0, and rank 0's samples go to every rank: drafter ranks never generate, and nodes
    need no shared file system (each rank's disk cache serves its own resume)."""
    from ..prep.prepare import Prepared, split
    from ..prep.regen_shard import SOLO, Shard

    regen = regenerates(cfg)
    if place.layout is None:
        shard = SOLO
        if place.world > 1 and regen:  # every rank, same order; gloo: the default group may be NCCL
            shard = Shard(place.rank, place.world, _regen_group(None), dst=None)
        # a resumed run does not rebuild the feature cache: no features
        return prepare(cfg, target, tok, device=place.load_device, layer_ids=None if resume else layer_ids,
                       shard=shard)
    n = place.layout.targets
    prep = None
    if regen and n > 1:
        group = _regen_group(list(range(n)))  # every rank calls new_group, drafter ranks too
        if place.has_target:
            parts = dist_mod.broadcast_in(split(cfg) if place.rank == 0 else None, 0, group)
            prep = prepare(cfg, target, tok, device=place.load_device, split_convs=parts,
                           shard=Shard(place.index, n, group, dst=0))
    elif place.rank == 0:
        prep = prepare(cfg, target, tok, device=place.load_device)
    samples, counts = dist_mod.broadcast((prep.samples, prep.counts) if place.rank == 0 else None, 0, groups)
    return Prepared(samples=samples, eval_convs=[], regenerated=regen, counts=counts)


def _regen_group(ranks):
    """A gloo group for regeneration's collectives, as patient as the set-up group: a rank may
    wait there for the slowest shard."""
    import torch.distributed as dist
    from datetime import timedelta

    return dist.new_group(ranks, backend="gloo", timeout=timedelta(hours=6))


def _start_step(place: Placement, out: Path, groups: Groups | None, resume: bool) -> int:
    """Where a resumed run starts: read by the lead from its checkpoint, told to every rank."""
    step = ckpt.load_training_state(out / "checkpoint")[0]["step"] if resume and place.lead else 0
    if place.layout is not None:
        step = dist_mod.broadcast(step, place.layout.drafter_rank(0), groups)
    elif place.world > 1:
        step = dist_mod.broadcast(step, 0, None)
    return step


def _setup_drafter(cfg: Config, place: Placement, out: Path, groups: Groups | None, target, tok, layer_ids,
                   samples, resume: bool, dtype):
    """(the training step, the stop vote, a layout's all-reduce timer, the resumed run's
    trainer_state or None)."""
    ddev = place.drafter_device
    # the drafter's own frozen copies where it has no target beside it (one copy of the pair)
    own = not place.has_target or torch.device(ddev) != target.device
    embed, head = target_mod.embed_and_head(target, ddev if own else None, dtype)
    tstate = jstate = None
    if resume:
        drafter, _ = ckpt.load_drafter(out / "checkpoint", device=ddev, dtype=torch.float32)
        check_fits(drafter.cfg.to_dict(), f"checkpoint {str(out / 'checkpoint')!r}",
                   built=drafter_config(cfg, target, tok, layer_ids))
        tstate, jstate = ckpt.load_training_state(out / "checkpoint")
    elif cfg.model.init_from:  # someone else's drafter (a published one): its weights, this run's data
        from ..checkpoint.init_from import load_into_run
        torch.manual_seed(cfg.train.seed)
        drafter = load_into_run(cfg, target).to(ddev)
    else:
        drafter = build_drafter(cfg, target, tok, layer_ids).to(ddev)
    ddp = sync_timer = vote = None
    if place.layout is not None:  # DDP among the drafter ranks, with the all-reduce wait measured
        ddp = dist_mod.wrap_ddp(drafter, ddev, group=groups.drafters)
        from .roles.sync_timing import attach
        sync_timer = attach(ddp, groups.drafters)
        vote = dist_mod.StopVote(place.drafter_world, group=groups.drafter_votes)
    elif place.world > 1:
        ddp = dist_mod.wrap_ddp(drafter, ddev)
        vote = dist_mod.StopVote(place.world)
    train_step = TrainStep(cfg.train, cfg.model.block_size, drafter, embed, head, ddev, ddp=ddp)
    train_step.use_loss_vocab(samples)
    if cfg.model.draft_vocab and not drafter.cfg.draft_vocab_size and place.rank == 0:
        print(f"model.draft_vocab={cfg.model.draft_vocab} covers the target's whole vocabulary "
              f"({drafter.cfg.vocab_size}): the drafter drafts from all of it (no draft vocabulary)", file=sys.stderr)
    if cfg.model.draft_vocab and drafter.cfg.draft_vocab_size:  # the most frequent training tokens (a resume: the same)
        from ..model.loss_vocab import frequent_tokens
        ids = frequent_tokens(samples, drafter.cfg.draft_vocab_size, exactly=True)
        if cfg.model.init_from and not resume:  # trained rows per draft token follow their tokens
            drafter.move_draft_rows(ids)
        drafter.set_draft_vocab(ids, head)
    if resume:
        train_step.load_state(tstate)
    return train_step, vote, sync_timer, jstate


def _setup_targets(spec: RunSpec, target, resume: bool, features) -> tuple[list, list]:
    """One frozen replica per target device (workers on one device share it), each with its
    own feature cache (train.feature_cache) where a hit must come back: (targets, caches)."""
    cfg, place = spec.cfg, spec.placement
    replicas = {str(target.device): target}
    caches = {}
    if cfg.train.feature_cache:  # a resumed run too: a sequence seen before the resume misses once
        # a loss that reads the target's distribution: the cache keeps its top-k, not the last hidden state
        topk = cfg.train.kl_topk if spec.feature_ids[-1] == target_mod.FINAL else 0
        caches[str(target.device)] = FeatureCache(spec.feature_ids, target.device, target.get_output_embeddings(), topk,
                                                  target.get_input_embeddings().weight)
        caches[str(target.device)].preload(features, cfg.data.max_len)  # regeneration's: no forward in epoch 1
    from ..model.warmup import warm_up
    for d in place.target_devices:
        key = str(torch.device(d))
        if key not in replicas:
            replicas[key] = replicate_target(target, d)
            warm_up(replicas[key], batch_size=cfg.train.batch_size, seq_len=cfg.data.max_len, quiet=True)
            if caches:
                caches[key] = next(iter(caches.values())).replica(d, replicas[key].get_output_embeddings(),
                                                                  replicas[key].get_input_embeddings().weight)
    keys = [str(torch.device(d)) for d in place.target_devices]
    return [replicas[k] for k in keys], [caches.get(k) for k in keys]

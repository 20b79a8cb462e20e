"""`dflash capture --target SPEC --out FEATS`: the target's fused-layer features of the
prepared training samples, on disk (format: feature_index.py), so that any number of
drafters train from them without running the target again (`dflash train --features`).

The samples are what `dflash train` would train on with the same config (data set,
regeneration, chat template, data.max_len, train.seed), so a drafter trained from a
capture sees exactly the batches an online run would. Samples are forwarded in batches
sorted by length (little padding). Under torchrun every rank captures every world-th of
them into its own shards; rank 0 writes the index once all ranks are done (FEATS must be
on a file system every rank writes to).

A stopped capture resumes (`--resume`): the whole shards on disk that belong to this very
capture (same target, layers, dtype and prepared data: their capture id) are kept, and only
the samples none of them holds are captured, split over the ranks of this run (their number
may differ from the first run's).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from ..config import Config, local_device, needs_target_distribution, regenerates, resolve_dtype
from ..data import chat_template
from ..data import dataset as data_mod
from ..errors import ConfigError, interruptible
from ..model import target as target_mod
from ..preflight.inputs import arch_hash
from .feature_index import FORMAT, INDEX, TARGET_DIR, VERSION, FeaturesError, check_positions
from ..phases import phase
from .feature_shards import SHARD_BYTES, ShardWriter, capture_id, data_fingerprint, index_entry, shards_on_disk


def capture(cfg: Config, out: Path, *, shard_bytes: int = SHARD_BYTES, resume: bool = False,
            engine: str = "hf") -> dict:
    """``engine="vllm"``: the features come from vLLM (engine/pipeline.py: its
    `extract_hidden_states` method, one engine start for this rank's samples) instead of the
    loaded target's forward; the shards and index are the same (the key says ``engine:
    vllm``). The HF target is loaded only where HF regenerates; else a meta-device skeleton
    (config, tokenizer, generation config: `load_target_skeleton`) serves the preparation."""
    from ..model.features import target_features
    from ..prep.prepare import prepare
    from ..prep.regen_shard import SOLO, Shard

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    join_ranks(world)
    device = local_device(cfg.pipeline.target_devices[0])
    dtype = resolve_dtype(cfg, device)
    t0 = time.perf_counter()
    with phase("load_target", target=cfg.model.target, dtype=str(dtype).removeprefix("torch.")):
        if engine == "vllm" and not (regenerates(cfg) and cfg.data.regen_engine == "hf"):
            # vLLM runs the weights: here only what the data preparation reads (no weights in memory)
            target, tok = target_mod.load_target_skeleton(cfg.model.target, dtype=dtype, seed=cfg.model.target_seed)
        else:
            target, tok = target_mod.load_target(cfg.model.target, device=device, dtype=dtype,
                                                 seed=cfg.model.target_seed)
    chat_template.configure_from(tok, cfg.data)  # the samples render as training would render them
    L = target_mod.num_layers(target)
    layer_ids = cfg.model.target_layer_ids or target_mod.default_layer_ids(L, cfg.model.num_target_layers)
    shard = SOLO
    if world > 1 and regenerates(cfg):  # the ranks split the regeneration and gather the replies
        shard = Shard(rank, world, None, dst=None)
    # regenerated replies with train.feature_cache: regeneration keeps the layers' outputs it
    # computes anyway (model/features.py), so those samples need no second target pass here
    topk = kl_topk(cfg)
    reuse = world == 1 and engine == "hf" and not topk and regenerates(cfg) and cfg.data.regen_engine == "hf"
    with phase("prepare_data") as ph:
        prep = prepare(cfg, target, tok, device=device, shard=shard, layer_ids=layer_ids if reuse else None)
        ph.set(**prep.span_attributes())
    samples, regen_feats = prep.samples, prep.features or {}
    fingerprint = data_fingerprint(samples)
    _same_on_every_rank(fingerprint, world)
    key = {"target": cfg.model.target, "target_seed": cfg.model.target_seed,
           "arch": arch_hash(target.config)[:16],
           "layer_ids": list(layer_ids), "dtype": str(dtype).removeprefix("torch."), "data": fingerprint}
    if topk:  # only then: an earlier capture's id is unchanged
        key["kl_topk"] = topk
    if engine != "hf":  # only then, as above
        key["engine"] = engine
    cid = capture_id(key)
    # rank 0 alone reads what is on disk, before any rank writes, and every rank gets its
    # answer: ranks that listed the dir themselves could see each other's new shards
    kept, why = _broadcast(_kept_shards(out, cid, len(samples)) if resume and rank == 0 else ([], None), world)
    if why:
        raise ConfigError(why)
    done = {p for s in kept for p in s["positions"]}
    order = sorted(range(len(samples)), key=lambda i: len(samples[i]))
    todo = [i for i in order if i not in done]
    mine = todo[rank::world]
    if resume and rank == 0:
        print(f"resuming the capture in {out}: {len(done)} of {len(samples)} samples are on disk in {len(kept)} "
              f"shard(s); capturing the other {len(todo)}", file=sys.stderr)
    bs = max(1, cfg.train.batch_size)
    H = target.config.get_text_config().hidden_size
    first = 1 + max((s["number"] for s in kept if s["rank"] == rank), default=-1)
    writer = ShardWriter(out, rank, shard_bytes, capture=cid, first=first)
    t1 = time.perf_counter()
    outside, reused = None, 0
    capturing = phase("capture", samples=len(mine), engine=engine)
    capturing.__enter__()  # ended below, or by the run's end with its error (dflash/phases.py)
    if engine == "vllm" and mine:
        from ..engine import pipeline
        with phase("capture_engine", samples=len(mine)):
            outside = pipeline.hidden_states(cfg.model.target, cfg.model.target_seed,
                                             [samples[i].input_ids for i in mine], layer_ids,
                                             dtype=str(dtype).removeprefix("torch."))
    for b in range(0, len(mine), bs):
        idx = mine[b:b + bs]
        batch = data_mod.collate([samples[i] for i in idx], tok.pad_token_id, b // bs)
        if outside is not None:
            for k, i in enumerate(idx):
                writer.add(i, samples[i], outside[b + k].to(dtype))
            continue
        kept_rows = [regen_feats.get(tuple(samples[i].input_ids)) for i in idx]
        if all(f is not None and len(f) == len(samples[i]) for f, i in zip(kept_rows, idx)):
            for f, i in zip(kept_rows, idx):  # what regeneration computed (within 2e-4 of a forward's)
                writer.add(i, samples[i], f.to(dtype))
            reused += len(idx)
            continue
        if topk:  # the last hidden state too, for the target's top-k next-token log-probs
            feats = target_features(target, batch, list(layer_ids) + [target_mod.FINAL], device)
            feats, dist = feats[..., :-H], top_logprobs(target, feats[..., -H:], topk)
            dist = (dist[0].to("cpu"), dist[1].to("cpu"))
        else:
            feats = target_features(target, batch, layer_ids, device)
        feats = feats.to("cpu")
        for k, i in enumerate(idx):
            n = batch.lengths[k]
            writer.add(i, samples[i], feats[k, :n], kl=(dist[0][k, :n], dist[1][k, :n]) if topk else None)
        capturing.progress(b + len(idx), len(mine))
    shards = writer.finish()
    capturing.progress(len(mine), len(mine))
    capturing.__exit__(None, None, None)
    took = time.perf_counter() - t1
    tokens = sum(s["tokens"] for s in shards)
    reuse_note = f"; {reused} with the features regeneration kept (no forward)" if reused else ""
    print(f"rank {rank}: captured {sum(s['samples'] for s in shards)} samples, {tokens} tokens in "
          f"{len(shards)} shard(s), {took:.1f} s ({tokens / max(took, 1e-9):.0f} tokens/s){reuse_note}",
          file=sys.stderr)
    with phase("gather_shards", collective=True):
        every = _gather((shards, mine), world)
    if rank != 0:
        return {}
    all_shards = [index_entry(s) for s in kept] + [s for part, _ in every for s in part]
    held = [*done, *(p for _, m in every for p in m)]
    if sorted(held) != list(range(len(samples))):  # each sample in exactly one shard, or no index
        raise RuntimeError(f"capture: the shards hold {len(held)} samples ({len(set(held))} distinct), "
                           f"{len(samples)} were prepared; run it again with --overwrite")
    total_tokens = sum(s["tokens"] for s in all_shards)
    F = len(layer_ids) * target.config.get_text_config().hidden_size
    disk = sum(s["bytes"] for s in all_shards)
    index = {"format": FORMAT, "version": VERSION, "written_by": "dflash capture", "key": key,
             "feature_dim": F, "num_target_layers": L, "samples": len(samples), "tokens": total_tokens,
             "bytes": disk, "bytes_per_token": round(disk / max(total_tokens, 1), 1),
             "feature_bytes_per_token": F * torch.tensor([], dtype=dtype).element_size(),
             # train.loss=kl: the target's top-k next-token log-probs (fp16) and ids (int32) per token
             "kl_topk": topk, "kl_bytes_per_token": topk * (2 + 4),
             "world_size": world, "shards": all_shards, "resumed_with": len(done),
             "data": {k: getattr(cfg.data, k) for k in ("path", "num_conversations", "max_len", "regenerate",
                                                        "regen_max_new_tokens", "regen_max_prompt_len")}
                     | {"train_seed": cfg.train.seed, "min_loss_tokens": 2 * cfg.model.block_size},
             "seconds": {"load_and_prepare": round(t1 - t0, 1), "capture": round(took, 1)},
             "from_regeneration": reused}  # samples whose features regeneration kept (rank 0's count)
    target.config.save_pretrained(out / TARGET_DIR)
    tmp = out / f".{INDEX}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    os.replace(tmp, out / INDEX)  # last: a dir with an index is a finished capture
    return index


def kl_topk(cfg: Config) -> int:
    """How many of the target's most likely next tokens a capture keeps per token: the run's
    `train.kl_topk` when its loss needs the target's distribution, else none."""
    return cfg.train.kl_topk if needs_target_distribution(cfg.train.loss, cfg.model.arch) else 0


def top_logprobs(target, last: torch.Tensor, k: int, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-k next-token log-probs (fp16) and ids (int32) at every position of
    ``last`` [B, S, H] (its final hidden state), a chunk of positions at a time: the full
    rows ([positions x vocabulary]) are never all in memory."""
    head = target.get_output_embeddings()
    flat = last.reshape(-1, last.shape[-1])
    vals, ids = [], []
    with torch.no_grad():
        for a in range(0, flat.shape[0], chunk):
            logp = torch.log_softmax(head(flat[a:a + chunk]).float(), dim=-1)
            v, i = logp.topk(k, dim=-1)
            vals.append(v.to(torch.float16))
            ids.append(i.to(torch.int32))
    shape = (*last.shape[:-1], k)
    return torch.cat(vals).view(shape), torch.cat(ids).view(shape)


def _kept_shards(out: Path, cid: str, samples: int) -> tuple[list[dict], str | None]:
    """A resumed capture's whole shards, or why they cannot be kept (one line, exit 2): checked
    before anything is captured, each as training checks it, their positions within the
    ``samples`` this run prepared."""
    try:
        kept = shards_on_disk(out, f"--resume {out}")
        seen: set = set()
        for s in kept:
            check_positions(s, seen, samples, f"--resume {out}")
    except FeaturesError as e:
        return [], f"{e}; capture again with --overwrite"
    old = [s["file"] for s in kept if s["capture"] is None]
    other = [s["file"] for s in kept if s["capture"] not in (None, cid)]
    if old:
        return [], (f"--resume: {out} holds {len(old)} shard(s) written by a dflash from before resumable "
                    f"captures ({old[0]}, ...); capture again with --overwrite")
    if other:
        return [], (f"--resume: {out} holds {len(other)} shard(s) of another capture ({other[0]}, ...): the "
                    "target, layers, dtype or prepared data differ from this run's; run it with the first "
                    "run's settings, or with --overwrite to capture again")
    return kept, None


def join_ranks(world: int) -> None:
    """The capture's process group, joined once (commands/capture.py may have joined it first,
    to agree on the run id): gloo, object collectives only (replies, shard lists, fingerprints);
    as patient as a training run's set-up: a rank may wait there for the slowest regeneration shard."""
    if world <= 1:
        return
    import torch.distributed as dist
    from datetime import timedelta
    if not dist.is_initialized():
        with phase("join_ranks", collective=True, world_size=world):  # a signal stops a waiting rank
            interruptible(dist.init_process_group, "gloo", timeout=timedelta(hours=6))


def agreed_run_id(world: int) -> str:
    """Without torchrun's agent store (Slurm, an operator's launcher): the ranks join, and rank
    0's run id is everyone's, so that every rank's spans land in one trace."""
    import uuid
    join_ranks(world)
    return _broadcast(os.environ.get("DFLASH_RUN_ID") or uuid.uuid4().hex, world)


def _broadcast(obj, world: int):
    if world == 1:
        return obj
    import torch.distributed as dist
    box = [obj]
    interruptible(dist.broadcast_object_list, box, src=0)  # a rank waiting for another still takes a signal
    return box[0]


def _same_on_every_rank(fingerprint: str, world: int) -> None:
    if world == 1:
        return
    prints = _gather(fingerprint, world)
    if len(set(prints)) != 1:
        raise RuntimeError(f"capture: the ranks prepared different samples ({len(set(prints))} versions); "
                           "every rank needs the same data set and config")


def _gather(obj, world: int) -> list:
    if world == 1:
        return [obj]
    import torch.distributed as dist
    out: list = [None] * world
    interruptible(dist.all_gather_object, out, obj)
    return out

"""A regeneration in a process of its own, for tests/integration/test_regen_shards.py and
bench/regen_ranks.py: the tiny-qwen3 target regenerates a few ShareGPT conversations
through the shard cache in $DFLASH_CACHE, and writes what it got to OUT (JSON).

    python tests/regen_child.py OUT [--hold-after K] [--convs N] [--new T] [--batch B] [--threads 1] [--take K]
                                    [--workers W]

Under torchrun every rank takes a shard (gloo) and writes OUT.rank{R}.json; each rank
gets its own cache (``$DFLASH_CACHE/rank{R}``) when DFLASH_CACHE_PER_RANK=1, as on nodes
that share no file system. ``--hold-after K`` is the fault a kill test needs: the K+1-th
batch blocks inside generate() (a batch in flight) after K batches are on disk, so a
``kill -9`` lands mid-regeneration without any timing luck.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--hold-after", type=int, default=-1)
    ap.add_argument("--convs", type=int, default=16)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--take", type=int, default=0, help="only the first K training conversations")
    ap.add_argument("--workers", type=int, default=1, help="data.regen_workers (1: batches one at a time, so "
                    "--hold-after's K batches are on disk when the next one holds)")
    a = ap.parse_args()

    import torch
    if a.threads:
        torch.set_num_threads(a.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0")) if world > 1 else 0
    if world > 1 and os.environ.get("DFLASH_CACHE_PER_RANK") == "1":
        os.environ["DFLASH_CACHE"] = str(Path(os.environ["DFLASH_CACHE"]) / f"rank{rank}")

    from dflash.config import load_config
    from dflash.model import target as target_mod
    from dflash.prep import prepare as prep_mod
    from dflash.prep import regenerate as regen_mod
    from dflash.prep.regen_shard import SOLO, Shard

    cfg = load_config(None, ["model.target=tiny-qwen3", f"data.num_conversations={a.convs}",
                             f"data.regen_max_new_tokens={a.new}", "data.regen_max_prompt_len=48",
                             f"data.regen_batch_size={a.batch}", "data.regenerate=on",
                             f"data.regen_workers={a.workers}"])
    target, tok = target_mod.load_target("tiny-qwen3", seed=cfg.model.target_seed)
    convs = prep_mod.split(cfg)[0]
    convs = convs[:a.take] if a.take else convs
    if a.hold_after >= 0:
        real, calls = regen_mod._generate_left_padded, []

        def held(*args, **kw):
            calls.append(1)
            if len(calls) > a.hold_after:  # a batch in flight that never ends: the test kills us here
                Path(a.out + ".held").write_text("1")
                threading.Event().wait()
            return real(*args, **kw)

        regen_mod._generate_left_padded = held
    shard = SOLO
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        shard = Shard(rank, world, dist.new_group(backend="gloo"), dst=None)
    counts: dict = {}
    out, _ = prep_mod._regen_cached(cfg, target, tok, convs, "cpu", shard=shard, counts=counts)
    path = a.out if world == 1 else f"{a.out}.rank{rank}.json"
    Path(path).write_text(json.dumps({"rank": rank, "world": world, "counts": counts, "replies": out}))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

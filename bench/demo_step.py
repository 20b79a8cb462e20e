"""The demo's drafter step (configs/demo.yaml) timed on the CPU against several checkouts or
settings, arms interleaved: does a change slow `make demo`'s training?

The demo trains from the features regeneration kept (train.feature_cache): its steady-state
step is the drafter's alone, drafter_forward -> backward -> optimizer_step through
`TrainStep`, on SmolLM2-135M's geometry (hidden 576, vocab 49,152), 2 drafter layers, 3 fused
layers, block 4, 16 anchors, batch 4, max_len 160, D-PACE weights, loss_vocab 4096. Here the
target is a random Qwen3 of that geometry (only its embedding and lm_head enter the step) and
the features random (their values do not change the work). Each arm is a checkout (its
`dflash/` on PYTHONPATH) plus `--set` overrides, run in its own process per round, the order
flipped each round; only APIs every checkout has are used (load_config, load_target,
build_drafter, TrainStep).

    .venv/bin/python bench/demo_step.py --arm base=/tmp/base --arm branch=. \\
        --arm branch+chunk=.:train.loss_chunk=8192 --rounds 5 --steps 30

Last line: one JSON object (per arm: median step ms per round, and their median).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(args) -> None:
    """One arm, one round, in this process: `--steps` timed steps after `--warmup`."""
    import torch

    from dflash.config import load_config
    from dflash.data.batch import Batch
    from dflash.data.sample import Sample
    from dflash.model import target as T
    from dflash.model.build import build_drafter
    from dflash.run.step import TrainStep

    torch.set_num_threads(args.threads)
    cfg = load_config(os.path.join(HERE, "..", "configs", "demo.yaml"),
                      [f"model.target={args.target}", "model.drafter_init=random", "model.draft_vocab=0",
                       *args.set])
    target, tok = T.load_target(args.target)
    layer_ids = T.default_layer_ids(T.num_layers(target), cfg.model.num_target_layers)
    drafter = build_drafter(cfg, target, tok, layer_ids)
    st = TrainStep(cfg.train, cfg.model.block_size, drafter, target.get_input_embeddings(),
                   target.get_output_embeddings(), "cpu")
    g = torch.Generator().manual_seed(0)
    st.use_loss_vocab([Sample(torch.randint(0, len(tok), (80000,), generator=g).tolist(), [1] * 80000)])
    B, S, H = cfg.train.batch_size, cfg.data.max_len, target.config.hidden_size
    times, losses = [], []
    for s in range(args.warmup + args.steps):
        ids = torch.randint(0, len(tok), (B, S), generator=g)
        lm = torch.ones_like(ids)
        lm[:, : S // 3] = 0
        b = Batch(index=s, input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=lm, lengths=[S] * B)
        feats = torch.randn(B, S, len(layer_ids) * H, generator=g)
        t0 = time.perf_counter()
        loss, _ = st.forward(feats, b)
        st.backward(loss)
        st.optimizer_step(loss)
        if s >= args.warmup:
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
    print(json.dumps({"step_ms": statistics.median(times) * 1e3, "loss_first": losses[0]}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", action="append", default=[],
                    help="NAME=CHECKOUT[:key=value:...]: a checkout's dflash/ and --set overrides")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target", default="", help="a model dir of SmolLM2's geometry (default: written once)")
    ap.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    arms = []
    for spec in args.arm:
        name, _, rest = spec.partition("=")
        tree, *sets = rest.split(":")
        if not name or not os.path.isdir(os.path.join(tree, "dflash")):
            print(f"demo_step: error: --arm {spec!r}: expected NAME=CHECKOUT[:key=value...] with CHECKOUT/dflash",
                  file=sys.stderr)
            return 2
        arms.append((name, os.path.abspath(tree), sets))
    if not arms:
        print("demo_step: error: no --arm given", file=sys.stderr)
        return 2
    target = args.target
    if not target:  # SmolLM2-135M's geometry, random: written once by bench/recipe_step.py's writer
        sys.path.insert(0, HERE)
        import recipe_step
        target = recipe_step.make_target_dir(os.path.join(os.path.expanduser("~"), ".cache", "dflash-bench"),
                                             "demo", recipe_step.SHAPES["demo"][0], "cpu")
    res: dict = {name: [] for name, _, _ in arms}
    losses: dict = {}
    for rnd in range(args.rounds):
        for name, tree, sets in (arms if rnd % 2 == 0 else arms[::-1]):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--target", target, "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--threads", str(args.threads), *sum((["--set", s] for s in sets), [])]
            env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS=str(args.threads))
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
            if p.returncode != 0:
                print(p.stderr[-3000:], file=sys.stderr)
                return 1
            r = json.loads(p.stdout.strip().splitlines()[-1])
            res[name].append(round(r["step_ms"], 1))
            losses[name] = round(r["loss_first"], 6)
            print(f"round {rnd}: {name}: {r['step_ms']:.1f} ms/step", flush=True)
    first = arms[0][0]
    out = {"load": os.getloadavg()[0], "arms": {}}
    for name, xs in res.items():
        out["arms"][name] = {"step_ms_per_round": xs, "median_ms": statistics.median(xs), "loss_first": losses[name],
                             f"vs_{first}": round(statistics.median(xs) / statistics.median(res[first]), 3)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

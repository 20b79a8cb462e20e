"""DFlash vs DFlash2 (model.arch) side by side: the served drafter's tau per verify step after
the same number of training steps, same data, same prompts, a few seeds (docs/architectures.md
holds the latest table).

Each run is a real `dflash train --eval` (a subprocess, one after another); the drafter scored
is the one in OUT/export, read back from the served format, decoded by our decoder (DFlash2:
the selector's greedy chain, as vLLM picks it).

    .venv/bin/python bench/dflash2.py --seeds 0,1,2            # tiny-qwen3, 200 steps each
A run dir already in --out with its eval is kept (an interrupted bench resumes). Prints a
table; the last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BASE = ["--target", "tiny-qwen3", "--set", "data.num_conversations=96", "--set", "model.block_size=8",
        "--set", "data.max_len=96", "--set", "eval.prompts=8", "--set", "eval.max_new_tokens=32",
        "--set", "eval.before=false", "--set", "eval.baseline=none", "--set", "train.batch_size=4",
        "--set", "train.lr=3e-3", "--set", "train.estimate_every=0", "--no-telemetry"]
# DFlash2 at the published checkpoint's sizes (configs/dflash2-paper.yaml): conv 2 taps x 16
# channels, selector rank 256 over the top 16; the selector's loss at weight 1
ARCHS = {"dflash": [], "dflash2": ["--set", "model.arch=dflash2"]}


def train(arch: str, seed: int, steps: int, out: Path) -> dict:
    run = out / f"{arch}-s{seed}-{steps}"
    if not ((run / "summary.json").is_file() and "eval_after" in json.loads((run / "summary.json").read_text())):
        cmd = [sys.executable, "-m", "dflash", "train", *BASE, *ARCHS[arch], "--eval", "--overwrite",
               "--set", f"out={run}", "--set", f"train.steps={steps}", "--set", f"train.seed={seed}"]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"bench/dflash2.py: {' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-3000:]}")
    s = json.loads((run / "summary.json").read_text())
    ev = s["eval_after"]
    return {"arch": arch, "seed": seed, "steps": s["steps"], "wall_s": round(s["wall_s"], 1),
            "loss_last": s["loss_last"], "tau": ev["tau_per_step"], "tau_per_response": ev["acceptance_length"],
            "lossless": ev["lossless"], "histogram": ev["histogram"],
            "per_position": ev.get("per_position_acceptance")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="/tmp/dflash-bench-dflash2")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    rows = [train(arch, int(s), a.steps, Path(a.out)) for s in a.seeds.split(",") for arch in ARCHS]
    print(f"\nequal steps ({a.steps}), tiny-qwen3, block 8")
    print(f"{'arch':8} {'train s':>8} {'tau per step':>16} {'per response':>16}  lossless  per seed (per step)")
    for arch in ARCHS:
        rs = [r for r in rows if r["arch"] == arch]
        taus, resp = [r["tau"] for r in rs], [r["tau_per_response"] for r in rs]
        sd = statistics.stdev(taus) if len(taus) > 1 else 0.0
        sd_r = statistics.stdev(resp) if len(resp) > 1 else 0.0
        print(f"{arch:8} {statistics.mean(r['wall_s'] for r in rs):8.0f} {statistics.mean(taus):9.3f} ± {sd:.3f} "
              f"{statistics.mean(resp):9.3f} ± {sd_r:.3f}  "
              f"{all(r['lossless'] for r in rs)!s:8}  " + " ".join(f"{t:.3f}" for t in taus))
    print(json.dumps({"steps": a.steps, "rows": rows}))


if __name__ == "__main__":
    main()

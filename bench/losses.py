"""The field's losses side by side: the served drafter's tau after training with each, on
the same prompts, beside prompt lookup's (docs/losses.md holds the latest table).

Each run is a real `dflash train --eval` (a subprocess, one after another, so they share
the machine alike); the served drafter is scored, never a copy head. Two budgets:

- equal steps: every loss trains `--steps` optimizer steps;
- equal wall time (`--equal-time`): every loss but CE trains the steps that CE's wall time
  buys at its own measured step cost (wall_s of the equal-steps runs), so a dearer loss
  pays for its cost in steps.

    .venv/bin/python bench/losses.py --base demo --seeds 0                 # SmolLM2, the demo's held-out prompts
    .venv/bin/python bench/losses.py --base tiny --seeds 0,1,2             # tiny-qwen3, 3 seeds
A run dir already in --out with its eval is kept (an interrupted bench resumes where it
stopped). Prints a table; the last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (train.loss, train.loss_weights)
RUNS = {"ce": ("ce", "decay"), "kl": ("kl", "decay"), "dpace": ("ce", "dpace"),
        "kl+dpace": ("kl", "dpace"), "lk": ("lk", "decay")}

# The two bases: the demo's recipe without the copy head (what `make demo` serves), scored on
# all its held-out prompts (64 since 2026-12-08; docs/losses.md's tables were on the 16 before); and tiny-qwen3 (random weights, so seeds carry the noise).
BASES = {
    "demo": ["--config", "configs/demo.yaml", "--set", "model.copy_head=false"],
    "tiny": ["--target", "tiny-qwen3", "--set", "data.num_conversations=96", "--set", "model.block_size=4",
             "--set", "data.max_len=96", "--set", "eval.prompts=8", "--set", "eval.max_new_tokens=32",
             "--set", "eval.before=false", "--set", "train.batch_size=4", "--set", "train.lr=3e-3",
             "--set", "train.estimate_every=0"],
}
DEFAULT_STEPS = {"demo": 600, "tiny": 200}


def train(base: str, name: str, seed: int, steps: int, out: Path) -> dict:
    loss, weights = RUNS[name]
    run = out / f"{name}-s{seed}-{steps}"
    if (run / "summary.json").is_file() and "eval_after" in json.loads((run / "summary.json").read_text()):
        return result(name, seed, run, 0.0)  # measured by an earlier, interrupted bench: kept
    cmd = [sys.executable, "-m", "dflash", "train", *BASES[base], "--eval", "--overwrite",
           "--set", f"out={run}", "--set", f"train.steps={steps}", "--set", f"train.seed={seed}",
           "--set", f"train.loss={loss}", "--set", f"train.loss_weights={weights}"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"bench/losses.py: {' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return result(name, seed, run, time.perf_counter() - t0)


def result(name: str, seed: int, run: Path, total_s: float) -> dict:
    s = json.loads((run / "summary.json").read_text())
    ev = s["eval_after"]
    return {"run": name, "seed": seed, "steps": s["steps"], "wall_s": s["wall_s"],
            "loss_last": s["loss_last"], "tau": ev["acceptance_length"],
            "lookup": ev["baseline"]["acceptance_length"],
            "per_position": ev.get("per_position_acceptance"), "total_s": round(total_s, 1)}


def mean_sd(xs):
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'loss':10} {'steps':>6} {'train s':>8} {'served tau':>16} {'prompt lookup':>14}  per seed")
    for name in RUNS:
        rs = [r for r in rows if r["run"] == name]
        if not rs:
            continue
        m, sd = mean_sd([r["tau"] for r in rs])
        lk = statistics.mean(r["lookup"] for r in rs)
        steps = "/".join(sorted({str(r["steps"]) for r in rs}))
        wall = statistics.mean(r["wall_s"] for r in rs)
        print(f"{name:10} {steps:>6} {wall:8.0f} {m:9.3f} ± {sd:.3f} {lk:14.3f}  "
              + " ".join(f"{r['tau']:.3f}" for r in rs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", choices=sorted(BASES), default="tiny")
    ap.add_argument("--runs", default=",".join(RUNS), help="comma list of " + ", ".join(RUNS))
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--equal-time", action="store_true", help="also train at CE's wall time")
    ap.add_argument("--out", default="/tmp/dflash-bench-losses")
    a = ap.parse_args()
    names = [n for n in a.runs.split(",") if n]
    if bad := [n for n in names if n not in RUNS]:
        sys.exit(f"bench/losses.py: --runs {','.join(bad)}: expected some of {', '.join(RUNS)}")
    seeds = [int(s) for s in a.seeds.split(",")]
    steps = a.steps or DEFAULT_STEPS[a.base]
    out = Path(a.out)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    equal_steps = [train(a.base, n, s, steps, out) for s in seeds for n in names]
    table(f"equal steps ({steps}), base {a.base}", equal_steps)
    result = {"base": a.base, "steps": steps, "seeds": seeds, "equal_steps": equal_steps}
    if a.equal_time and "ce" in names:
        ce_wall = statistics.mean(r["wall_s"] for r in equal_steps if r["run"] == "ce")
        timed = [r for r in equal_steps if r["run"] == "ce"]
        for n in names:
            if n == "ce":
                continue
            wall = statistics.mean(r["wall_s"] for r in equal_steps if r["run"] == n)
            n_steps = max(1, round(steps * ce_wall / wall))
            if abs(n_steps - steps) <= steps // 20:  # within 5%: the equal-steps runs are the answer
                timed += [r for r in equal_steps if r["run"] == n]
            else:
                timed += [train(a.base, n, s, n_steps, out) for s in seeds]
        table(f"equal wall time (CE's {ce_wall:.0f} s of training), base {a.base}", timed)
        result["equal_time"] = timed
    print(json.dumps(result))


if __name__ == "__main__":
    main()

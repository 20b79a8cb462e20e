"""Topology scaling: tokens/s with 3 target ranks vs 1, the same single drafter rank.

Two real torchrun runs on CPU (gloo), interleaved round by round, each on the same cached
data. `--inject-delay model_forward=D` makes each target forward take D seconds at no CPU
cost, so the target side is the bottleneck however few cores the machine has; D must
stay above 3x the drafter's step (about 0.15 s on 2 cores) so that three target ranks
still do not outrun the one drafter rank. Here (OMP_NUM_THREADS=1 per rank, as torchrun
sets it) the drafter's work is about 0.31 s per batch, hence the default of 1.0 s; the
table prints the measured figure, and a note when the delay is below 3x it. tokens/s is the lead drafter's own figure
(summary.json: tokens trained / wall time of its training loop). Also prints the
balance answer `dflash stalls` gives for each run. Ends with one JSON line.

    python bench/topology.py [--steps 30] [--delay 1.0] [--rounds 1]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TINY = ["--set", "data.num_conversations=48", "--set", "data.max_len=96",
        "--set", "data.regen_max_new_tokens=40", "--set", "data.regen_max_prompt_len=48",
        "--set", "train.batch_size=2", "--set", "train.num_anchors=4", "--set", "model.block_size=8"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def once(targets: int, steps: int, delay: float, out: Path) -> dict:
    env = dict(os.environ) | {"OMP_NUM_THREADS": "1", "OTEL_TRACES_EXPORTER": "", "OTEL_METRICS_EXPORTER": "",
                              "OTEL_EXPORTER_OTLP_ENDPOINT": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(targets + 1),
           "--master_port", str(_port()), "-m", "dflash", "train", "--out", str(out), "--target", "tiny-llama",
           "--steps", str(steps), "--layout", f"target:{targets},drafter:1", *TINY,
           "--set", f"pipeline.queue_size={max(4, 2 * targets)}",
           "--inject-delay", f"model_forward={delay}"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"torchrun with {targets} target ranks failed:\n{p.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    from dflash.analysis.balance import balance
    from dflash.analysis.stalls import load
    _, spans, _ = load(str(out))
    return {"tokens_per_s": s["tokens_per_s"], "wall_s": s["wall_s"], "balance": balance(spans)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--delay", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    res: dict = {1: [], 3: []}
    bal = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for n in (1, 3):
                got = once(n, a.steps, a.delay, Path(tmp) / f"t{n}r{r}")
                res[n].append(got["tokens_per_s"])
                bal[n] = got["balance"]
    tps = {n: statistics.median(v) for n, v in res.items()}
    ratio = tps[3] / tps[1]
    print(f"{'layout':<22}{'tokens/s':>10}{'target ms/batch':>17}{'drafter ms/batch':>18}{'balanced T:D':>14}")
    for n in (1, 3):
        b = bal[n] or {}
        print(f"target:{n},drafter:1{'':<4}{tps[n]:>10.1f}{b.get('target_s_per_batch', 0) * 1e3:>17.1f}"
              f"{b.get('drafter_s_per_batch', 0) * 1e3:>18.1f}{b.get('balanced_targets_per_drafter', 0):>14.2f}")
    print(f"scaling 3 target ranks / 1 target rank: {ratio:.2f}x (goal >= 2.5x); "
          f"delay {a.delay}s, {a.steps} steps, {a.rounds} round(s)")
    dw = max((b or {}).get("drafter_s_per_batch", 0) for b in bal.values())
    if a.delay < 3 * dw:
        print(f"note: the delay {a.delay}s is below 3x the drafter's {dw:.3f}s per batch: with 3 target ranks "
              f"the drafter may be the bottleneck, and the ratio then measures it, not the target side")
    print(json.dumps({"tokens_per_s": tps, "scaling": round(ratio, 3), "delay_s": a.delay, "steps": a.steps,
                      "balance": bal}))


if __name__ == "__main__":
    main()

"""Pipeline throughput: telemetry on vs off, pipelined vs the single-process loop.

All variants run in this one process, interleaved round by round (these machines are
noisy: side-by-side alternation is the only fair comparison), each from the same seed on
the same cached data. Only the training loop is timed. Prints a table, then one JSON line.

    python bench/pipeline.py [--target tiny-qwen3] [--steps 40] [--rounds 3] [--settle 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.config import load_config  # noqa: E402
from dflash.run.trainer import Trainer  # noqa: E402


def once(base_args: list[str], out: str, pipelined: bool, telemetry: bool, mode: str,
         settle_s: float = 2.0) -> float:
    import otel

    cfg = load_config(None, base_args + [f"out={out}", f"pipeline.pipelined={pipelined}",
                                         f"telemetry.enabled={telemetry}", f"telemetry.mode={mode}"])
    trainer = Trainer(cfg)  # set up: target, data, drafter, telemetry
    # Steady state: the spawned exporter process spends its first ~1-2 s of CPU importing
    # the OpenTelemetry SDK; on 2 cores that start-up would land inside a short timed loop.
    # Every variant waits the same, so the ratio measures per-step overhead only.
    time.sleep(settle_s)
    try:
        t0 = time.perf_counter()
        trainer.run_steps()  # the reference loop or the pipeline: cfg.pipeline.pipelined
        wall = time.perf_counter() - t0
    finally:
        trainer.state.tel.shutdown(timeout_s=2.0)
    return trainer.state.tokens / wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="tiny-qwen3")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle", type=float, default=2.0, help="seconds between setup and the timed loop")
    a = ap.parse_args()
    base = [f"model.target={a.target}", f"train.steps={a.steps}", "data.num_conversations=48",
            "data.max_len=96", "data.regen_max_new_tokens=40", "data.regen_max_prompt_len=48",
            "train.batch_size=2", "train.num_anchors=4", "model.block_size=8", "telemetry.console_interval_s=0"]
    variants = {
        "pipelined+telemetry(process)": (True, True, "process"),
        "pipelined, telemetry off": (True, False, "process"),
        "pipelined+telemetry(thread)": (True, True, "thread"),
        "reference loop, telemetry off": (False, False, "process"),
    }
    res: dict[str, list[float]] = {k: [] for k in variants}
    with tempfile.TemporaryDirectory() as tmp:
        once(base, f"{tmp}/warm", True, False, "process")  # warm-up: caches, allocator, kernels
        for r in range(a.rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in order:
                res[name].append(once(base, f"{tmp}/{r}-{len(res[name])}", *variants[name], settle_s=a.settle))
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"{'variant':34s} {'median tok/s':>12s}  runs")
    for k, v in res.items():
        print(f"{k:34s} {med[k]:12.1f}  {' '.join(f'{x:.0f}' for x in v)}")
    ratios = {
        "telemetry_process_over_off": med["pipelined+telemetry(process)"] / med["pipelined, telemetry off"],
        "telemetry_thread_over_off": med["pipelined+telemetry(thread)"] / med["pipelined, telemetry off"],
        "pipelined_over_reference": med["pipelined, telemetry off"] / med["reference loop, telemetry off"],
    }
    for k, v in ratios.items():
        print(f"{k:34s} {v:.3f}")
    print(json.dumps({"bench": "pipeline", "target": a.target, "steps": a.steps, "rounds": a.rounds,
                      "median_tokens_per_s": {k: round(v, 1) for k, v in med.items()},
                      "ratios": {k: round(v, 4) for k, v in ratios.items()}}))


if __name__ == "__main__":
    main()

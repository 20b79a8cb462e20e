"""A tracker that is down costs the training nothing: tokens/s and the loss history with
no tracker vs with MLflow pointed at a dead server (connection refused every try), and
vs TensorBoard + a live local MLflow store.

Same method as bench/pipeline.py: every variant in this one process, interleaved round by
round, same seed and cached data; only the training loop is timed; ratios are paired within a
round. Because a shared machine's tokens/s swings, it also reports a figure that does not
swing: the CPU time the bridge threads used during the timed loop (from /proc), over the
loop's wall time. The bridge is started
as `dflash train` starts it and the timed loop begins once each tracker has made its
first attempt (opened, or failed and fallen back): importing mlflow (~2 s of CPU, once per
run) is not what this measures. Prints a table, then one JSON line.

    python bench/dead_tracker.py [--steps 100] [--rounds 3] [--interval 1] [--settle 5]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash import trackers  # noqa: E402
from dflash.config import load_config  # noqa: E402
from dflash.run import readback  # noqa: E402
from dflash.run.trainer import Trainer  # noqa: E402


def _dead_uri() -> str:
    """A loopback port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _thread_cpu_s(threads) -> float:
    """CPU seconds the given threads used so far (Linux: /proc/self/task/<tid>/stat): what
    the bridge could take from the training, whatever else the machine is doing."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for t in threads:
        try:
            fields = Path(f"/proc/self/task/{t.native_id}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, TypeError):
            pass
    return total


def once(base: list[str], out: str, names: list[str], uri: str | None, settle_s: float = 5.0) -> tuple[float, list, dict]:
    if uri:
        os.environ["MLFLOW_TRACKING_URI"] = uri
    else:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    cfg = load_config(None, base + [f"out={out}", f"telemetry.trackers={','.join(names)}"])
    trainer = Trainer(cfg)
    spec, state = trainer.spec, trainer.state
    bridge = trackers.start(spec, state)
    deadline = time.monotonic() + 120
    while bridge and time.monotonic() < deadline and any(not r.opened and not r.failures for r in bridge.runners):
        time.sleep(0.05)
    time.sleep(settle_s)  # the exporter process's start-up, as in bench/pipeline.py: the same for all
    threads = [r.thread for r in bridge.runners] if bridge else []
    try:
        cpu0, t0 = _thread_cpu_s(threads), time.perf_counter()
        trainer.run_steps()
        wall = time.perf_counter() - t0
        bridge_cpu = _thread_cpu_s(threads) - cpu0
        readback.finish(state)
    finally:
        state.tel.shutdown(timeout_s=2.0)
    status = {}
    if bridge is not None:
        t1 = time.perf_counter()
        bridge.close({"steps": state.train_step.step, "tokens": state.tokens, "telemetry": state.tel.summary()})
        status = {n: {**s, "close_s": round(time.perf_counter() - t1, 3)} for n, s in bridge.status().items()}
    status["bridge_cpu_s"], status["loop_s"] = round(bridge_cpu, 3), round(wall, 2)
    return state.tokens / wall, [round(h[1], 6) for h in state.history], status


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="tiny-qwen3")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--settle", type=float, default=5.0, help="seconds between set-up and the timed loop")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--interval", type=float, default=1.0, help="bridge push interval (s); 10 in real runs")
    a = ap.parse_args()
    os.environ["DFLASH_TRACKER_INTERVAL_S"] = str(a.interval)
    base = [f"model.target={a.target}", f"train.steps={a.steps}", "data.num_conversations=48",
            "data.max_len=96", "data.regen_max_new_tokens=40", "data.regen_max_prompt_len=48",
            "train.batch_size=2", "train.num_anchors=4", "model.block_size=8", "telemetry.console_interval_s=0"]
    dead = _dead_uri()
    variants = {
        "no tracker": ([], None),
        "mlflow, server down": (["mlflow"], dead),
        "tensorboard + mlflow (local store)": (["tensorboard", "mlflow"], None),
    }
    res = {k: [] for k in variants}
    losses, status, cpu = {}, {}, {k: [] for k in variants}
    with tempfile.TemporaryDirectory() as tmp:
        once(base, f"{tmp}/warm", [], None)  # warm-up: caches, allocator
        for r in range(a.rounds):
            for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
                tps, loss, st = once(base, f"{tmp}/{r}-{len(res[name])}", *variants[name], settle_s=a.settle)
                res[name].append(tps)
                losses.setdefault(name, []).append(loss)
                status[name] = st
                cpu[name].append(st["bridge_cpu_s"] / st["loop_s"])
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"{'variant':36s} {'median tok/s':>12s}  runs")
    for k, v in res.items():
        print(f"{k:36s} {med[k]:12.1f}  {' '.join(f'{x:.0f}' for x in v)}")
    # paired within a round (the variants ran back to back), then the median over rounds
    paired = {k: statistics.median(x / n for x, n in zip(res[k], res["no tracker"])) for k in variants}
    ratios = {"mlflow_down_over_none": paired["mlflow, server down"],
              "tb_mlflow_local_over_none": paired["tensorboard + mlflow (local store)"]}
    share = {k: round(max(v), 5) for k, v in cpu.items()}  # the bridge threads' CPU / loop wall, worst round
    print("bridge threads' CPU time / loop wall time (worst round):", share)
    ref = losses["no tracker"][0]  # every run of every variant: the same loss at every step?
    same_loss = {k: all(x == ref for x in losses[k]) for k in variants}
    for k, v in ratios.items():
        print(f"{k:36s} {v:.3f}")
    print("loss history identical to no tracker:", same_loss)
    print("mlflow down:", status["mlflow, server down"].get("mlflow"))
    print(json.dumps({"bench": "dead_tracker", "target": a.target, "steps": a.steps, "rounds": a.rounds,
                      "interval_s": a.interval, "median_tokens_per_s": {k: round(v, 1) for k, v in med.items()},
                      "ratios": {k: round(v, 3) for k, v in ratios.items()}, "same_loss_history": same_loss,
                      "bridge_cpu_share": share,
                      "mlflow_down_status": status["mlflow, server down"].get("mlflow")}))


if __name__ == "__main__":
    main()

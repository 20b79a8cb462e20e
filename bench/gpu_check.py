"""Checks that need an NVIDIA GPU (exits 0 with a message where CUDA is absent):

  device_clock  stages given a CUDA stream get a device duration from CUDA events that
                the background thread resolves with query() only, under
                torch.cuda.set_sync_debug_mode("error") (any synchronising call raises);
  nvml_gauges   real NVML values (hw.gpu.*) read back from the file sink;
  pipeline      the dflash pipeline (tiny target on cuda:0) under sync-debug "warn" with
                every sync's call site kept (none may be ours), telemetry on vs off
                alternating: overhead ratio, device-clock stage times.

One function per check, main() collects them. Last line: one JSON object.

    .venv/bin/python bench/gpu_check.py [--seconds 3]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cuda_or_reason():
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "CUDA is not available"
    return torch, None


def run_traced_gpu_work(torch, out_dir: str, seconds: float) -> dict:
    """Matmuls on a side stream inside tel.stage(stream=...) with sync debug mode 'error'."""
    import otel
    tel = otel.Telemetry.from_env(service_name="gpucheck", file_dir=out_dir, gpu_indices=[0],
                                  console=False, metric_export_interval_s=0.5)
    tel.prepare_cuda()
    stream = torch.cuda.Stream()
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    steps = 0
    in_flight = collections.deque()
    torch.cuda.set_sync_debug_mode("error")
    try:
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            with torch.cuda.stream(stream):
                with tel.stage("matmul", trace=("batch", steps), stream=stream, worker="gpu0", device="cuda:0"):
                    for _ in range(4):
                        y = x @ x
                marker = torch.cuda.Event()
                marker.record(stream)
            in_flight.append(marker)
            steps += 1
            # bound the work queued ahead of the GPU, as a pipeline does, by polling an
            # event with query() (not a sync), so the event pool never runs dry
            while len(in_flight) > 8:
                if in_flight[0].query():
                    in_flight.popleft()
                else:
                    time.sleep(0.0005)
        assert tel.flush(timeout_s=10.0)  # flushing does not sync either
    finally:
        torch.cuda.set_sync_debug_mode(0)
    del y
    torch.cuda.synchronize()
    deadline = time.monotonic() + 10
    while tel.summary()["health"]["spans_exported"] < steps and time.monotonic() < deadline:
        tel.flush(timeout_s=5.0)  # events resolve over a few cycles once the GPU catches up
        time.sleep(0.2)
    summary = tel.summary()
    tel.shutdown(timeout_s=5.0)
    return {"steps": steps, "summary": summary}


def check_device_clock(out_dir: str, run: dict) -> dict:
    from otel import filesink
    spans = [s for s in filesink.read_spans(out_dir) if s["name"] == "matmul"]
    dev = [s["attributes"]["device.duration_s"] for s in spans if "device.duration_s" in s["attributes"]]
    host = [(s["end_ns"] - s["start_ns"]) / 1e9 for s in spans]
    points = [p for p in filesink.read_metrics(out_dir)
              if p["name"] == "gpucheck.stage.duration" and p["attributes"].get("clock") == "device"]
    dev_sorted = sorted(dev)
    return {
        "ok": bool(spans) and len(dev) >= 0.9 * len(spans) and bool(points) and all(d > 0 for d in dev),
        "spans": len(spans), "spans_with_device_time": len(dev),
        "device_p50_ms": round(dev_sorted[len(dev) // 2] * 1e3, 3) if dev else None,
        "host_p50_ms": round(sorted(host)[len(host) // 2] * 1e3, 3) if host else None,
        "device_histogram_count": points[-1]["count"] if points else 0,
    }


def check_nvml_gauges(out_dir: str) -> dict:
    from otel import filesink
    last = {}
    for p in filesink.read_metrics(out_dir):
        if p["name"].startswith("hw."):
            last[p["name"]] = p
    avail = last.get("hw.gpu.telemetry.available", {}).get("value")
    vals = {k: v.get("value") for k, v in last.items() if "value" in v}
    ok = (avail == 1 and 0 <= vals.get("hw.gpu.utilization", -1) <= 1
          and vals.get("hw.gpu.memory.usage", 0) > 0
          and vals.get("hw.gpu.memory.limit", 0) >= vals.get("hw.gpu.memory.usage", 0)
          and vals.get("hw.gpu.utilization.max", 0) > 0)
    gpu_attrs = last.get("hw.gpu.utilization", {}).get("attributes", {})
    return {"ok": bool(ok), "available": avail, "values": vals, "device": gpu_attrs}


class SyncLog:
    """set_sync_debug_mode("warn") turns every synchronising CUDA call into a warning, in
    whichever thread made it; this keeps each one's call site, so syncs made by our code
    (dflash/, otel/) can be told from those inside the libraries (e.g. a transformers
    masking helper that reads a device tensor): ours must be zero."""

    def __init__(self):
        import traceback
        import warnings

        self.ours, self.library = collections.Counter(), collections.Counter()
        self._warnings, self._tb = warnings, traceback

    def __enter__(self):
        self._prev = self._warnings.showwarning
        self._warnings.simplefilter("always")

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return self._prev(message, category, filename, lineno, file, line)
            frames = [f for f in self._tb.extract_stack()[:-1] if "warnings" not in f.filename]
            mine = [f for f in frames if "/dflash/" in f.filename or "/otel/" in f.filename]
            site = frames[-1] if frames else None
            where = f"{'/'.join(site.filename.rsplit('/', 2)[-2:])}:{site.lineno}" if site else "?"
            (self.ours if mine and mine[-1] is frames[-1] else self.library)[where] += 1
        self._warnings.showwarning = show
        return self

    def __exit__(self, *exc):
        self._warnings.showwarning = self._prev


def check_pipeline(torch, out_root: str, steps: int = 30, rounds: int = 2) -> dict:
    """The dflash pipeline on the GPU with a tiny target, telemetry on vs off (alternating),
    under set_sync_debug_mode("warn") with every synchronising call's site recorded (see
    SyncLog): none may come from dflash/ or otel/. Reports the tokens/s ratio and
    device-clock stage times."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dflash.config import load_config
    from dflash.pipeline import run_pipelined
    from dflash.train import setup
    from otel import filesink

    base = ["model.target=tiny-qwen3", f"train.steps={steps}", "data.num_conversations=48",
            "data.max_len=96", "data.regen_max_new_tokens=40", "data.regen_max_prompt_len=48",
            "train.batch_size=4", "train.num_anchors=8", "pipeline.target_devices=cuda:0",
            "pipeline.drafter_devices=cuda:0", "telemetry.console_interval_s=0"]
    rates: dict = {"on": [], "off": []}
    last_on = None
    syncs = SyncLog()
    for r in range(rounds):
        for tel_on in ((True, False) if r % 2 == 0 else (False, True)):
            out = f"{out_root}/pipe-{r}-{int(tel_on)}"
            cfg = load_config(None, base + [f"out={out}", f"telemetry.enabled={tel_on}"])
            ctx = setup(cfg, resume=False)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                t0 = time.perf_counter()
                with syncs:
                    run_pipelined(ctx)
                torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize()   # end of the timed window, outside the loop
                wall = time.perf_counter() - t0
            finally:
                torch.cuda.set_sync_debug_mode(0)
                ctx.tel.shutdown(timeout_s=2.0)
            rates["on" if tel_on else "off"].append(ctx.tokens / wall)
            if tel_on:
                last_on = out
    spans = filesink.read_spans(f"{last_on}/telemetry/traces.jsonl")
    dev: dict = {}
    for s in spans:
        if "device.duration_s" in s["attributes"]:
            dev.setdefault(s["name"], []).append(s["attributes"]["device.duration_s"])
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    ratio = med(rates["on"]) / med(rates["off"])
    return {"ok": bool(dev.get("model_forward")) and bool(dev.get("backward")) and not syncs.ours,
            "syncs_in_dflash_or_otel": dict(syncs.ours),
            "syncs_in_libraries": dict(syncs.library.most_common(5)),
            "tokens_per_s_on": [round(x) for x in rates["on"]], "tokens_per_s_off": [round(x) for x in rates["off"]],
            "telemetry_overhead_ratio": round(ratio, 4),
            "device_p50_ms": {k: round(med(v) * 1e3, 3) for k, v in dev.items()}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    torch, reason = cuda_or_reason()
    if torch is None:
        print(f"gpu_check: skipped ({reason})")
        print(json.dumps({"skipped": reason}))
        return 0
    results = {"device": torch.cuda.get_device_name(0)}
    with tempfile.TemporaryDirectory(prefix="otel-gpucheck-") as out_dir:
        try:
            run = run_traced_gpu_work(torch, out_dir, args.seconds)
            results["health"] = run["summary"]["health"]
            results["device_clock"] = check_device_clock(out_dir, run)
        except Exception as e:  # a sync under "error" mode lands here
            results["device_clock"] = {"ok": False, "error": repr(e)}
        results["nvml_gauges"] = check_nvml_gauges(out_dir)
        try:
            results["pipeline"] = check_pipeline(torch, out_dir)
        except Exception as e:  # a sync under "error" mode lands here too
            results["pipeline"] = {"ok": False, "error": repr(e)}
    results["ok"] = all(r.get("ok") for k, r in results.items() if isinstance(r, dict) and "ok" in r)
    for k, v in results.items():
        print(f"{k}: {v}")
    print(json.dumps(results, default=str))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

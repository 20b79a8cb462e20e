"""Checks that need an NVIDIA GPU (exits 0 with a message where CUDA is absent):

  device_clock  stages given a CUDA stream get a device duration from CUDA events that
                the background thread resolves with query() only, under
                torch.cuda.set_sync_debug_mode("error") (any synchronising call raises);
  nvml_gauges   real NVML values (hw.gpu.*) read back from the file sink;
  pipeline[T]   the default training path (model.dtype=auto: bf16 target, fp32-master
                drafter computing in bf16) for T in tiny-qwen3, tiny-qwen3.5 (with
                flash-linear-attention when installed) and a 1.5B-shaped random Qwen3 dir
                written on the spot: a kernel warm-up (reported), one warm-up round
                (excluded), then >= 5 alternating telemetry on/off rounds; tok/s on and off
                and their median ratio, the target forward's achieved TFLOP/s (and share of
                the H200's bf16 dense peak), device-clock stage times, every sync's call
                site under sync-debug "warn" (none may be ours), and for the 1.5B target
                what a checkpoint costs the drafter's thread.

One function per check, main() collects them. Last line: one JSON object. Sized to finish
within 6 minutes on one H200 (--budget-s stops starting rounds; the JSON says how many ran).

    .venv/bin/python bench/gpu_check.py [--rounds 5] [--targets tiny-qwen3,...] [--budget-s 330]
    .venv/bin/python bench/gpu_check.py --cpu-smoke     # no GPU: exercise the script on the CPU
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import tempfile
import threading
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
    import otel
    spans = [s for s in otel.read_spans(out_dir) if s["name"] == "matmul"]
    dev = [s["attributes"]["device.duration_s"] for s in spans if "device.duration_s" in s["attributes"]]
    host = [(s["end_ns"] - s["start_ns"]) / 1e9 for s in spans]
    points = [p for p in otel.read_metrics(out_dir)
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
    import otel
    last = {}
    for p in otel.read_metrics(out_dir):
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
        self.off_path = collections.Counter()  # the checkpoint writer's device->host copies, by design
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
            if threading.current_thread().name == "dflash-checkpoint-writer":
                self.off_path[where] += 1
            else:
                (self.ours if mine and mine[-1] is frames[-1] else self.library)[where] += 1
        self._warnings.showwarning = show
        return self

    def __exit__(self, *exc):
        self._warnings.showwarning = self._prev


# -- the default training path on the GPU, per target ---------------------------------------
H200_BF16_DENSE_TFLOPS = 989.0  # NVIDIA's H200 SXM dense bf16 tensor-core peak (no sparsity)

TARGETS = {
    # name: (target spec or "1.5b", extra --set overrides)
    "tiny-qwen3": ("tiny-qwen3", ["data.num_conversations=64", "data.max_len=128", "train.batch_size=8",
                                  "train.num_anchors=8", "data.regen_max_new_tokens=48",
                                  "data.regen_max_prompt_len=64"]),
    "tiny-qwen3.5": ("tiny-qwen3.5", ["data.num_conversations=64", "data.max_len=128", "train.batch_size=8",
                                      "train.num_anchors=8", "data.regen_max_new_tokens=48",
                                      "data.regen_max_prompt_len=64"]),
    # the issue's shape: random Qwen3 (hidden 2048, 28 layers, SmolLM2's 49152 vocab), 5-layer
    # drafter, batch 8, max_len 384; random weights, so no regeneration (throughput only)
    "qwen3-1.5b-random": ("1.5b", ["data.num_conversations=400", "data.max_len=384", "train.batch_size=8",
                                   "train.num_anchors=8", "model.num_layers=5", "data.regenerate=off"]),
}


def make_random_qwen3_dir(root: str, layers: int = 28) -> str:
    """A 1.5B-shaped random Qwen3 written as a local HF dir (no download), SmolLM2 tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dflash.model import target as T

    path = os.path.join(root, f"qwen3-1.5b-random-{layers}l")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    tok = T.load_tokenizer("tiny-qwen3")
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=2048, intermediate_size=6144, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # init on the GPU: seconds, not minutes
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    return path


def forward_flops(model, seqs: int, padded_len: int) -> float:
    """Approximate FLOPs of one capture forward (backbone, no lm_head) on a padded batch:
    2 x non-embedding parameters x tokens, plus causal attention (QK^T and AV) of the
    full-attention layers."""
    cfg = model.config.get_text_config()
    emb = model.get_input_embeddings().weight.numel()
    params = sum(p.numel() for p in model.base_model.parameters()) - emb
    kinds = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    attn_layers = sum(1 for k in kinds if k == "full_attention")
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    tokens = seqs * padded_len
    attn = 2 * attn_layers * seqs * padded_len * padded_len * cfg.num_attention_heads * hd  # causal half of 4*...
    return 2.0 * params * tokens + attn


class _Memo:
    """Load each target and prepare its data once for all rounds: the rounds compare
    telemetry on/off, not model loading. Patches dflash.run.setup's references while active."""

    def __init__(self):
        self.targets, self.prepared = {}, {}

    def __enter__(self):
        import dflash.run.setup as tr
        from dflash.model import target as T

        self._tr, self._T = tr, T
        self._load, self._prep = T.load_target, tr.prepare

        def load(spec, **kw):
            key = (spec, str(kw.get("device")), str(kw.get("dtype")))
            if key not in self.targets:
                self.targets[key] = self._load(spec, **kw)
            return self.targets[key]

        def prep(cfg, target, tok, device="cpu", layer_ids=None, **kw):
            # the kept features depend on the layers and on train.feature_cache as well
            # (one process here: the regeneration shard, **kw, is always the whole)
            key = (cfg.model.target, json.dumps(cfg.to_dict()["data"], sort_keys=True),
                   tuple(layer_ids or ()), cfg.train.feature_cache)
            if key not in self.prepared:
                self.prepared[key] = self._prep(cfg, target, tok, device=device, layer_ids=layer_ids, **kw)
            return self.prepared[key]

        T.load_target, tr.prepare = load, prep
        return self

    def __exit__(self, *exc):
        self._T.load_target, self._tr.prepare = self._load, self._prep


def check_pipeline(torch, out_root: str, name: str, spec: str, extra: list, *, rounds: int, steps: int,
                   device: str, deadline: float, checkpoint: bool = False) -> dict:
    """The default training path (model.dtype=auto) for one target: one warm-up round, then
    `rounds` alternating telemetry on/off pairs (the order flips every round), under
    set_sync_debug_mode("warn") with every synchronising call's site kept (see SyncLog):
    none may come from dflash/ or otel/. Reports tok/s on and off, the median ratio, the
    target forward's achieved TFLOP/s, device-clock stage times and, with `checkpoint`,
    what a checkpoint costs the drafter's thread."""
    from dflash.config import load_config
    from dflash.run.saving import save, wait_for_checkpoint
    import otel
    from dflash.run.trainer import Trainer

    cuda = device.startswith("cuda")
    base = [f"model.target={spec}", f"train.steps={steps}", f"pipeline.target_devices={device}",
            f"pipeline.drafter_devices={device}", "telemetry.console_interval_s=0", *extra]
    rates: dict = {"on": [], "off": []}
    last_on, warmup_s, target, ckpt_res, done = None, None, None, {}, 0
    syncs = SyncLog()
    for r in range(rounds + 1):  # round 0: warm-up, not counted
        if r > 1 and time.monotonic() > deadline:
            break
        for tel_on in ((True, False) if r % 2 == 0 else (False, True)):
            out = f"{out_root}/{name}-{r}-{int(tel_on)}"
            cfg = load_config(None, base + [f"out={out}", f"telemetry.enabled={tel_on}"])
            trainer = Trainer(cfg)
            spec, state = trainer.spec, trainer.state
            target = state.target
            if warmup_s is None:
                warmup_s = spec.warmup_s
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
            try:
                t0 = time.perf_counter()
                with syncs if (cuda and r > 0) else contextlib.nullcontext():
                    trainer.run_steps()
                if cuda:
                    torch.cuda.set_sync_debug_mode(0)
                    torch.cuda.synchronize()  # end of the timed window, outside the loop
                wall = time.perf_counter() - t0
                if checkpoint and tel_on and r == rounds:  # the drafter's cost of a save
                    t1 = time.perf_counter()
                    save(spec, state)
                    t2 = time.perf_counter()
                    wait_for_checkpoint(state)
                    ckpt_res = {"drafter_thread_s": round(t2 - t1, 4),
                                "write_s_off_path": round(time.perf_counter() - t2, 3)}
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode(0)
                state.tel.shutdown(timeout_s=2.0)
            if r > 0:
                rates["on" if tel_on else "off"].append(state.tokens / wall)
                if tel_on:
                    last_on = out
        done = r
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
    dev: dict = {}
    fwd_tflops = []
    clock = "device" if cuda else "host"  # the CPU has no device clock: the smoke run uses the host's
    if last_on:
        for s in otel.read_spans(f"{last_on}/telemetry/traces.jsonl"):
            a = s["attributes"]
            secs = a.get("device.duration_s") if cuda else (s["end_ns"] - s["start_ns"]) / 1e9
            if secs is None or " " in s["name"]:  # "batch N" root spans are not stages
                continue
            dev.setdefault(s["name"], []).append(secs)
            if s["name"] == "model_forward" and secs > 0 and "padded_len" in a:
                f = forward_flops(target, int(a.get("sequences", 1)), int(a["padded_len"]))
                fwd_tflops.append(f / secs / 1e12)
    on, off = med(rates["on"]), med(rates["off"])
    tflops = med(fwd_tflops)
    res = {"target": name, "dtype": str(target.dtype).removeprefix("torch.") if target is not None else None,
           "rounds": done, "warmup_s": None if warmup_s is None else round(warmup_s, 2),
           "flash_linear_attention": _fla(),
           "tokens_per_s_on": [round(x) for x in rates["on"]], "tokens_per_s_off": [round(x) for x in rates["off"]],
           "telemetry_on_off_ratio": round(on / off, 4) if on and off else None,
           "model_forward_tflops": round(tflops, 3) if tflops else None,
           "model_forward_peak_fraction": round(tflops / H200_BF16_DENSE_TFLOPS, 3) if tflops else None,
           "stage_clock": clock, "stage_p50_ms": {k: round(med(v) * 1e3, 3) for k, v in dev.items()},
           "syncs_in_dflash_or_otel": dict(syncs.ours), "syncs_off_critical_path": dict(syncs.off_path),
           "syncs_in_libraries": dict(syncs.library.most_common(8))}
    if ckpt_res:
        res["checkpoint"] = ckpt_res
    res["ok"] = bool(rates["on"]) and not syncs.ours and (not cuda or bool(dev.get("model_forward")))
    return res


def _fla() -> bool:
    import importlib.util
    return importlib.util.find_spec("fla") is not None


CPU_SMOKE = ["data.num_conversations=48", "data.max_len=96", "data.regen_max_new_tokens=40",
             "data.regen_max_prompt_len=48", "train.batch_size=2", "train.num_anchors=4", "model.block_size=8"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0, help="device-clock check duration")
    ap.add_argument("--rounds", type=int, default=5, help="alternating telemetry on/off rounds after the warm-up")
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma list of {', '.join(TARGETS)}")
    ap.add_argument("--steps", type=int, default=0, help="training steps per run (0: per-target default)")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="stop starting new rounds after this many seconds (the whole check must fit 6 minutes)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="no GPU: run the pipeline part on the CPU, tiny-qwen3, 1 round (checks the script itself)")
    args = ap.parse_args()
    names = [n for n in args.targets.split(",") if n]
    bad = [n for n in names if n not in TARGETS]
    if bad or args.rounds < 1:
        print(f"gpu_check: error: --targets {','.join(bad)}: expected some of {', '.join(TARGETS)}"
              if bad else f"gpu_check: error: --rounds={args.rounds}: expected >= 1", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    if args.cpu_smoke:
        import torch
        with tempfile.TemporaryDirectory(prefix="gpucheck-cpu-") as out_dir, _Memo():
            res = check_pipeline(torch, out_dir, "tiny-qwen3", "tiny-qwen3", CPU_SMOKE, rounds=1,
                                 steps=args.steps or 3, device="cpu", deadline=t_start + args.budget_s,
                                 checkpoint=True)
            # the 1.5B-shaped dir, one layer deep: the writer and the FLOP count, not the size
            from dflash.model import target as T
            model, _ = T.load_target(make_random_qwen3_dir(out_dir, layers=1))
            res["one_layer_1.5b_shape_forward_gflops_8x384"] = round(forward_flops(model, 8, 384) / 1e9, 1)
        print(f"pipeline[tiny-qwen3, cpu smoke]: {res}")
        print(json.dumps({"cpu_smoke": res, "ok": res["ok"]}, default=str))
        return 0 if res["ok"] else 1
    torch, reason = cuda_or_reason()
    if torch is None:
        print(f"gpu_check: skipped ({reason})")
        print(json.dumps({"skipped": reason}))
        return 0
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    with tempfile.TemporaryDirectory(prefix="otel-gpucheck-") as out_dir:
        try:
            run = run_traced_gpu_work(torch, out_dir, args.seconds)
            results["health"] = run["summary"]["health"]
            results["device_clock"] = check_device_clock(out_dir, run)
        except Exception as e:  # a sync under "error" mode lands here
            results["device_clock"] = {"ok": False, "error": repr(e)}
        results["nvml_gauges"] = check_nvml_gauges(out_dir)
        deadline = t_start + args.budget_s
        with _Memo():
            for i, name in enumerate(names):
                spec, extra = TARGETS[name]
                t0 = time.monotonic()
                try:
                    if spec == "1.5b":
                        spec = make_random_qwen3_dir(out_dir)
                    left = len(names) - i  # share what is left of the budget between the targets to come
                    steps = args.steps or (60 if name.startswith("qwen3-1.5b") else 40)
                    results[f"pipeline[{name}]"] = check_pipeline(
                        torch, out_dir, name, spec, extra, rounds=args.rounds, steps=steps, device="cuda:0",
                        deadline=t0 + (deadline - t0) / left, checkpoint=name.startswith("qwen3-1.5b"))
                except Exception as e:
                    import traceback
                    results[f"pipeline[{name}]"] = {"ok": False, "error": repr(e),
                                                    "traceback": traceback.format_exc()[-2000:]}
                results[f"pipeline[{name}]"]["check_s"] = round(time.monotonic() - t0, 1)
    results["total_s"] = round(time.monotonic() - t_start, 1)
    results["ok"] = all(r.get("ok") for k, r in results.items() if isinstance(r, dict) and "ok" in r)
    for k, v in results.items():
        print(f"{k}: {v}")
    print(json.dumps(results, default=str))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""W&B bridge (`dflash train --wandb`, `dflash eval --wandb`).

One daemon thread of its own (never a worker) does `wandb.init`, pushes what the
telemetry layer sees every `DFLASH_WANDB_INTERVAL_S` seconds (default 10), and at the end
writes the run summary. The training never waits on it:

- `wandb.init` and `wandb.log` run only in the bridge thread; a slow network or a hung
  `wandb.log` stalls that thread, nothing else;
- `close()` joins it with a bound; if it is stuck, the summary is written from a helper
  thread (again bounded) via `run.summary`, and if that does not finish in time either,
  to the JSONL fallback;
- if `wandb` is missing or fails (init, log, summary), one warning on stderr and the
  same records go to `RUN/wandb_fallback.jsonl`, one JSON object per line:
  `{"type": "config"|"log"|"summary", ...}`.

Honours WANDB_MODE, WANDB_PROJECT (default "dflash"), WANDB_DIR (default: the run
directory). The API key (WANDB_API_KEY) is never put in the config, the fallback file or
a warning: config values and messages that contain it are redacted.

Summary keys (also the `summary` record of the fallback file):
  tokens_per_s, tokens, steps, wall_s, loss_first, loss_last, nonfinite_steps,
  stage/<stage>/{p50_s,p95_s,p99_s,max_s,share,count},
  idle_fraction/<worker>, busy_fraction/<worker>, idle_s/<worker>/<cause>, idle_source
  (telemetry: the layer's live attribution; spans: this rank's traces.jsonl; stage_shares),
  telemetry/{spans_recorded,spans_exported,spans_dropped,export_failures},
  tau (and tau_before) with `train --eval` or after `dflash eval --wandb`.
"""
from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from pathlib import Path

FALLBACK = "wandb_fallback.jsonl"
RUN_FILE = "wandb_run.json"        # id/project of the W&B run, for `dflash eval --wandb`
_SECRET_KEY = re.compile(r"(api_?key|token|secret|password|passwd|credential)", re.I)


# ------------------------------------------------------------------ redaction

def _secrets() -> list[str]:
    return [v for k, v in os.environ.items()
            if v and len(v) >= 8 and (k == "WANDB_API_KEY" or (k.startswith("WANDB_") and _SECRET_KEY.search(k)))]


def redact(text: str) -> str:
    for s in _secrets():
        text = text.replace(s, "***")
    return text


def sanitize(obj):
    """A config tree without secrets: keys that name one are dropped, values that contain
    the API key are redacted."""
    if isinstance(obj, dict):
        return {k: sanitize(v) for k, v in obj.items() if not _SECRET_KEY.search(str(k))}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    if isinstance(obj, str):
        return redact(obj)
    return obj


# ------------------------------------------------------------------ what gets reported

def telemetry_metrics(tel_summary: dict) -> dict:
    """tel.summary() -> flat W&B keys (per-stage percentiles and share, health counters)."""
    out = {}
    for name, st in (tel_summary.get("stages") or {}).items():
        for k in ("p50_s", "p95_s", "p99_s", "max_s", "share", "count"):
            if k in st:
                out[f"stage/{name}/{k}"] = st[k]
    for k, v in (tel_summary.get("health") or {}).items():
        if isinstance(v, dict):  # drops by reason
            for kk, vv in v.items():
                out[f"telemetry/{k}/{kk}"] = vv
        else:
            out[f"telemetry/{k}"] = v
    for w in tel_summary.get("workers") or []:  # live idle attribution of the telemetry layer
        out[f"worker/{w['worker']}/busy_fraction"] = w["busy_fraction"]
    return out


def idle_from_telemetry(tel_summary: dict) -> dict | None:
    """Per-worker busy/idle as the telemetry layer attributed it live (summary["workers"])."""
    ws = tel_summary.get("workers")
    if not ws:
        return None
    return {w["worker"]: {"busy_fraction": w["busy_fraction"], "idle_s": w.get("idle_s") or {},
                          "wall_s": w.get("wall_s", 0.0)} for w in ws}


def idle_from_spans(run_dir: Path, rank: int = 0, world_size: int = 1, max_bytes: int = 256 << 20) -> dict | None:
    """Per-worker busy/idle from this rank's file-sink traces (otel.idle), or None (no
    file: traces went only to OTLP; or a file over max_bytes)."""
    tdir = Path(run_dir) / "telemetry" / (f"rank{rank}" if world_size > 1 else "")
    path = tdir / "traces.jsonl"
    if not path.is_file() or path.stat().st_size > max_bytes:  # keep the end of a long run quick
        return None
    from otel import read_spans
    from otel import attribute_idle

    from .analysis.idle_rules import DFLASH_RULES

    try:
        snap = attribute_idle(read_spans(str(path)), DFLASH_RULES)
    except Exception as e:  # never let the summary fail on a damaged file
        print(f"dflash: W&B bridge: idle attribution skipped ({type(e).__name__}: {e})", file=sys.stderr)
        return None
    if not snap:
        return None
    return {w: {"busy_fraction": v["busy_fraction"], "idle_s": v["idle_s"], "wall_s": v["wall_s"]}
            for w, v in snap.items()}


def idle_from_stages(tel_summary: dict) -> dict:
    """Without spans on disk: the drafter's idle share is its queue_get share (an
    approximation; target-side back-pressure needs the spans)."""
    st = (tel_summary.get("stages") or {}).get("queue_get")
    if not st:
        return {}
    f = min(1.0, float(st.get("share", 0.0)))
    return {"drafter0": {"busy_fraction": 1.0 - f, "idle_s": {"queue_empty": st.get("total_s", 0.0)},
                         "wall_s": tel_summary.get("wall_s", 0.0)}}


def run_summary(summary: dict, idle: dict | None, source: str) -> dict:
    """The end-of-run W&B summary from train()'s summary dict (with `telemetry`)."""
    tel = summary.get("telemetry") or {}
    out = {k: summary[k] for k in ("tokens_per_s", "tokens", "steps", "wall_s", "loss_first", "loss_last",
                                   "nonfinite_steps") if summary.get(k) is not None}
    out.update(telemetry_metrics(tel))
    for w, v in (idle or {}).items():
        out[f"busy_fraction/{w}"] = round(v["busy_fraction"], 6)
        out[f"idle_fraction/{w}"] = round(1.0 - v["busy_fraction"], 6)
        for cause, secs in v["idle_s"].items():
            if secs:
                out[f"idle_s/{w}/{cause}"] = round(secs, 6)
    out["idle_source"] = source
    bal = summary.get("balance")
    if isinstance(bal, dict):  # the same figure as the summary and `dflash stalls`
        out["balance/targets_per_drafter"] = bal["balanced_targets_per_drafter"]
        out["balance/idle_fraction"] = bal["idle_fraction"]
        out["balance/idle_side"] = bal["idle_side"] or "none"
        out["balance/best_split_speedup"] = bal["best_split"]["speedup"]
    for key, label in (("eval_after", "tau"), ("eval_before", "tau_before")):
        if isinstance(summary.get(key), dict) and "acceptance_length" in summary[key]:
            out[label] = summary[key]["acceptance_length"]
    if isinstance(summary.get("eval_after"), dict):  # prompt lookup's tau, per-position shares
        from .model.evaluate import tracker_keys
        out.update(tracker_keys(summary["eval_after"], prefix=""))
    return out


# ------------------------------------------------------------------ the bridge

class WandbBridge:
    """bridge = WandbBridge(ctx).start(); ...; bridge.close(summary)"""

    def __init__(self, ctx, interval_s: float | None = None, join_s: float = 2.0, write_s: float = 5.0):
        self.ctx = ctx
        self.out = Path(ctx.out)
        self.interval_s = float(interval_s if interval_s is not None
                                else os.environ.get("DFLASH_WANDB_INTERVAL_S", "10") or 10)
        self.join_s, self.write_s = join_s, write_s
        self.config = sanitize({**ctx.cfg.to_dict(), "run_id": getattr(ctx.tel, "run_id", None),
                                "world_size": ctx.world_size})
        self._wandb = None           # the module, once init succeeded
        self._run = None
        self._fallback = False
        self._lock = threading.Lock()  # fallback file writes, summary-once
        self._summary_done = False
        self._claimed = False
        self.init_s = None
        self._stop = threading.Event()
        self._final: dict | None = None
        self._last = (time.monotonic(), ctx.tokens)
        self._thread = threading.Thread(target=self._main, name="wandb-bridge", daemon=True)

    def start(self) -> "WandbBridge":
        self._thread.start()
        return self

    # -- thread ---------------------------------------------------------------------------
    def _main(self):
        self._init()
        while not self._stop.wait(self.interval_s):
            self._push(self._metrics())
        if self._final is not None:
            self._push(self._metrics())
            self._write_summary(self._final)

    def _init(self):
        try:
            import wandb
        except Exception as e:  # missing or broken install
            return self._fail(f"wandb is not available ({type(e).__name__}: {e})")
        try:
            kw = dict(project=os.environ.get("WANDB_PROJECT") or "dflash", config=self.config,
                      name=self.out.name, group=self.config.get("run_id"), job_type="train",
                      settings=_settings(wandb))
            if not os.environ.get("WANDB_DIR"):
                kw["dir"] = str(self.out)
            t0 = time.monotonic()
            run = wandb.init(**kw)
            self.init_s = time.monotonic() - t0
            self._wandb, self._run = wandb, run
            (self.out / RUN_FILE).write_text(json.dumps({"id": run.id, "project": run.project,
                                                         "dir": kw.get("dir") or os.environ.get("WANDB_DIR")}))
        except Exception as e:
            self._fail(f"wandb.init failed ({type(e).__name__}: {e})")

    def _metrics(self) -> dict:
        ctx = self.ctx
        m = telemetry_metrics(ctx.tel.summary())
        now, tokens = time.monotonic(), ctx.tokens
        t0, tok0 = self._last
        self._last = (now, tokens)
        m["train/step"] = ctx.trainer.step
        m["train/tokens"] = tokens
        if now > t0:
            m["train/tokens_per_s"] = round((tokens - tok0) / (now - t0), 3)
        if ctx.history:
            s, loss, acc, gnorm = ctx.history[-1]
            m.update({"train/loss": loss, "train/acc": acc, "train/grad_norm": gnorm})
        return m

    def _push(self, metrics: dict):
        if self._run is not None and not self._fallback:
            try:
                self._wandb.log(metrics)
                return
            except Exception as e:
                self._fail(f"wandb.log failed ({type(e).__name__}: {e})")
        if self._summary_done:
            return
        self._append({"type": "log", "time": time.time(), "data": metrics})

    def _write_summary(self, final: dict, via_wandb: bool = True) -> None:
        """Once: to W&B (run.summary + finish), else to the fallback file."""
        if via_wandb and self._run is not None and not self._fallback:
            with self._lock:
                if self._summary_done or self._claimed:
                    return
                self._claimed = True
            try:
                self._run.summary.update(final)
                self._run.finish()
                with self._lock:
                    self._summary_done = True
                return
            except Exception as e:
                self._fail(f"writing the W&B summary failed ({type(e).__name__}: {e})")
        with self._lock:
            if not self._summary_done:
                self._write_line({"type": "summary", "time": time.time(), "summary": final})
                self._summary_done = True

    # -- fallback -------------------------------------------------------------------------
    def _fail(self, why: str):
        with self._lock:
            if self._summary_done:  # a late error from a call that was stuck: nothing left to do
                return
            first = not self._fallback
            self._fallback = True
            if first:
                print(f"dflash: W&B bridge: {redact(why)}; writing {self.out / FALLBACK} instead",
                      file=sys.stderr, flush=True)
                self._write_line({"type": "config", "time": time.time(), "config": self.config})

    def _append(self, rec: dict):
        with self._lock:
            self._write_line(rec)

    def _write_line(self, rec: dict):  # caller holds the lock
        line = redact(json.dumps(rec, default=str)) + "\n"
        with open(self.out / FALLBACK, "a") as f:
            f.write(line)

    # -- end of run (called by train(), any thread) ----------------------------------------
    def close(self, summary: dict) -> dict:
        """Write the end-of-run summary; returns it. Bounded: join_s + 2 * write_s at most."""
        tel = summary.get("telemetry") or {}
        idle, source = idle_from_telemetry(tel), "telemetry"
        if not idle:  # an older/disabled layer: this rank's spans on disk, else the stage shares
            idle, source = idle_from_spans(self.out, self.ctx.rank, self.ctx.world_size), "spans"
        if not idle:
            idle, source = idle_from_stages(tel), "stage_shares"
        final = run_summary(summary, idle, source)
        self._final = final
        self._stop.set()
        self._thread.join(self.join_s)
        if self._thread.is_alive():  # stuck in wandb.init or wandb.log: write it from here
            if self._run is not None and not self._fallback:  # (a no-op if the bridge is already at it)
                threading.Thread(target=self._write_summary, args=(final,), name="wandb-summary", daemon=True).start()
                deadline = time.monotonic() + self.write_s
                while not self._summary_done and time.monotonic() < deadline:
                    time.sleep(0.05)
            with self._lock:
                stuck = not self._summary_done
            if stuck:
                self._fail("W&B did not accept the summary in time")
                self._write_summary(final, via_wandb=False)
        _teardown(self.write_s)
        return final


def _settings(wandb):
    """Nothing that costs the training process: no console capture, no code/git/pip scan
    (system stats are sampled by wandb-core, another process)."""
    kw = dict(console="off", save_code=False, disable_git=True, silent=True, x_save_requirements=False)
    try:
        return wandb.Settings(**kw)
    except Exception:  # an older wandb without one of these settings
        kw.pop("x_save_requirements")
        return wandb.Settings(**kw)


def _teardown(timeout_s: float) -> None:
    """wandb.teardown(): no wandb-core helper outlives the run (bounded)."""
    wandb = sys.modules.get("wandb")
    if wandb is None or not hasattr(wandb, "teardown"):
        return
    t = threading.Thread(target=lambda: _quiet(wandb.teardown), name="wandb-teardown", daemon=True)
    t.start()
    t.join(timeout_s)


def _quiet(fn):
    try:
        fn()
    except Exception:
        pass


def start(ctx):
    """The bridge for this run, or None (not asked for, or not the lead rank)."""
    if not ctx.cfg.telemetry.wandb or not ctx.is_lead:
        return None
    return WandbBridge(ctx).start()


# ------------------------------------------------------------------ dflash eval --wandb

def log_eval(run_dir, res: dict, timeout_s: float = 60.0, summary: dict | None = None) -> dict:
    """Add tau to the training run's W&B summary (resumed by id), else to the fallback.
    `summary`: more keys for that summary (a side-by-side eval's per-drafter figures)."""
    run_dir = Path(run_dir)
    final = {"tau": res["acceptance_length"], "eval/prompts": res.get("prompts"),
             "eval/block_size": res.get("block_size"), "eval/lossless": res.get("lossless"),
             "eval/temperature": res.get("temperature") or None} | (summary or {})
    final = {k: v for k, v in final.items() if v is not None}
    done = threading.Event()
    err: list = []

    def push():
        try:
            import wandb
            info = json.loads((run_dir / RUN_FILE).read_text()) if (run_dir / RUN_FILE).is_file() else {}
            kw = dict(project=os.environ.get("WANDB_PROJECT") or info.get("project") or "dflash", job_type="eval",
                      settings=_settings(wandb))
            if info.get("id"):
                kw.update(id=info["id"], resume="allow")
            if not os.environ.get("WANDB_DIR"):
                kw["dir"] = info.get("dir") or str(run_dir)
            run = wandb.init(**kw)
            run.summary.update(final)
            run.finish()
            done.set()
        except Exception as e:
            err.append(f"{type(e).__name__}: {e}")

    t = threading.Thread(target=push, name="wandb-eval", daemon=True)
    t.start()
    t.join(timeout_s)
    if not done.is_set():
        why = err[0] if err else f"no answer within {timeout_s:.0f}s"
        print(f"dflash: W&B bridge: {redact(why)}; writing {run_dir / FALLBACK} instead", file=sys.stderr)
        with open(run_dir / FALLBACK, "a") as f:
            f.write(redact(json.dumps({"type": "summary", "time": time.time(), "summary": final})) + "\n")
    _teardown(10.0)
    return final

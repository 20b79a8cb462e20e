"""The tracker bridge: one training run -> W&B, TensorBoard, MLflow (any of them).

Each tracker (a *sink*: wandb_sink.py, tensorboard_sink.py, mlflow_sink.py) gets a daemon
thread of its own, never a worker's, so a slow or dead one stalls nothing but itself, not
even the other trackers. The thread opens the sink (wandb.init, a SummaryWriter, an MLflow
run), pushes what the telemetry layer sees every DFLASH_TRACKER_INTERVAL_S seconds
(DFLASH_WANDB_INTERVAL_S, its older name, also works; default 10) and at the end writes
the run summary. The training never waits on a tracker:

- every call into a tracker's library runs in that tracker's thread;
- `close()` joins the threads with one bound; a thread that is stuck gets the summary
  written from a helper thread (again bounded), and if that does not finish in time
  either, into the JSONL fallback: at most join_s + 2 * write_s in all;
- a tracker that is missing or fails (open, log, summary) prints one warning on stderr,
  and its records go to RUN/<tracker>_fallback.jsonl, one JSON object per line:
  `{"type": "config"|"log"|"summary", ...}` (the summary record counts the failed calls).
  Trackers that can come back (an MLflow server restarted) are tried again every interval;
  steps they missed are sent once they answer, so their history has no gap.

Secrets (API keys, tokens, passwords, credentials in URIs) are never put in the config,
a fallback file or a message: see redaction.py.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from otel.confined import open_for_write

from .redaction import redact, sanitize
from .report import final_summary, telemetry_metrics
from .sink import failure


def interval_from_env() -> float:
    """DFLASH_TRACKER_INTERVAL_S (or its older name DFLASH_WANDB_INTERVAL_S), seconds; else 10."""
    from otel.env_values import number_from_env

    name = next((n for n in ("DFLASH_TRACKER_INTERVAL_S", "DFLASH_WANDB_INTERVAL_S") if os.environ.get(n)),
                "DFLASH_TRACKER_INTERVAL_S")
    return number_from_env(name, 10.0, hi=86400.0, unit="seconds", who="dflash")


def make_sink(name: str):
    if name == "wandb":
        from .wandb_sink import WandbSink
        return WandbSink()
    if name == "tensorboard":
        from .tensorboard_sink import TensorBoardSink
        return TensorBoardSink()
    if name == "mlflow":
        from .mlflow_sink import MlflowSink
        return MlflowSink()
    raise ValueError(f"unknown tracker {name!r}")


class Bridge:
    """bridge = Bridge(spec, state, ["tensorboard", "mlflow"]).start(); ...; bridge.close(summary)

    `spec`, `state`: the run's (run/context.py RunSpec, RunState), read live by the threads.

    `sinks` defaults to W&B alone: this is the W&B bridge it grew from."""

    def __init__(self, spec, state, sinks=("wandb",), interval_s: float | None = None, join_s: float = 2.0,
                 write_s: float = 5.0):
        self.spec, self.state = spec, state
        self.out = Path(spec.out)
        self.interval_s = float(interval_s if interval_s is not None else interval_from_env())
        self.join_s, self.write_s = join_s, write_s
        self.config = sanitize({**spec.cfg.to_dict(), "run_id": getattr(state.tel, "run_id", None),
                                "world_size": spec.world_size})
        self.started = time.time()
        self._stop = threading.Event()
        self._final: dict | None = None
        self._raw: dict = {}
        self.runners = [_Runner(self, make_sink(n) if isinstance(n, str) else n) for n in sinks]

    def start(self) -> "Bridge":
        for r in self.runners:
            r.thread.start()
        return self

    def status(self) -> dict:
        """Per tracker: delivered or not, failed calls, where its fallback records went."""
        return {r.sink.name: r.status() for r in self.runners}

    # -- end of run (called by train(), any thread) ----------------------------------------
    def close(self, summary: dict) -> dict:
        """Write the end-of-run summary to every tracker; returns it. Bounded: join_s + 2 *
        write_s at most, whatever the number of trackers (plus the patience of a local store
        that is still starting, at most 60 s: TensorBoard, MLflow without a server)."""
        final = final_summary(summary, self.out, self.spec.rank, self.spec.world_size)
        self._raw = summary
        self._final = final
        self._stop.set()
        deadline = time.monotonic() + self.join_s
        for r in self.runners:
            r.thread.join(max(0.0, deadline - time.monotonic()))
        # a local store still starting (imports, a new SQLite store: seconds on a busy host) is
        # slow, not lost: it gets its patience_s more to take the whole run
        starting = [r for r in self.runners if r.thread.is_alive() and not r.opened and not r.failures]
        deadline = time.monotonic() + max((r.sink.patience_s() for r in starting), default=0.0)
        for r in starting:
            r.thread.join(max(0.0, min(deadline, time.monotonic() + r.sink.patience_s()) - time.monotonic()))
        stuck = [r for r in self.runners if r.thread.is_alive()]
        # stuck in open or log: write the summary from here (a no-op if the thread is already at it)
        for r in stuck:
            if r.opened and not r.in_fallback:
                threading.Thread(target=r.write_summary, args=(final,), name=f"{r.sink.name}-summary",
                                 daemon=True).start()
        deadline = time.monotonic() + self.write_s
        while any(not r.summary_done for r in stuck) and time.monotonic() < deadline:
            time.sleep(0.05)
        for r in stuck:
            with r.lock:
                late = not r.summary_done
            if late:
                r.fail(f"{r.sink.label} did not accept the summary in time")
                r.write_summary(final, via_sink=False)
        # helpers some trackers leave behind (wandb-core): bounded, side by side
        ends = [threading.Thread(target=r.sink.teardown, args=(self.write_s,), daemon=True) for r in self.runners]
        for t in ends:
            t.start()
        deadline = time.monotonic() + self.write_s
        for t in ends:
            t.join(max(0.0, deadline - time.monotonic()))
        return final


class _Runner:
    """One tracker's thread, its fallback file and its failure count."""

    def __init__(self, bridge: Bridge, sink):
        self.b, self.sink = bridge, sink
        self.spec, self.state = bridge.spec, bridge.state
        self.fallback_path = bridge.out / sink.fallback
        self.fallback_failed = False
        self.lock = threading.Lock()  # fallback file writes, summary-once
        self.opened = False
        self.in_fallback = False
        self.summary_done = False
        self._claimed = False
        self.failures = 0             # failed calls into the tracker
        self.fallback_records = 0
        self.open_s = None
        self._last = (time.monotonic(), self.state.tokens)
        # history rows (step, loss, ...) and acceptance estimates the tracker got, and those the
        # fallback file got (a resumed run's earlier steps were sent by the earlier run)
        est = self._estimate_history()
        self._rows = self._fb_rows = len(self.state.history)
        self._estimates = self._fb_estimates = len(est) if est else 0
        self._last_try = 0.0
        self.thread = threading.Thread(target=self._main, name=f"{sink.name}-bridge", daemon=True)

    def status(self) -> dict:
        out = {"delivered": self.opened and not self.in_fallback and self.summary_done, "failures": self.failures}
        if self.fallback_records:
            out |= {"fallback": str(self.fallback_path), "fallback_records": self.fallback_records}
        out |= self.sink.describe()
        return out

    # -- thread ---------------------------------------------------------------------------
    def _main(self):
        self._open()
        while not self.b._stop.wait(self.b.interval_s):
            self._push()
        if self.b._final is not None:
            self._push(force_retry=True)
            self.write_summary(self.b._final)

    def _open(self) -> bool:
        self._last_try = time.monotonic()
        try:
            t0 = time.monotonic()
            self.sink.open(self)
            self.open_s = time.monotonic() - t0
            self.opened = True
            return True
        except Exception as e:
            self.fail(self.sink.why_open_failed(e))
            return False

    def _retry(self, force: bool = False) -> bool:
        """A tracker that can come back, tried again at most once an interval (and once more
        at the end)."""
        if not self.sink.retry or self.summary_done:
            return False
        if not force and time.monotonic() - self._last_try < self.b.interval_s * 0.9:
            return False
        if not self.opened:
            return self._open()
        return True

    def _estimate_history(self) -> list:
        """(step, tau, [share of verify steps accepting position k], tau without copies, details)
        of the held-out estimate, if any."""
        return getattr(getattr(self.state, "estimate", None), "history", None) or []

    def _metrics(self) -> dict:
        state = self.state
        m = telemetry_metrics(state.tel.summary())
        now, tokens = time.monotonic(), state.tokens
        t0, tok0 = self._last
        self._last = (now, tokens)
        m["train/step"] = state.train_step.step
        m["train/tokens"] = tokens
        if now > t0:
            m["train/tokens_per_s"] = round((tokens - tok0) / (now - t0), 3)
        if state.history:
            s, loss, acc, gnorm = state.history[-1]
            m.update({"train/loss": loss, "train/acc": acc, "train/grad_norm": gnorm})
        return m

    def _push(self, force_retry: bool = False):
        metrics = self._metrics()
        hist = self.state.history
        est = self._estimate_history()
        n_rows, n_est = len(hist), len(est)
        if self.opened and not self.in_fallback or self._retry(force_retry):
            try:
                self._last_try = time.monotonic()
                self.sink.log(metrics, hist[self._rows:n_rows], est[self._estimates:n_est], self.state.train_step.step)
                self._rows, self._estimates = n_rows, n_est
                if self.in_fallback:
                    self._recovered()
                return
            except Exception as e:
                self.fail(f"{self.sink.verb_log} failed ({failure(e)})")
        rec = {"type": "log", "time": time.time(), "data": metrics}
        if self.sink.per_step:  # the steps the tracker did not get (sent to it too if it comes back)
            rows = hist[max(self._rows, self._fb_rows):n_rows]
            estimates = est[max(self._estimates, self._fb_estimates):n_est]
            rec |= {"rows": rows, "estimates": [[s, t] for s, t, *_ in estimates]}
        if self._append(rec):
            self._fb_rows, self._fb_estimates = n_rows, n_est

    def write_summary(self, final: dict, via_sink: bool = True) -> None:
        """Once: to the tracker, else to the fallback file."""
        if via_sink and self.opened and (not self.in_fallback or self._retry(force=True)):
            with self.lock:
                if self.summary_done or self._claimed:
                    return
                self._claimed = True
            try:
                if self.in_fallback:  # it came back for the end: the steps it missed first
                    self._push_missed()
                self.sink.finish(final, self.b._raw)
                with self.lock:
                    self.summary_done = True
                return
            except Exception as e:
                self.fail(f"writing the {self.sink.label} summary failed ({failure(e)})")
        with self.lock:
            if not self.summary_done:
                self._write_line({"type": "summary", "time": time.time(), "summary": final,
                                  "failures": self.failures})
                self.summary_done = True

    def _push_missed(self):
        rows = list(self.state.history[self._rows:])
        est = self._estimate_history()
        self.sink.log({}, rows, list(est[self._estimates:]), self.state.train_step.step)
        self._rows += len(rows)
        self._estimates = len(est)
        self._recovered()

    def _recovered(self):
        with self.lock:
            if self.summary_done:  # a call that was stuck came back after the end: nothing to say
                return
            self.in_fallback = False
        print(f"dflash: {self.sink.label} bridge: reachable again after {self.failures} failed call(s); "
              f"the steps it missed were sent", file=sys.stderr, flush=True)

    # -- fallback -------------------------------------------------------------------------
    def fail(self, why: str):
        with self.lock:
            if self.summary_done:  # a late error from a call that was stuck: nothing left to do
                return
            self.failures += 1
            first = not self.in_fallback
            self.in_fallback = True
            if first:
                if self.failures == 1:
                    print(f"dflash: {self.sink.label} bridge: {redact(why)}; writing {self.fallback_path} instead",
                          file=sys.stderr, flush=True)
                    self._write_line({"type": "config", "time": time.time(), "config": self.b.config})

    def _append(self, rec: dict) -> bool:
        with self.lock:
            if self.summary_done:  # the end was written: nothing goes after it
                return False
            self._write_line(rec)
            return True

    def _write_line(self, rec: dict):  # caller holds the lock
        line = redact(json.dumps(rec, default=str)) + "\n"
        try:  # never through a link: a planted one would append the run's figures anywhere
            with open_for_write(self.fallback_path, "a", inside=self.b.out) as f:
                f.write(line)
        except OSError as e:
            if not self.fallback_failed:
                print(f"dflash: {self.sink.label} bridge: cannot write {self.fallback_path}: {e}", file=sys.stderr)
            self.fallback_failed = True
            return
        self.fallback_records += 1

"""What a tracker plugs into the bridge with (bridge.py runs it on a thread of its own).

    open(runner)                        start the tracker's run (raise: it goes to the fallback)
    log(metrics, rows, estimates, step) live metrics; rows: the new (step, loss, acc, grad_norm)
                                        history, estimates: new (step, tau, ...) held-out estimates
    finish(summary, raw)                end-of-run summary (report.py keys); raw: train()'s own dict
    teardown(timeout_s)                 what the library leaves running (bounded, any thread)
    patience_s()                        a local store still starting at the end: wait this long more
    log_eval(run_dir, metrics, step)    `dflash eval --tracker`: figures into the training run's tracker
"""
from __future__ import annotations


def failure(e: BaseException) -> str:
    """`Type: message` on one line: a library's own multi-line text (pydantic's validation report,
    SQLAlchemy's) cut to its first line, so the console's warning stays one line."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    more = " ..." if len(lines) > 1 else ""
    return f"{type(e).__name__}: {lines[0].strip() if lines else ''}{more}".rstrip(": ")


class Sink:
    name = "sink"              # as in --tracker
    label = "tracker"          # in messages: "dflash: <label> bridge: ..."
    verb_log = "log"           # in messages: "<verb_log> failed"
    per_step = False           # consumes history rows step by step (else only the latest in `metrics`)
    retry = False              # tried again each interval after a failure (a server that can come back)

    @property
    def fallback(self) -> str:
        return f"{self.name}_fallback.jsonl"

    def why_open_failed(self, e: BaseException) -> str:
        if isinstance(e, ImportError):
            return f"{self.name} is not available ({failure(e)})"
        return f"{self.name} could not start ({failure(e)})"

    def open(self, runner) -> None:
        raise NotImplementedError

    def log(self, metrics: dict, rows: list, estimates: list, step: int) -> None:
        raise NotImplementedError

    def finish(self, summary: dict, raw: dict) -> None:
        raise NotImplementedError

    def teardown(self, timeout_s: float) -> None:
        pass

    def patience_s(self) -> float:
        """How much longer the end of the run waits for this tracker when it is still
        starting: for local files only (slow on a busy host, never a network wait)."""
        return 0.0

    def describe(self) -> dict:
        """Where the run went (summary.json's `trackers`)."""
        return {}


def inside_run_dir(run_dir, path):
    """``path`` (under ``run_dir``), after checking that no symbolic link leads there: for the
    stores the trackers' own libraries write (TensorBoard's events, MLflow's database and
    artifacts), which cannot be handed a descriptor. Raises otel.confined.LinkRefused."""
    from otel.confined import link_refused, links_on_the_way

    link = links_on_the_way(run_dir, path)
    if link is not None:
        raise link_refused(path, link)
    return path

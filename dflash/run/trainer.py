"""`dflash train`: one `Trainer` for every placement, read top-down: set up -> train -> finish.

    set up   setup.py: join the ranks (placement.py says what this process does), load the
             target, prepare the data, build or resume the drafter's training step
             (step.py), make the telemetry; the run's `RunSpec` and `RunState` (context.py);
    train    run_loop.py: build this process's workers (workers.py) and the channel that
             joins them (channels.py), run them to the last step, under graceful signals;
    finish   here: the last checkpoint, the evals, the learning curve, the export, the
             summary, the end of telemetry.

A layout only changes which workers a process builds and which channel joins them.
"""
from __future__ import annotations

import contextlib
import copy
import json
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from otel.confined import write_text

from .. import phases
from ..config import Config, dumps
from ..errors import stop_signals, watch_second_signal
from . import distributed as dist_mod
from . import readback
from .context import RunSpec, RunState
from .run_loop import run_loop
from .saving import save, wait_for_checkpoint
from .setup import setup
from .summary import balance_from_files, rank_report, rank_reports, summarize
from .telemetry_setup import linger_for_scrape

if TYPE_CHECKING:
    from ..trackers.bridge import Bridge


def train(cfg: Config, *, resume: bool = False, eval_before_after: bool = False, argv=None) -> dict:
    return Trainer(cfg, resume=resume, argv=argv).train(eval_before_after=eval_before_after)


class Trainer:
    """A run of `dflash train` in this process: `Trainer(cfg)` sets it up, `train()` runs
    it to the last step and finishes it (`run_steps()` alone: the steps, for benchmarks)."""

    def __init__(self, cfg: Config, *, resume: bool = False, argv=None):
        self.spec, self.state = setup(cfg, resume=resume, argv=argv)

    def train(self, *, eval_before_after: bool = False) -> dict:
        """Train and finish: summary.json's dict (under a layout, the lead's; the others say
        who they are)."""
        from .. import trackers

        spec, state = self.spec, self.state
        place, out = spec.placement, spec.out
        if place.lead:
            _write_config(out, spec.cfg, state.train_step.step if state.train_step is not None else 0)
        report = rank_report(spec, state) if place.layout is not None else None
        bridge = trackers.start(spec, state) if place.has_drafter else None  # --tracker/--wandb, the lead: own threads
        summary: dict = {}
        try:
            with _graceful_signals(spec, state):
                if place.has_drafter:
                    self._train_drafter(summary, eval_before_after)
                else:
                    state.tel.begin_profile()
                    with phases.phase("train", role=place.role):
                        self.run_steps()
                    report.update(state.target_counts)
            if bridge is not None and report is None:  # in the trace: a slow tracker is time the run spends
                self._close_trackers(summary, bridge)
                bridge = None
        finally:
            self._end_telemetry(summary, report, sys.exc_info()[1])
        return self._finish(summary, report, bridge)

    def run_steps(self) -> None:
        """This process's workers and their channel, to the last step (or a stop)."""
        run_loop(self.spec, self.state)

    def _train_drafter(self, summary: dict, eval_before_after: bool) -> None:
        spec, state = self.spec, self.state
        if eval_before_after and spec.cfg.eval.before:
            with phases.phase("eval_before"):
                summary["eval_before"] = run_eval(spec, state, "before training")
        t0 = time.perf_counter()
        tokens0, step0 = state.tokens, state.train_step.step
        state.tel.begin_profile()  # the profile's shares are of the steps alone, not the set-up or the evals
        with phases.phase("train", start_step=step0, steps=spec.cfg.train.steps) as ph:
            ph.progress(lambda: state.train_step.step, spec.cfg.train.steps)  # read by the gauge, not per step
            # the curve's first point: where training starts from (a resume's checkpoint saved it)
            if state.estimate is not None and not any(h[0] == step0 for h in state.estimate.history):
                state.estimate(state.train_step.step)
            self.run_steps()
            readback.finish(state)
            ph.set(end_step=state.train_step.step, tokens=state.tokens - tokens0, interrupted=state.stop.is_set())
            wall = time.perf_counter() - t0
            state.tel.end_profile()  # the profile is the steps': printed now, its shares of their wall alone
        with phases.phase("checkpoint", step=state.train_step.step):
            save(spec, state, final=True)  # from the live tensors: nothing changes them until it is written
            wait_for_checkpoint(state)  # the run's result is on disk before anything else happens
        summary.update(summarize(spec, state, wall, step0, tokens0))
        self._finish_drafter(summary, eval_before_after)

    def _finish_drafter(self, summary: dict, eval_before_after: bool) -> None:
        """What a drafter rank adds once trained: the estimate, the best checkpoint, the evals,
        the learning curve, the export."""
        spec, state = self.spec, self.state
        cfg, st = spec.cfg, state.train_step
        if spec.placement.layout is not None:
            summary["drafter_parameters"] = sum(p.numel() for p in st.drafter.parameters())
            summary["frozen_parameters"] = sum(p.numel() for p in {id(p): p for p in (
                st.embed.weight, st.lm_head.weight)}.values())
        if state.estimate is not None:
            summary["acceptance_estimate"] = state.estimate.summary()
            with phases.phase("best_checkpoint"):
                best = state.estimate.keeper.finish() if state.estimate.keeper is not None else None
            if best is not None:  # OUT/best/checkpoint + OUT/best/export: which step, and its estimate
                summary["best"] = best
        if spec.warmup_s is not None:
            summary["warmup_s"] = round(spec.warmup_s, 2)
        if state.writer is not None:  # off the drafter's path, but worth knowing
            summary["checkpoint_write_s"] = round(state.writer.last_write_s, 3)
        if eval_before_after and state.stop.is_set():
            # preempted: the grace period (30 s on Kubernetes) is for saving, not for an eval
            summary["eval_after"] = {"skipped": "interrupted", "command": eval_command(cfg)}
            if spec.rank == 0:
                print(f"eval after training skipped (interrupted); run it with: {eval_command(cfg)}", file=sys.stderr)
        elif eval_before_after:
            # the headline: the drafter OUT/export holds (what a user serves), beside prompt lookup
            with phases.phase("eval_after", served=True) as ph:
                summary["eval_after"] = run_eval(spec, state, "after training (served drafter)", served=True)
                ph.set(tau_per_step=summary["eval_after"].get("tau_per_step"))
                if state.stop.is_set():  # a signal during the eval: its figure is partial, the phase says so
                    ph.set(interrupted=True)
            if st.drafter.copying and not state.stop.is_set():  # the copy head's own figure
                with phases.phase("eval_after_copy_head"):
                    summary["eval_after_copy_head"] = run_eval(spec, state, "after training, with the copy head",
                                                               checked=summary["eval_after"])
            if state.stop.is_set():  # and the run too
                summary["interrupted"] = True
                if spec.rank == 0:
                    print(f"eval after training interrupted: tau above is partial; run it whole with: "
                          f"{eval_command(cfg)}", file=sys.stderr)
        if spec.is_lead and state.history:  # after the eval: the picture shows its served tau beside prompt lookup's
            from ..analysis.learning_curve import write_png
            where = f" ({spec.placement.layout})" if spec.placement.layout is not None else ""
            with phases.phase("learning_curve"):
                write_png(spec.out / "learning_curve.png", state.history,
                          state.estimate.history if state.estimate else [], cfg.model.block_size,
                          f"{cfg.model.target}: drafter training{where}", final=summary.get("eval_after"))
        if spec.is_lead:  # a servable copy: OUT/export/ (or why not)
            from ..checkpoint.export import export_after_run
            with phases.phase("export"):
                summary["export"] = export_after_run(spec, st.drafter, summary)
        if spec.is_lead and eval_before_after and not state.stop.is_set():  # eval.engine: what vLLM makes of it
            from ..engine.verdict import after_training
            with phases.phase("engine_verdict"):
                verdict = after_training(spec, summary)
            if verdict is not None:
                summary["engine"] = verdict
        if spec.memory:  # the memory check's estimate beside the peak this process reached (VmHWM)
            from ..preflight.memory import run_summary
            summary["memory"] = run_summary(spec.memory)
        if state.stop.is_set():  # a signal after the steps (the final save, the export): exit 130 too, as the trace says
            summary["interrupted"] = True

    def _end_telemetry(self, summary: dict, report: dict | None, error: BaseException | None = None) -> None:
        """However the run ended: its root span (marked with ``error``), the telemetry's last
        export and health, a layout rank's report on disk, the process group gone."""
        spec, state = self.spec, self.state
        place, out = spec.placement, spec.out
        linger_for_scrape(state.tel)
        if error is None and state.stop.is_set():
            # a handled signal: the run saved and ends 130 (cli.py), so its root is not an OK one;
            # marked here, because the root ends here, before cli.py sees the exit code
            at = f" at step {state.train_step.step}, its checkpoint saved" if state.train_step is not None else ""
            error = ("KeyboardInterrupt", f"interrupted by a signal; stopped{at}", "")
        state.tel.end_run(error)
        state.tel.shutdown(timeout_s=2.0)
        summary["telemetry"] = state.tel.summary()
        if report is not None:
            report.update({k: summary[k] for k in ("steps", "tokens", "drafter_parameters", "frozen_parameters",
                                                   "interrupted") if k in summary})
            report["telemetry"] = summary["telemetry"]["health"]
            write_text(out / "ranks" / f"rank{place.rank}.json", json.dumps(report, indent=2), inside=out)
        elif place.lead and summary.get("steps") is not None:  # every span on disk now (the trackers had an early one)
            summary["balance"] = balance_from_files(out)
        dist_mod.shutdown()

    def _close_trackers(self, summary: dict, bridge: Bridge) -> None:
        """The trackers' end-of-run summary, as a phase of the run's trace (a W&B that does not
        answer holds it up to its bound: seconds a user would otherwise see nowhere). They get
        the telemetry's figures as of now, before its last export, and the balance from the
        span files, flushed first (the file sink's lane writes behind the steps)."""
        state, out = self.state, self.spec.out
        state.tel.flush(timeout_s=2.0, network=False)  # handed to the sinks: a dead collector holds nothing up
        summary["telemetry"] = state.tel.summary()
        if self.spec.placement.lead and summary.get("steps") is not None:
            summary["balance"] = balance_from_files(out)  # as far as written: summary.json's is read again at the end
        with phases.phase("trackers", trackers=",".join(r.sink.name for r in bridge.runners)):
            _close_bridge(bridge, summary)

    def _finish(self, summary: dict, report: dict | None, bridge: Bridge | None) -> dict:
        """The ranks' reports (a layout's lead), the trackers' summary (a layout's: theirs wait
        for the ranks' reports, after the trace), summary.json."""
        place, out = self.spec.placement, self.spec.out
        if place.layout is not None and place.lead:
            summary |= {"layout": str(place.layout), "ranks": rank_reports(out, place.world),
                        "held_parameters": report["held_parameters"], "role": place.role}
            summary["balance"] = balance_from_files(out)  # every rank's spans are on disk by now
        if bridge is not None:
            _close_bridge(bridge, summary)
        if place.lead:
            write_text(out / "summary.json", json.dumps(summary, indent=2), inside=out)
        # under a layout only the lead reports (exit 130 when interrupted); it is the last to finish
        return summary if place.layout is None or place.lead else {"rank": place.rank, "role": place.role}


def _write_config(out: Path, cfg: Config, step: int) -> None:
    """OUT/config.yaml: this run's settings. A resume with other settings (a new learning
    rate, say) keeps the earlier file as config.before-step<N>.yaml and names what changed:
    the record of how the first steps were trained is never overwritten."""
    import yaml

    f, text = out / "config.yaml", dumps(cfg)
    if f.is_file():
        before = f.read_text()
        changed = _changed(yaml.safe_load(before) or {}, yaml.safe_load(text) or {})
        changed = [c for c in changed if not c.startswith("out:")]  # the same dir spelled another way
        if changed:
            keep = out / f"config.before-step{step}.yaml"
            n = 1
            while keep.exists():
                n += 1
                keep = out / f"config.before-step{step}.{n}.yaml"
            write_text(keep, before, inside=out)
            shown = "; ".join(changed[:6]) + (f"; and {len(changed) - 6} more" if len(changed) > 6 else "")
            print(f"resumed at step {step} with changed settings: {shown} (the earlier ones kept in {keep.name})",
                  file=sys.stderr)
    write_text(f, text, inside=out)


def _changed(a, b, prefix: str = "") -> list[str]:
    """`key: old -> new` for each leaf that differs between two config dicts."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [c for k in sorted(set(a) | set(b), key=str)
                for c in _changed(a.get(k), b.get(k), f"{prefix}{k}." if prefix or k else "")]
    return [] if a == b else [f"{prefix.rstrip('.')}: {a!r} -> {b!r}"]


def _close_bridge(bridge: Bridge, summary: dict) -> None:
    """Bounded; a tracker that fails falls back to OUT/<tracker>_fallback.jsonl."""
    try:
        bridge.close(summary)
        summary["trackers"] = bridge.status()
    except Exception as e:
        from ..trackers.redaction import redact
        print(f"dflash: tracker bridge: {redact(repr(e))}", file=sys.stderr)


@contextlib.contextmanager
def _graceful_signals(spec: RunSpec, state: RunState):
    """First Ctrl-C / SIGTERM / SIGHUP (preemption, torchrun's shutdown, a closed terminal):
    finish the current step, save, stop (every rank at the same step: they vote); a second one
    raises."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    who = f"rank {spec.rank}: " if spec.placement.world > 1 else ""

    def on_signal(signum, frame):
        if state.stop.is_set():
            raise KeyboardInterrupt
        now = phases.innermost()
        if now in (None, "train"):
            print(f"\n{who}interrupt: finishing the current step, then saving a checkpoint (a second signal "
                  f"stops now, keeping the last checkpoint)", file=sys.stderr)
        else:  # the steps are over: the final checkpoint, an eval, the export
            print(f"\n{who}interrupt during {now}: the steps are over; the run writes what is left (its "
                  f"checkpoint, learning curve, export; no more evals), then exits 130 (a second signal stops "
                  f"now, keeping the last checkpoint)", file=sys.stderr)
        state.stop.set()

    prev = {s: signal.getsignal(s) for s in stop_signals()}  # SIGHUP too: a closed terminal
    for s in prev:
        signal.signal(s, on_signal)
    watch_second_signal()
    try:
        yield
    finally:
        for s, h in prev.items():
            signal.signal(s, h)


def run_eval(spec: RunSpec, state: RunState, label: str, *, served: bool = False,
             checked: dict | None = None) -> dict:
    """tau of the drafter as it is (`served=False`: before training; a copy head, if on, included),
    or of the drafter a user serves (`served`: OUT/export's weights, no copy head) beside prompt
    lookup on the same prompts (eval.baseline). `checked`: an eval of the same prompts whose
    outputs were checked against the target's greedy decode: this one's are compared with
    those instead of decoding the reference again (a greedy decode saved per prompt)."""
    from ..decode.evaluate import describe_lossless, evaluate

    e, target = spec.cfg.eval, state.target
    drafter = state.train_step.drafter
    if served:
        from ..checkpoint.export import served_drafter
        drafter = served_drafter(drafter, target.device)
    elif next(drafter.parameters()).device != target.device:  # eval beside the target; training copy stays
        drafter = copy.deepcopy(drafter).to(target.device)
    if served and not e.decode and state.estimate is not None:  # the walk: the same figures, in seconds
        from ..decode.evaluate import stop_token_ids
        res = state.estimate.as_eval(drafter, eos=stop_token_ids(target, spec.tokenizer),
                                     max_new_tokens=e.max_new_tokens, prompts=e.prompts, baseline=e.baseline,
                                     dtype=str(target.dtype).removeprefix("torch."))
    else:
        res = evaluate(target, drafter, spec.tokenizer, spec.eval_convs, stop=state.stop,
                       prompts=e.prompts, max_new_tokens=e.max_new_tokens, max_prompt_len=e.max_prompt_len,
                       temperature=e.temperature, top_p=e.top_p, top_k=e.top_k, seed=spec.cfg.train.seed,
                       baseline=e.baseline if served else "none", confidence_threshold=e.confidence_threshold,
                       check_lossless=not (checked and checked.get("lossless") is not None))
    if checked and checked.get("lossless") is not None:  # equal outputs: lossless exactly when those were
        same = [a["output_ids"] == b["output_ids"] for a, b in zip(res["per_prompt_steps"], checked["per_prompt_steps"])]
        res["lossless"] = checked["lossless"] and all(same)
        res["lossless_divergent_prompts"] = res["lossless_mismatches"] = same.count(False)
    if served:
        res["served"] = True  # OUT/export's drafter: no copy head, its export dtype's weights
    if drafter.copy is not None:
        res["copy_head"] = drafter.copying
    base = res.get("baseline")
    # the headline in engines' convention (per verify step, what vLLM reports), the per-prompt
    # mean (z-lab's benchmark) beside it
    def both(r):
        return f"{r.get('tau_per_step', float('nan')):.3f} per verify step ({r['acceptance_length']:.3f} per-prompt mean)"
    print(f"tau {label}: {both(res)} (block {res['block_size']}, "
          f"{res['prompts']} prompts, {res['dtype']}, {describe_lossless(res)})"
          + (f"; prompt lookup on the same prompts: {both(base)}" if base else "")
          + (" [interrupted]" if res["interrupted"] else ""), file=sys.stderr)
    if state.stop.is_set():  # cut short by a signal: marked, with the command that redoes it
        res.update(interrupted=True, command=eval_command(spec.cfg))
    return res


def eval_command(cfg: Config) -> str:
    """The command that runs the eval an interrupted run skipped."""
    return f"dflash eval --checkpoint {shlex.quote(str(Path(cfg.out) / 'checkpoint'))}"

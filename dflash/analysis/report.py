"""The readable end-of-run summary printed by `dflash train` (from summary.json's dict)."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def print_summary(s: dict, out_dir: str, console: Console | None = None) -> None:
    con = console or Console(stderr=True, highlight=False)
    t = Table(title=f"dflash train — {s.get('target')} — {out_dir}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("steps", f"{s['steps']} ({s['steps_this_run']} this run{', interrupted' if s.get('interrupted') else ''})")
    t.add_row("tokens", f"{s['tokens']:,} in {s['wall_s']:.1f} s = {s['tokens_per_s']:,.0f} tok/s "
                        f"({'pipelined' if s.get('pipelined') else 'reference loop'}, world size {s.get('world_size', 1)})")
    t.add_row("loss", f"{_fmt(s.get('loss_first'))} -> {_fmt(s.get('loss_last'))}"
                      f"  (weighted block accuracy {_fmt(s.get('acc_last'))})")
    if s.get("nonfinite_steps"):
        t.add_row("skipped steps", f"{s['nonfinite_steps']} non-finite")
    for label, key in (("tau before", "eval_before"), ("tau after", "eval_after"),
                       ("tau, copy head", "eval_after_copy_head")):
        if key in s and "skipped" in s[key]:  # an interrupted run skips its after-training eval
            t.add_row(label, f"skipped ({s[key]['skipped']}); run: {s[key]['command']}")
        elif key in s:
            from ..decode.evaluate import describe_lossless
            e = s[key]
            hist = " ".join(f"{k}:{v}" for k, v in e["histogram"].items() if v)
            partial = f"PARTIAL (interrupted; run: {e['command']}); " if e.get("interrupted") else ""
            served = "served drafter (OUT/export: no copy head), " if e.get("served") else ""
            t.add_row(label, f"{_tau(e)}  ({partial}{served}block {e['block_size']}, {e['prompts']} "
                             f"prompts, {describe_lossless(e)}; accepted+1 histogram {hist})")
            b = e.get("baseline")
            if b:  # the free baseline on the same prompts: a drafter is worth serving above it
                key = "tau_per_step" if "tau_per_step" in e and "tau_per_step" in b else "acceptance_length"
                verdict = "above" if e[key] > b[key] else "NOT above"
                t.add_row("  prompt lookup", f"{_tau(b)}  (same prompts, no training; the "
                                             f"drafter is {verdict} it)")
            if e.get("per_position_acceptance"):
                pos = " ".join(f"{x:.2f}" for x in e["per_position_acceptance"])
                base = " ".join(f"{x:.2f}" for x in (b or {}).get("per_position_acceptance") or [])
                t.add_row("  accepted at 1..B-1", pos + (f"  (prompt lookup {base})" if base else ""))
    curve = s.get("acceptance_estimate") or {}
    est = curve.get("last")
    if est:
        first = (curve.get("history") or [[est["step"], est["tau"]]])[0]
        start = f"from {first[1]:.3f} at step {first[0]}, " if first[0] != est["step"] else ""
        own = f"; {est['tau_no_copy']:.3f} without the copy head" if "tau_no_copy" in est else ""
        pos = est.get("per_position_acceptance") or est.get("slot_accuracy") or []  # slot_accuracy: older runs
        label = "accepted at 1..B-1" if "per_position_acceptance" in est else "slot accuracy"
        what = (f"per verify step, walked over {curve.get('held_out_sequences')} {curve['rows']}"
                if curve.get("rows") else "held-out replies")
        t.add_row("tau estimate", f"{est['tau']:.3f} at step {est['step']} ({start}{what}, one forward, "
                                  f"no decoding; {label} {' '.join(f'{a:.2f}' for a in pos[:6])}"
                                  f"{' ...' if len(pos) > 6 else ''}{own})")
    if s.get("best"):
        b = s["best"]
        t.add_row("best", f"step {b['step']} by the held-out estimate (tau {b['tau_estimate']:.3f}): "
                          f"{b['checkpoint']}" + (f", served: {b['export']}" if isinstance(b.get("export"), str) else ""))
    for w in (s.get("telemetry") or {}).get("workers", []):
        top = w.get("top_idle_cause") or "-"
        share = w["idle_s"].get(top, 0) / w["wall_s"] if w.get("wall_s") and top != "-" else 0
        t.add_row(f"worker {w['worker']}",
                  f"busy {w['busy_fraction']:.1%} of {w['wall_s']:.1f} s, top idle cause: {top} ({share:.1%})")
    h = (s.get("telemetry") or {}).get("health") or {}
    if h:
        from otel.health import exporters_line
        dropped = ", ".join(f"{r} {n}" for r, n in (h.get("dropped") or {}).items() if n)
        t.add_row("telemetry", f"spans recorded {h.get('spans_recorded', 0)}, exported {h.get('spans_exported', 0)}, "
                               f"dropped {h.get('spans_dropped', 0)}{f' ({dropped})' if dropped else ''}, "
                               f"queued {h.get('spans_queued', 0)}, export failures {h.get('export_failures', 0)}"
                               + (f"; by exporter: {exporters_line(h['exporters'])}" if h.get("exporters") else ""))
    # only what is on disk: a run whose telemetry went to a collector has no telemetry/
    written = [name for name in ("checkpoint", "summary.json", "learning_curve.png", "telemetry/", "error.txt")
               if (Path(out_dir) / name.rstrip("/")).exists()]
    t.add_row("files", "  ".join(f"{out_dir}/{name}" for name in written) or "none")
    con.print(t)


def _tau(e: dict) -> str:
    """Both conventions, labelled: per verify step (engines' count) first, the per-prompt mean beside."""
    if "tau_per_step" not in e:
        return f"{e['acceptance_length']:.3f} per-prompt mean"
    return f"{e['tau_per_step']:.3f} per verify step / {e['acceptance_length']:.3f} per-prompt mean"

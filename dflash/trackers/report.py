"""What every tracker is sent: the live metrics of a training run, its end-of-run summary
and an eval's figures, as flat `name -> value` dicts (the same names for W&B, TensorBoard
and MLflow).

Summary keys:
  tokens_per_s, tokens, steps, wall_s, loss_first, loss_last, nonfinite_steps,
  stage/<stage>/{p50_s,p95_s,p99_s,max_s,share,count},
  idle_fraction/<worker>, busy_fraction/<worker>, idle_s/<worker>/<cause>, idle_source
  (telemetry: the layer's live attribution; spans: this rank's traces.jsonl; stage_shares),
  telemetry/{spans_recorded,spans_exported,spans_dropped,export_failures},
  balance/..., tau (and tau_before) with `train --eval` or after `dflash eval --tracker`.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path


def telemetry_metrics(tel_summary: dict) -> dict:
    """tel.summary() -> flat keys (per-stage percentiles and share, health counters)."""
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
    from otel import attribute_idle, read_spans

    from ..analysis.idle_rules import DFLASH_RULES

    try:
        snap = attribute_idle(read_spans(str(path)), DFLASH_RULES)
    except Exception as e:  # never let the summary fail on a damaged file
        print(f"dflash: tracker bridge: idle attribution skipped ({type(e).__name__}: {e})", file=sys.stderr)
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
    """The end-of-run summary from train()'s summary dict (with `telemetry`)."""
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
    if isinstance(summary.get("eval_after"), dict):  # prompt lookup's tau, per-position shares, sets
        out |= {k: v for k, v in eval_metrics(summary["eval_after"]).items()
                if k.startswith(("baseline/", "per_position_acceptance/", "sets/"))}
    return out


def final_summary(summary: dict, run_dir: Path, rank: int, world_size: int) -> dict:
    """run_summary with the best idle attribution at hand: the telemetry layer's live one,
    else this rank's spans on disk, else the stage shares."""
    tel = summary.get("telemetry") or {}
    idle, source = idle_from_telemetry(tel), "telemetry"
    if not idle:  # an older/disabled layer
        idle, source = idle_from_spans(run_dir, rank, world_size), "spans"
    if not idle:
        idle, source = idle_from_stages(tel), "stage_shares"
    return run_summary(summary, idle, source)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def eval_metrics(res: dict, extra: dict | None = None) -> dict:
    """`dflash eval`'s result -> tracker keys. Generic, so new figures flow through without
    this code knowing them: `tau`; every number (and yes/no) at the result's top level as
    `eval/<key>`; the baseline's numbers as `baseline/<key>`; per-position acceptance as
    `per_position_acceptance/<k>` (a list's first item is position 1); each set's tau (and its
    baseline's) as `sets/<name>/tau`. `extra`: more keys
    (a side-by-side eval's `compare/<i>/...`). None values are left out."""
    out = {"tau": res.get("acceptance_length")}
    for k, v in res.items():
        if _number(v) or isinstance(v, bool):
            out[f"eval/{k}"] = v
    base = res.get("baseline")
    if isinstance(base, dict):
        out |= {f"baseline/{k}": v for k, v in base.items() if _number(v) or isinstance(v, bool)}
    ppa = res.get("per_position_acceptance")
    if isinstance(ppa, dict):
        out |= {f"per_position_acceptance/{k}": v for k, v in ppa.items() if _number(v)}
    elif isinstance(ppa, (list, tuple)):
        out |= {f"per_position_acceptance/{i}": v for i, v in enumerate(ppa, 1) if _number(v)}
    for name, st in (res.get("sets") or {}).items():  # --bench / --prompts-from: one row each
        if isinstance(st, dict):
            out[f"sets/{name}/tau"] = st.get("acceptance_length")
            if isinstance(st.get("baseline"), dict):
                out[f"sets/{name}/baseline_tau"] = st["baseline"].get("acceptance_length")
    out |= extra or {}
    return {k: v for k, v in out.items() if v is not None}


def flatten(tree: dict, prefix: str = "") -> dict:
    """A config tree as dotted keys -> scalars (lists and empty mappings as text): MLflow
    params, TensorBoard hparams."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out |= flatten(v, key + ".")
        elif isinstance(v, (bool, int, float, str)) or v is None:
            out[key] = v
        else:
            out[key] = str(v)
    return out


def numeric(metrics: dict) -> dict:
    """The numbers of a metrics dict, yes/no as 1/0 (what TensorBoard and MLflow can plot)."""
    return {k: float(v) for k, v in metrics.items() if _number(v) or isinstance(v, bool)}

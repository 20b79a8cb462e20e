"""Confidence-gated drafting (issue 53), measured: a DSpark drafter with a confidence head decoded
by our decoder on its run's held-out prompts at several `eval.confidence_threshold`s, each
beside the ungated decode: tau per verify step, draft tokens verified per draft token accepted
(`drafted_per_accepted`: what a verify step spends on drafts thrown away), per-position
acceptance, lossless. One target load, the thresholds one after another on the same prompts
(greedy, fp32). Also the head's calibration on those decodes: its mean estimate for slot 1
beside slot 1's acceptance rate.

    .venv/bin/python bench/confidence_gate.py RUN/export --target smollm2 --thresholds 0,0.3,0.5,0.7,0.9

The last line is one JSON object."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def bad(msg: str):
    print(f"bench/confidence_gate.py: {msg}", file=sys.stderr)
    sys.exit(2)


def thresholds(text: str) -> list[float]:
    """--thresholds -> floats in 0..1, or one line and exit 2."""
    try:
        ts = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ts = []
    if not ts or not all(0 <= t <= 1 for t in ts):  # nan fails both
        bad(f"--thresholds {text!r}: expected a comma list of probabilities in 0..1, e.g. 0,0.3,0.6")
    return ts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("export")
    ap.add_argument("--target", help="default: the target the export's run trained for")
    ap.add_argument("--thresholds", default="0,0.3,0.5,0.7,0.9")
    ap.add_argument("--prompts", type=int, default=16)
    a = ap.parse_args()
    ts = thresholds(a.thresholds)
    if a.prompts < 1:
        bad(f"--prompts {a.prompts}: expected an integer >= 1")

    from dflash.checkpoint import drafter_dirs
    from dflash.errors import UserError
    from dflash.preflight.checkpoint_files import EVAL_PROMPTS, EVAL_SETTINGS

    exp = Path(a.export)
    try:
        d = drafter_dirs.inspect(exp, flag="export")
    except UserError as e:
        bad(str(e))
    if d.kind != "export" or not (exp / EVAL_SETTINGS).is_file() or not (exp / EVAL_PROMPTS).is_file():
        bad(f"{exp}: expected an export of ours (`dflash export`: its held-out prompts and eval settings beside it)")
    if not drafter_dirs.fields(d).get("confidence_head"):
        bad(f"{exp}: not a DSpark drafter with a confidence head")
    settings = json.loads((exp / EVAL_SETTINGS).read_text())
    ev = settings.get("eval") or {}  # the run's eval settings (the prompts were scored with these)
    target_spec = a.target or (settings.get("model") or {}).get("target") or "smollm2"

    import torch

    from dflash.data import prompt_sets
    from dflash.decode.evaluate import evaluate
    from dflash.model.target import load_target

    drafter = drafter_dirs.load(d)
    ps = prompt_sets.read_file(str(exp / EVAL_PROMPTS)).capped(a.prompts)
    ps.max_prompt_len = ev.get("max_prompt_len", 0)
    target, tok = load_target(target_spec, dtype=torch.float32)
    rows = []
    for t in ts:
        t0 = time.perf_counter()
        res = evaluate(target, drafter, tok, [], prompts=len(ps.dialogs), prompt_set=ps, progress=False,
                       max_new_tokens=ev.get("max_new_tokens", 96), max_prompt_len=ps.max_prompt_len,
                       confidence_threshold=t)
        steps = sum(res["histogram"].values())
        row = {"threshold": t, "tau_per_step": res["tau_per_step"], "drafted_per_accepted": res["drafted_per_accepted"],
               "per_position_acceptance": res["per_position_acceptance"], "verify_steps": steps,
               "lossless": res["lossless"], "wall_s": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(f"threshold {t:.2f}: tau/step {row['tau_per_step']:.4f}  drafted/accepted "
              f"{row['drafted_per_accepted'] if row['drafted_per_accepted'] is not None else '-'}  "
              f"per position {row['per_position_acceptance']}  steps {steps}  lossless {row['lossless']}  "
              f"{row['wall_s']} s", flush=True)
    print(json.dumps({"export": str(exp), "target": target_spec, "prompts": len(ps.dialogs),
                      "max_new_tokens": ev.get("max_new_tokens", 96), "max_prompt_len": ps.max_prompt_len,
                      "rows": rows}))


if __name__ == "__main__":
    main()

"""The demos' record: one dated file per demo in docs/records/, written by the demo itself,
behind every figure README's first screen shows.

Why: README's table once stitched three runs into one row, and the paragraph under it quoted
a fourth; figures a newcomer reads must come from one run, with its date and its machine. So
`make demo` / `make demo-long` end with

    python -m dflash.analysis.demo_record runs/demo --name demo --command "make demo" --wall-s S

which reads the run's summary.json (the served drafter's tau beside prompt lookup's, the
engine's paired verdict with its intervals and machine, the phases' seconds), writes
docs/records/NAME.json, and regenerates README's table from every record there (between its
`demo-table` markers). tests/unit/test_readme_record.py fails when README and the records
differ. `--readme-only` regenerates the table alone.

Everything is checked before anything is written (the name is a plain name, the wall a finite
count of seconds, README's markers in place, every record there a record), and a run without
an engine verdict (a machine where .venv-vllm did not build) does not replace a record that
has one: the figures README shows stay the last ones measured.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "docs" / "records"
README = ROOT / "README.md"
BEGIN, END = "<!-- demo-table:begin -->", "<!-- demo-table:end -->"
ORDER = ("demo", "demo-long")  # the table's rows, then any other record by name


def _ratio(sp: dict | None) -> dict | None:
    if not sp or "concurrency_1" not in sp:
        return None
    out = {"point": sp["concurrency_1"], "interval": sp.get("concurrency_1_interval")}
    if sp.get("these_prompts"):  # the rounds of these prompts alone: the machine's jitter (engine/pairing.py)
        out["these_prompts"] = sp["these_prompts"]["interval"]
    if sp.get("held_out"):  # over every held-out prompt, from the timed ones' time per step (engine/pairing.py)
        out["held_out"] = {k: sp["held_out"][k] for k in ("point", "interval", "prompts")}
    return out


def from_summary(summary: dict, *, name: str, command: str, wall_s: float | None,
                 date: str | None = None) -> dict:
    """The record of one demo run from its summary.json."""
    from ..engine.machine import host

    after = summary.get("eval_after") or {}
    base = after.get("baseline") or {}
    data = summary.get("data") or {}
    rec = {"name": name, "command": command, "date": date or datetime.date.today().isoformat(),
           "wall_s": None if wall_s is None else round(wall_s),
           "cache": _cache(data),
           "phases_s": {"regeneration": data.get("regen_s"), "training": summary.get("wall_s")},
           "tau": {"prompts": after.get("prompts"),
                   "drafter": {"per_step": after.get("tau_per_step"), "per_prompt": after.get("acceptance_length")},
                   "prompt_lookup": {"per_step": base.get("tau_per_step"), "per_prompt": base.get("acceptance_length")}},
           "verdict": None, "machine": host()}  # no verdict: this machine all the same (its figures are its)
    v = summary.get("engine")
    if v and "methods" in v:
        label = next(k for k in v["methods"] if k not in ("none", "ngram") and not k.endswith(", auto)"))
        auto = (v.get("k_auto") or {}).get(label) or {}
        served = next((k for k, m in v["methods"].items() if k.startswith(label) and m.get("k") == auto.get("k")),
                      label)
        m = v["methods"]
        rec["phases_s"]["verdict"] = v.get("wall_s")
        rec["verdict"] = {
            "engine": f"vLLM {v.get('version')}", "prompts": v.get("prompts"), "rounds": v.get("rounds"),
            "paired": bool(v.get("paired")), "turn_ms": v.get("turn_ms"), "k": m[served].get("k"), "k_block": m[label].get("k"),
            "tokens_per_s": {"none": m["none"]["tokens_per_s"].get("concurrency_1"),
                             "ngram": m["ngram"]["tokens_per_s"].get("concurrency_1"),
                             "drafter": m[served]["tokens_per_s"].get("concurrency_1")},
            "drafter_vs_none": _ratio(m[served].get("speedup_vs_none")),
            "drafter_vs_ngram": _ratio(m[served].get("speedup_vs_ngram")),
            "predicted_vs_none": m[served].get("predicted_speedup_vs_none"),
            "tau_per_step_vllm": m[served].get("tau_per_step"), "lossless": m[served].get("lossless")}
        rec["machine"] = v.get("machine") or rec["machine"]
    return rec


def write(rec: dict, records: Path = RECORDS) -> Path:
    records.mkdir(parents=True, exist_ok=True)
    path = records / f"{rec['name']}.json"
    path.write_text(json.dumps(rec, indent=2) + "\n")
    return path


class RecordError(ValueError):
    """A record, README or argument that would not make a table: one line naming it."""


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")  # a record is docs/records/NAME.json: no dots, no slashes


def load(records: Path = RECORDS) -> list[dict]:
    """Every record there, the demos first; one that is not a record (broken JSON, a figure of
    the wrong type) is named, not a traceback that blocks every later table."""
    recs = {}
    for path in sorted(records.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
            table([rec])
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
            raise RecordError(f"{path}: not a demo record ({type(e).__name__}: {e}); fix or remove it") from None
        recs[path.stem] = rec
    return [recs[n] for n in ORDER if n in recs] + [r for n, r in recs.items() if n not in ORDER]


def _bound(x: float) -> str:
    """An interval's end to 2 decimals, or 3 where 2 would print 1.00 for an end that is not 1:
    [1.0027, 1.11] decides (it excludes 1), and must not read as [1.00, 1.11]."""
    return f"{x:.3f}" if f"{x:.2f}" == "1.00" and x != 1 else f"{x:.2f}"


def _x(r: dict | None) -> str:
    if not r:
        return "-"
    iv, wide = r.get("interval"), r.get("held_out")
    out = f"{r['point']:.2f}x [{_bound(iv[0])}, {_bound(iv[1])}]" if iv else f"{r['point']:.2f}x (one unpaired run)"
    if wide:  # over every held-out prompt: the timed ones' cost per pass, our passes on each (docs/serving.md)
        lo, hi = wide["interval"]
        out += f"; all {wide['prompts']} prompts: {wide['point']:.2f}x [{_bound(lo)}, {_bound(hi)}]"
    return out


def _tau(t: dict) -> str:
    ps, pp = t.get("per_step"), t.get("per_prompt")
    return " / ".join("-" if x is None else f"{x:.2f}" for x in (ps, pp))


def _cache(data: dict) -> str:
    """What the run found cached, as the wall's qualifier: a run that regenerated most of its
    replies is not "warm" (make demo-long with make demo's 162 of its 1,494 cached)."""
    total, cached = data.get("regen_total"), data.get("regen_cached") or 0
    if not total:  # no regeneration in the run: no cache to speak of
        return "n/a: no replies regenerated"
    if not cached:  # every reply regenerated, or some dropped and none found cached
        return f"empty: none of {total} replies cached"
    kind = "warm" if cached >= total else "partly warm"
    return f"{kind}: {cached} of {total} replies cached"


def _wall(rec: dict) -> str:
    s = rec.get("wall_s")
    if s is None:
        return "-"
    return f"{s // 60} min {s % 60} s, cache {rec['cache'].split(':')[0]}"


def _machine(m: dict | None) -> str:
    from ..engine.machine import kind

    if not m:
        return "-"
    return f"{m.get('cpu') or 'CPU model not recorded'}, {m.get('logical_cpus', '?')} CPUs, {kind(m)} kernels"


def table(recs: list[dict]) -> str:
    """README's table, one row per record, every figure from it."""
    # two decoders, two tau: ours drafts block - 1 a step on every held-out prompt; vLLM serves the k
    # the verdict picked (k auto) on the verdict's prompts, and counts its own
    rows = ["| run, date | drafter, our decoder (k = block - 1, all held-out prompts): tau per step / per prompt "
            "| prompt lookup | vLLM at the served k: tau per step (k) | vLLM tok/s, c=1: drafter / ngram / none "
            "| drafter vs none [95%] | drafter vs ngram [95%] | wall | machine |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in recs:
        v = r.get("verdict") or {}
        tps = v.get("tokens_per_s") or {}
        speeds = " / ".join("-" if tps.get(k) is None else f"{tps[k]:.1f}" for k in ("drafter", "ngram", "none"))
        vtau = v.get("tau_per_step_vllm")
        served = "-" if vtau is None else f"{vtau:.2f} (k={v.get('k')}, {v.get('prompts')} prompts)"
        if v.get("lossless") is False:  # a served drafter that changed the output: said where the figure is
            served += ", **NOT lossless**"
        command = str(r["command"]).replace("|", "\\|").replace("`", "'")  # one cell, one code span
        rows.append(f"| `{command}`, {r['date']} | **{_tau(r['tau']['drafter'])}** | "
                    f"{_tau(r['tau']['prompt_lookup'])} | {served} | {speeds} | {_x(v.get('drafter_vs_none'))} | "
                    f"{_x(v.get('drafter_vs_ngram'))} | {_wall(r)} | {_machine(r.get('machine'))} |")
    return "\n".join(rows)


def readme_block(recs: list[dict]) -> str:
    return (f"{BEGIN}\n<!-- generated from docs/records/*.json by `python -m dflash.analysis.demo_record "
            f"--readme-only`; edit the records, not this table -->\n{table(recs)}\n{END}")


def _markers(readme: Path) -> tuple[str, int, int]:
    """README's text and where its table starts and ends; one line if the markers are not one
    begin before one end (a table regenerated between misplaced markers would eat the text)."""
    try:
        text = readme.read_text()
    except OSError as e:
        raise RecordError(f"{readme}: cannot read it ({e.strerror or e})") from None
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise RecordError(f"{readme}: expected one {BEGIN} line before one {END} line around the demos' table")
    return text, text.index(BEGIN), text.index(END) + len(END)


def update_readme(readme: Path = README, records: Path = RECORDS) -> bool:
    """Rewrite README's table from the records; True if it changed."""
    text, i, j = _markers(readme)
    new = text[:i] + readme_block(load(records)) + text[j:]
    if new != text:
        readme.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash.analysis.demo_record", description=__doc__.split("\n")[0])
    ap.add_argument("run", nargs="?", help="the demo's run dir (its summary.json)")
    ap.add_argument("--name", help="the record's name: docs/records/NAME.json")
    ap.add_argument("--command", help="what ran it, as README names it (make demo)")
    ap.add_argument("--wall-s", type=float, help="the whole command's wall seconds")
    ap.add_argument("--readme-only", action="store_true", help="regenerate README's table from the records")
    a = ap.parse_args(argv)
    try:
        _markers(README)  # before anything is written: a README the table cannot go into is one line
        if not a.readme_only:
            rec = _checked_record(a)
            if rec is None:
                return 0
            path = write(rec, RECORDS)
            print(f"demo_record: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}", file=sys.stderr)
        if update_readme(README, RECORDS):
            print("demo_record: README.md's table regenerated from docs/records/", file=sys.stderr)
    except RecordError as e:
        print(f"demo_record: {e}", file=sys.stderr)
        return 2
    return 0


def _checked_record(a) -> dict | None:
    """The record of the run the arguments name, checked before anything is written; None when
    the run has no verdict and the record it would replace has one (kept, and said)."""
    if not (a.run and a.name and a.command):
        raise RecordError("expected RUN --name NAME --command COMMAND (or --readme-only)")
    if not NAME.fullmatch(a.name):
        raise RecordError(f"--name {a.name!r}: expected a plain name (letters, digits, - and _): the record is "
                          "docs/records/NAME.json")
    if any(ord(c) < 32 or ord(c) == 127 for c in a.command):
        raise RecordError(f"--command {a.command!r}: expected one line without control characters")
    if a.wall_s is not None and not 0 <= a.wall_s <= 30 * 86400:  # nan fails both
        raise RecordError(f"--wall-s {a.wall_s}: expected the command's seconds, >= 0 and finite")
    summary_path = Path(a.run) / "summary.json"
    if not summary_path.is_file():
        raise RecordError(f"{summary_path}: no summary.json (expected a finished `dflash train` run dir)")
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, ValueError) as e:
        raise RecordError(f"{summary_path}: not a run's summary ({e})") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("eval_after"), dict):
        raise RecordError(f"{summary_path}: no eval after training (expected a `dflash train --eval` run)")
    engine = summary.get("engine")
    if isinstance(engine, dict) and "error" in engine:
        raise RecordError(f"{summary_path}: its engine verdict failed ({str(engine['error'])[:200]}): no record written")
    try:
        rec = from_summary(summary, name=a.name, command=a.command, wall_s=a.wall_s)
        table([rec])
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, StopIteration) as e:
        raise RecordError(f"{summary_path}: not a finished `train --eval` run's summary "
                          f"({type(e).__name__}: {e})") from None
    old = RECORDS / f"{a.name}.json"
    if rec["verdict"] is None and old.is_file():
        try:
            had = json.loads(old.read_text()).get("verdict")
        except (OSError, ValueError, AttributeError):
            had = None
        if had:
            print(f"demo_record: {a.run} has no engine verdict (no .venv-vllm?): {old} keeps "
                  "the earlier run, which has one", file=sys.stderr)
            return None
    return rec


if __name__ == "__main__":
    sys.exit(main())

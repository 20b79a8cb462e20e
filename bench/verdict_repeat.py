"""The demo's paired verdict, repeated on one export: do its intervals hold from run to run?

Issue 55 asks the verdict to decide "drafter vs none" and "drafter vs ngram" at 95% on the
machine it ran on, with a half-width of at most 0.05, within the demo's ~4 minutes. This
runs the verdict a trained run's own `train --eval` runs (engine/verdict.engine_verdict: the
eval's first `eval.engine_prompts` prompts and their output lengths, `eval.engine_rounds`
rounds, k auto beside block_size - 1) `--repeats` times, one after the other, on the same
export, and prints per repeat: its wall time, the machine, tokens/s, each ratio with its
interval, the cost of a verify step (drafter / target verify / rest) and the ratio it
predicts, the k picked and its paired comparison with block_size - 1, and the CPU the idle
engines took. Then whether the intervals overlap and their largest half-width, and a
markdown table for docs/serving.md.

`--idle both` adds one verdict with the idle engines left running (not frozen): what an idle
engine's second of polling does to the served engine beside it, measured.

    .venv/bin/python bench/verdict_repeat.py --run runs/demo            # ~13 min; alone: an engine takes both cores
    .venv/bin/python bench/verdict_repeat.py --run runs/demo-long
    .venv/bin/python bench/verdict_repeat.py --run runs/demo --rounds 3 --prompts 6   # another R x prompts

`--isa native,avx2` runs each repeat once per instruction set, alternating: `avx2` with
DFLASH_VLLM_ISA=avx2 (vLLM's AVX2 kernels, torch's, oneDNN's and MKL's capped at AVX2, on this
CPU: engine/machine.py), so what the AVX2 kernels change in a verify step is measured side by
side with the native one on the same machine and prompts.

    .venv/bin/python bench/verdict_repeat.py --run runs/demo --repeats 1 --isa native,avx2

`--turn-ms 0,20` runs each repeat once per way of timing, alternating: 0 asks each engine in
turn for a whole request; 20 asks every engine at once and runs them in turns of 20 ms
(engine/paired.py `ask_in_turns`), so each way's jitter (the interval over these prompts'
rounds alone) is measured side by side on the same machine and prompts.

    .venv/bin/python bench/verdict_repeat.py --run runs/demo --repeats 2 --turn-ms 0,20 --rounds 3

`--recorded` starts no engine: it reads the verdict the run already holds (summary.json's
per-request seconds) and prints each drafter ratio's interval both ways, over prompts and
rounds and over the rounds of these prompts alone (the machine's jitter), and how many
prompts the full interval would need for a half-width of 0.05 (the half-width shrinks as
one over the square root of the prompts: it is their spread that widens it), with the
seconds of requests that would take at the recorded speeds; and, where the eval held out more
prompts than the verdict timed, the interval over all of them (engine/pairing.steps_interval:
each method's time per forward pass on the timed prompts, our count of its passes on every one).

    .venv/bin/python bench/verdict_repeat.py --run runs/demo --recorded

The verdicts write no k into the export (the demo's own verdict does). The last line printed
is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _row(v: dict, drafter: str) -> dict:
    m = v["methods"]
    d = m[drafter]
    auto = next(iter((v.get("k_auto") or {}).values()), {})
    served = next((k for k, f in m.items() if k.startswith(drafter) and f.get("k") == auto.get("k")), drafter)
    s = m[served]
    return {"wall_s": v["wall_s"], "machine": v["machine"], "idle_engines": v["idle_engines"],
            "tokens_per_s": {k: f["tokens_per_s"]["concurrency_1"] for k, f in m.items()},
            "k_block": d["k"], "k_auto": auto.get("k"), "k_auto_measured": (auto.get("measured") or {}).get("auto_vs_block"),
            "served": served,
            "vs_none": s["speedup_vs_none"], "vs_ngram": s["speedup_vs_ngram"],
            "block_vs_none": d["speedup_vs_none"], "block_vs_ngram": d["speedup_vs_ngram"],
            "predicted_vs_none": s.get("predicted_speedup_vs_none"),
            "predicted_vs_ngram": s.get("predicted_speedup_vs_ngram"),
            "break_even_tokens_per_step": s.get("break_even_tokens_per_step"),
            "cost_per_step_ms": {k: f.get("cost_per_step_ms") for k, f in m.items()},
            "tau_per_step": s.get("tau_per_step"), "lossless": all(f["lossless"] for k, f in m.items() if k != "none"),
            "jitter": _jitter(m, served)}


def _jitter(m: dict, served: str) -> dict:
    """The served drafter's ratios over these prompts' rounds alone: the machine's jitter."""
    from dflash.engine.pairing import interval

    out = {}
    for base in ("none", "ngram"):
        t = m[base]["per_request_s"]
        if len(t[0]) > 1:
            iv = interval(t, m[served]["per_request_s"], these_prompts=True)
            out[f"vs_{base}"] = {"point": iv["point"], "interval": [iv["low"], iv["high"]],
                                 "half_width": iv["half_width"]}
    return out


def _iv(sp: dict) -> str:
    lo, hi = sp["concurrency_1_interval"]
    return f"{sp['concurrency_1']:.2f}x [{lo:.2f}, {hi:.2f}]"


def _overlap(ivs: list[list[float]]) -> bool:
    return max(lo for lo, _ in ivs) <= min(hi for _, hi in ivs)


GOAL = 0.05  # issue 55's half-width


def prompts_for(half_width: float, prompts: int) -> int:
    """The prompts a half-width of GOAL needs: the expanded interval's width goes as
    t_{n-1} / sqrt(n - 1) in the prompts n (engine/pairing.expanded_tail), the square-root
    law with a widening that eases as they grow. From 3 prompts or fewer the interval is the
    bootstrap's extreme draws, which this does not model: a guide there, not a figure."""
    import math

    from scipy import stats

    def spread(n):
        return stats.t.ppf(0.975, n - 1) / math.sqrt(n - 1)
    if half_width <= GOAL:
        return prompts
    n = start = max(prompts, 2)
    while half_width * spread(n) / spread(start) > GOAL and n < 100_000:
        n += 1
    return n


def recorded_error(summary) -> str | None:
    """Why a summary's verdict cannot be read back, in one line, or None: every method's
    per-request seconds positive and finite, in the shape of none's; the held-out counts' inputs
    of the types they need."""
    import math

    eng = summary.get("engine") if isinstance(summary, dict) else None
    methods = eng.get("methods") if isinstance(eng, dict) else None
    if not isinstance(methods, dict) or "none" not in methods:
        return "no engine verdict with a `none` method"
    shape = None
    for label, m in methods.items():
        t = m.get("per_request_s") if isinstance(m, dict) else None
        ok = (isinstance(t, list) and t and all(isinstance(r, list) and r for r in t)
              and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
                      for r in t for x in r))
        if not ok:
            return f"{label}: per_request_s is not prompts x rounds of positive seconds"
        if shape is None:
            shape = [len(r) for r in methods["none"]["per_request_s"]]
        if [len(r) for r in t] != shape:
            return f"{label}: per_request_s has another shape than none's ({len(t)} prompts, not {len(shape)})"
    if len(methods) < 2:
        return "no method beside none"
    after = summary.get("eval_after") or {}
    held = after.get("per_prompt_steps") if isinstance(after, dict) else None
    if isinstance(held, list) and len(held) > len(shape):
        k = (eng.get("ngram") or {}).get("num_speculative_tokens") if isinstance(eng.get("ngram"), dict) else None
        if not isinstance(after.get("block_size"), int) or after["block_size"] < 2 or not isinstance(k, int) or k < 1:
            return "eval_after.block_size or engine.ngram.num_speculative_tokens missing: no held-out counts"
        if any(not isinstance(m.get("k"), (int, type(None))) or m.get("k") == 0 for m in methods.values()):
            return "a method's k is not a positive integer: no held-out counts"
    return None


def recorded(run: Path) -> dict:
    """The run's own verdict, read back (no engine): per drafter and base, the interval over
    prompts and rounds, the one over these prompts' rounds alone, and the prompts (and
    seconds of requests, every engine once per prompt and round) a half-width of GOAL needs."""
    from dflash.engine.pairing import interval, steps_interval
    from dflash.engine.verdict import passes_per_method

    summary = json.loads((run / "summary.json").read_text())
    eng, after = summary["engine"], summary.get("eval_after") or {}
    methods = eng["methods"]
    times = {k: m["per_request_s"] for k, m in methods.items()}
    prompts, rounds = len(times["none"]), len(times["none"][0])
    per_prompt_s = sum(sum(sum(t) for t in ts) for ts in times.values()) / prompts  # every engine, every round
    out = {"prompts": prompts, "rounds": rounds, "engines": len(times), "machine": eng.get("machine"), "ratios": {}}
    held = after.get("per_prompt_steps") or []
    wide = {}  # our steps on every held-out prompt (engine/verdict.our_steps), where there are more than the timed
    if len(held) > prompts and eng.get("temperature") == 0:
        wide = passes_per_method(held, eng["ngram"]["num_speculative_tokens"],
                                 {k: (m["k"], after["block_size"]) for k, m in methods.items()
                                  if k not in ("none", "ngram") and m.get("k")})
    for label in times:
        if label in ("none", "ngram"):
            continue
        for base in ("none", "ngram"):
            if base not in times:
                continue
            full = interval(times[base], times[label])
            fixed = interval(times[base], times[label], these_prompts=True) if rounds > 1 else None
            need = prompts_for(full["half_width"], prompts) if full["enough"] else None  # from too few: no guide
            out["ratios"][f"{label} vs {base}"] = {
                "point": full["point"], "prompts_and_rounds": [full["low"], full["high"]],
                "half_width": full["half_width"],
                "these_prompts": [fixed["low"], fixed["high"]] if fixed else None,
                "half_width_these_prompts": fixed["half_width"] if fixed else None,
                "prompts_for_goal": need, "request_s_for_goal": None if need is None else round(need * per_prompt_s)}
            if label in wide and base in wide:
                two = steps_interval(times[base], times[label], wide[base], wide[label])
                out["ratios"][f"{label} vs {base}"]["held_out"] = {
                    "point": two["point"], "interval": [two["low"], two["high"]], "half_width": two["half_width"],
                    "prompts": two["prompts"], "cost_share": two["cost_share"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", default=str(ROOT / "runs" / "demo"), help="a `train --eval` run dir with its export")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, help="default: the run's eval.engine_rounds")
    ap.add_argument("--prompts", type=int, help="default: the run's eval.engine_prompts")
    ap.add_argument("--idle", choices=("frozen", "both"), default="frozen",
                    help="both: one more verdict with the idle engines left running")
    ap.add_argument("--isa", default="native",
                    help="comma list of native and avx2: each repeat once per instruction set, alternating")
    ap.add_argument("--turn-ms", default=None,
                    help="comma list of turn lengths in ms (0: whole requests one engine after another): each "
                         "repeat once per length, alternating (default: the run's eval.engine_turn_ms)")
    ap.add_argument("--recorded", action="store_true",
                    help="no engine: the run's own recorded verdict, its intervals both ways and the prompts a "
                         f"half-width of {GOAL} needs")
    a = ap.parse_args()
    run = Path(a.run)
    from dflash.config import turn_error

    isas = a.isa.split(",")
    try:
        turns = None if a.turn_ms is None else [float(x) for x in a.turn_ms.split(",")]
    except ValueError:
        turns = []
    for what, ok in (("--isa", bool(isas) and set(isas) <= {"native", "avx2"} and len(set(isas)) == len(isas)),
                     ("--repeats", a.repeats >= 1), ("--rounds", a.rounds is None or a.rounds >= 1),
                     ("--prompts", a.prompts is None or a.prompts >= 1),
                     ("--turn-ms", turns is None or (bool(turns) and not any(turn_error(t, "") for t in turns)
                                                     and len({f"{t:g}" for t in turns}) == len(turns))),
                     ("--run", (run / "summary.json").is_file() and (run / "export").is_dir())):
        if not ok:
            want = {"--run": "a train --eval run dir (summary.json, export/)",
                    "--isa": "a comma list of native and avx2, each once",
                    "--turn-ms": "a comma list of distinct turn lengths: 0 (whole requests) or 5..10000 ms"
                    }.get(what, "an integer >= 1")
            print(f"verdict_repeat: {what}={getattr(a, what[2:].replace('-', '_'))!r}: expected {want}", file=sys.stderr)
            sys.exit(2)
    if a.recorded and (a.rounds is not None or a.prompts is not None or a.turn_ms is not None):  # it has its own
        print("verdict_repeat: --recorded reads the run's own verdict: --rounds, --prompts and --turn-ms do not apply; "
              "drop them", file=sys.stderr)
        sys.exit(2)
    try:
        summary = json.loads((run / "summary.json").read_text())
    except (OSError, ValueError) as e:
        print(f"verdict_repeat: --run {run}: summary.json is not readable JSON ({e})", file=sys.stderr)
        sys.exit(2)
    if not isinstance(summary, dict):
        print(f"verdict_repeat: --run {run}: summary.json is not a run's summary (a JSON object)", file=sys.stderr)
        sys.exit(2)
    if a.recorded:
        eng = summary.get("engine")
        if not isinstance(eng, dict) or not isinstance(eng.get("methods"), dict):  # none, or one that failed
            why = f" (it failed: {str(eng['error'])[:200]})" if isinstance(eng, dict) and "error" in eng else ""
            print(f"verdict_repeat: --run {run}: expected a run whose summary.json holds an engine verdict{why}",
                  file=sys.stderr)
            sys.exit(2)
        why = recorded_error(summary)
        if why:
            print(f"verdict_repeat: --run {run}: its verdict cannot be read back: {why}", file=sys.stderr)
            sys.exit(2)
        r = recorded(run)
        print(f"{r['prompts']} prompts x {r['rounds']} rounds, {r['engines']} engines; half-width goal {GOAL}")
        for name, x in r["ratios"].items():
            fixed = (f"[{x['these_prompts'][0]:.3f}, {x['these_prompts'][1]:.3f}] (+-{x['half_width_these_prompts']:.3f})"
                     if x["these_prompts"] else "- (one round)")
            print(f"{name}: {x['point']:.3f}x; over prompts and rounds [{x['prompts_and_rounds'][0]:.3f}, "
                  f"{x['prompts_and_rounds'][1]:.3f}] (+-{x['half_width']:.3f}); these prompts alone {fixed}; "
                  + (f"+-{GOAL} needs ~{x['prompts_for_goal']} prompts (~{x['request_s_for_goal']} s of requests)"
                     if x["prompts_for_goal"] else "too few requests to decide anything, or to extrapolate from"))
            if "held_out" in x:
                h = x["held_out"]
                print(f"  over all {h['prompts']} held-out prompts (time per step on the timed ones, our steps on "
                      f"every one): {h['point']:.3f}x [{h['interval'][0]:.3f}, {h['interval'][1]:.3f}] "
                      f"(+-{h['half_width']:.3f})" + ("" if h["cost_share"] is None else
                      f"; of its variance the timed prompts' cost per step carries {h['cost_share']:.0%}, "
                      f"the {h['prompts']} prompts' passes the rest"))
        print(json.dumps(r))
        return
    if "eval_after" not in json.loads((run / "summary.json").read_text()):
        print(f"verdict_repeat: --run {run}: expected a run trained with --eval (its summary.json has no eval "
              f"after training, whose prompts the verdict serves)", file=sys.stderr)
        sys.exit(2)
    from dflash.config import load_config
    from dflash.engine.machine import describe
    from dflash.engine.targets import engine_target
    from dflash.engine.verdict import engine_verdict, table

    summary = json.loads((run / "summary.json").read_text())
    cfg = load_config(str(run / "config.yaml"))
    after = summary["eval_after"]
    steps = after["per_prompt_steps"][:a.prompts or cfg.eval.engine_prompts or None]
    export = str((run / "export").resolve())
    k = after["block_size"] - 1
    target = engine_target(cfg.model.target, cfg.model.target_seed)
    rounds = a.rounds or cfg.eval.engine_rounds
    turns = turns if turns is not None else [getattr(cfg.eval, "engine_turn_ms", 0)]

    def name(isa, turn):
        return ("frozen" + ("" if isa == "native" else ", " + isa)
                + ("" if len(turns) == 1 else (", in turns of %g ms" % turn if turn else ", whole requests")))
    arms = [(name(isa, turn), True, isa, turn) for _ in range(a.repeats) for isa in isas for turn in turns]
    # the idle engines left running: whole requests (a turn is an engine alone, the others stopped)
    arms += [("spinning, whole requests", False, "native", 0)] if a.idle == "both" else []
    rows = []
    for n, (arm, freeze, isa, turn) in enumerate(arms, 1):
        print(f"verdict_repeat: verdict {n} of {len(arms)} ({arm} idle engines, {len(steps)} prompts x {rounds} "
              "rounds)", file=sys.stderr, flush=True)
        if isa == "avx2":  # read by every engine the verdict starts (engine/runner.py engine_env)
            os.environ["DFLASH_VLLM_ISA"] = "avx2"
        else:
            os.environ.pop("DFLASH_VLLM_ISA", None)
        v = engine_verdict(target=target, dtype=after["dtype"], steps=steps,
                           drafters=[{"label": export, "export": export, "k": k, "steps": steps}],
                           ngram_k=k, batched=False, eager=cfg.eval.engine_eager, rounds=rounds, auto_k=True,
                           record_k=False, freeze_idle=freeze, temperature=cfg.eval.temperature, seed=cfg.train.seed,
                           held_out=after["per_prompt_steps"], turn_ms=turn)
        print(table(v), file=sys.stderr, flush=True)
        rows.append({"arm": arm, "isa": isa, "turn_ms": turn, "frozen": freeze} | _row(v, export))
    # what the checks are about: the native repeats, one way of timing at a time (the first given;
    # the others' checks under checks_by_turn), never mixed with another instruction set
    native = [r for r in rows if r["frozen"] and r["isa"] == "native"] or [r for r in rows if r["frozen"]]
    by_turn = {}
    for turn in turns:
        same = [r for r in native if r["turn_ms"] == turn]
        if same:
            by_turn[f"{turn:g}"] = {key: {"overlap": _overlap([r[key]["concurrency_1_interval"] for r in same]),
                                          "max_half_width": max(r[key]["half_width"] for r in same),
                                          "decided": [r[key]["decided"] for r in same]}
                                    for key in ("vs_none", "vs_ngram")}
    frozen = [r for r in native if r["turn_ms"] == turns[0]] or native
    checks = by_turn.get(f"{turns[0]:g}") or next(iter(by_turn.values()))
    print(f"\nmachine: {describe(frozen[0]['machine'])}; {len(steps)} prompts x {rounds} rounds, "
          f"{cfg.eval.engine_eager and 'eager' or 'compiled'} engines", file=sys.stderr)
    print("| verdict | wall | tok/s none / ngram / drafter (k) | drafter vs none [95%] | drafter vs ngram [95%] | "
          "predicted vs none | ms/step draft / verify / rest | none's step ms | k auto vs block - 1 [95%] | "
          "idle engines' CPU |", file=sys.stderr)
    print("|---|---|---|---|---|---|---|---|---|---|", file=sys.stderr)
    for i, r in enumerate(rows, 1):
        t = r["tokens_per_s"]
        c = r["cost_per_step_ms"][r["served"]] or {}
        split = f"{c['drafter']:.1f} / {c['verify']:.1f} / {c['rest']:.1f}" if "step" in c else "-"
        none_step = (r["cost_per_step_ms"].get("none") or {}).get("step")
        km = r["k_auto_measured"]
        kcmp = f"k={r['k_auto']}: {km['point']:.2f}x [{km['low']:.2f}, {km['high']:.2f}]" if km else f"k={r['k_auto']} (= block - 1)"
        print(f"| {i} ({r['arm']}) | {r['wall_s']:.0f} s | {t['none']:.1f} / {t['ngram']:.1f} / "
              f"{t[r['served']]:.1f} (k={r['k_auto']}) | {_iv(r['vs_none'])} | {_iv(r['vs_ngram'])} | "
              f"{r['predicted_vs_none'] or 0:.2f}x | {split} | {none_step or 0:.1f} | {kcmp} | {r['idle_engines']['cpu_s']:.2f} s of "
              f"{r['idle_engines']['timed_s']:.0f} s |", file=sys.stderr)
    for turn, cs in by_turn.items():
        for key, c in cs.items():
            print(f"{'whole requests' if turn == '0' else 'turns of ' + turn + ' ms'}, {key}: intervals overlap: "
                  f"{c['overlap']}; largest half-width {c['max_half_width']:.3f} (goal <= 0.05); decided: "
                  f"{', '.join(c['decided'])}", file=sys.stderr)
    print(json.dumps({"run": str(run), "prompts": len(steps), "rounds": rounds, "verdicts": rows, "checks": checks,
                      "checks_by_turn": by_turn}))


if __name__ == "__main__":
    main()

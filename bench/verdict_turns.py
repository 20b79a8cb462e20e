"""Whole requests against turns, side by side on the same engines: what running the verdict's
engines in turns (engine/paired.py `ask_in_turns`, `eval.engine_turn_ms`) does to its jitter
and to the speeds it measures.

One set of engines (none, vLLM's ngram, the run's drafter at block_size - 1) is kept up, and
every prompt of the run's verdict is asked of all of them once per way of timing, the ways
rotated per prompt and round (which way goes first passes from way to way; the ways still run
one after another, seconds each): `0` (whole requests, one engine after another, as the verdict
did before turns) and each turn length given. Every request is timed by this process's clock
(a whole request from its send to its answer, a turned one by its turns). Printed per way: each engine's tokens/s, its
time over the same requests asked whole (paired by prompt and round: what the turns cost an
engine), and each ratio (drafter vs none, vs ngram, ngram vs none) with its interval over these
prompts' rounds alone (engine/pairing.interval, `these_prompts`: the machine's jitter).

    .venv/bin/python bench/verdict_turns.py --run runs/demo                     # ~12 min, alone on the machine
    .venv/bin/python bench/verdict_turns.py --run runs/demo --turn-ms 10,20,50,100 --rounds 3

`--whole-variants` adds two more ways of asking whole requests, to tell which way is off where
whole requests and turns disagree: `whole-reversed` (the engines in the opposite cyclic order,
so each follows the other neighbour) and `whole-settled` (a second of nothing before each
request: whatever the previous engine left running has stopped).

The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def check_args(a) -> str | None:
    """Why the arguments cannot run, in one line, or None."""
    run = Path(a.run)
    if not (run / "summary.json").is_file() or not (run / "export").is_dir():
        return f"--run={a.run!r}: expected a train --eval run dir (summary.json, export/)"
    from dflash.config import MAX_TURN_MS, MIN_TURN_MS, turn_error

    try:
        turns = [float(x) for x in a.turn_ms.split(",")]
    except ValueError:
        turns = []
    keys = [f"{t:g}" for t in turns]  # as the ways are named: two that print alike would share one
    if not turns or any(t == 0 or turn_error(t, "") for t in turns) or len(set(keys)) < len(keys):
        return (f"--turn-ms={a.turn_ms!r}: expected a comma list of distinct turn lengths, each "
                f"{MIN_TURN_MS:g}..{MAX_TURN_MS:g} ms (whole requests are always measured beside them)")
    for name in ("rounds", "prompts"):
        v = getattr(a, name)
        if v is not None and v < 1:
            return f"--{name}={v}: expected an integer >= 1"
    return None


def analyse(times: dict, tokens: list[int]) -> dict:
    """Per way of timing: tokens/s per engine, its time over the whole requests' (paired), and
    each ratio with its interval over these prompts' rounds."""
    from dflash.engine.pairing import interval

    whole = times["0"]
    out = {}
    for way, t in times.items():
        labels = list(t)
        rounds = len(t[labels[0]][0])
        row = {"tokens_per_s": {}, "over_whole": {}, "ratios": {}}
        for label in labels:
            secs = sum(map(sum, t[label]))
            row["tokens_per_s"][label] = round(sum(tokens) * rounds / secs, 2)
            row["over_whole"][label] = round(secs / sum(map(sum, whole[label])), 4)
        for other, base in (("drafter", "none"), ("drafter", "ngram"), ("ngram", "none")):
            iv = interval(t[base], t[other], these_prompts=True)
            row["ratios"][f"{other} vs {base}"] = {"point": iv["point"], "interval": [iv["low"], iv["high"]],
                                                   "half_width": iv["half_width"]}
        out[way] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", default=str(ROOT / "runs" / "demo"), help="a `train --eval` run dir with its export")
    ap.add_argument("--turn-ms", default="10,20,50", help="comma list of turn lengths in ms, beside whole requests")
    ap.add_argument("--whole-variants", action="store_true",
                    help="also whole requests in the reversed engine order, and after a second of rest each")
    ap.add_argument("--rounds", type=int, help="default: the run's eval.engine_rounds")
    ap.add_argument("--prompts", type=int, help="default: the run's eval.engine_prompts")
    a = ap.parse_args()
    why = check_args(a)
    if why:
        print(f"verdict_turns: {why}", file=sys.stderr)
        sys.exit(2)
    from dflash.config import load_config
    from dflash.engine import paired
    from dflash.engine.machine import describe, merged
    from dflash.engine.pairing import rotation
    from dflash.engine.targets import engine_target
    from dflash.engine.verdict import NGRAM, engine_job

    run = Path(a.run)
    summary = json.loads((run / "summary.json").read_text())
    cfg = load_config(str(run / "config.yaml"))
    after = summary["eval_after"]
    steps = after["per_prompt_steps"][:a.prompts or cfg.eval.engine_prompts or None]
    rounds = a.rounds or cfg.eval.engine_rounds
    k = after["block_size"] - 1
    job = engine_job(target=engine_target(cfg.model.target, cfg.model.target_seed), dtype=after["dtype"],
                     steps=steps, temperature=0.0, seed=cfg.train.seed, eager=cfg.eval.engine_eager)
    prompts, tokens = job["prompts"], job["max_tokens"]
    plan = [("none", None), ("ngram", NGRAM | {"num_speculative_tokens": k}),
            ("drafter", {"method": "dflash", "model": str((run / "export").resolve()), "num_speculative_tokens": k})]
    ways = ["0"] + (["whole-reversed", "whole-settled"] if a.whole_variants else []) \
        + [f"{float(x):g}" for x in a.turn_ms.split(",")]
    labels = [label for label, _ in plan]
    times = {w: {label: [[None] * rounds for _ in prompts] for label in labels} for w in ways}
    outputs: dict[str, list] = {label: [None] * len(prompts) for label in labels}
    try:  # the three engines together, before any starts
        paired.check_memory(job["target"], [None, None, str((run / "export").resolve())])
    except paired.EngineError as e:
        print(f"verdict_turns: {e}", file=sys.stderr)
        sys.exit(2)
    t0 = time.monotonic()
    with paired.Engines(job) as pool:
        pool.start(plan)
        where = merged(pool.engines["none"].ready.get("machine"))
        print(f"verdict_turns: {describe(where)}; {len(prompts)} prompts x {rounds} rounds x {len(ways)} ways",
              file=sys.stderr, flush=True)
        for r, i, asked in rotation(labels, len(prompts), rounds):
            o = (i + r) % len(ways)
            for way in ways[o:] + ways[:o]:  # which way goes first passes from way to way
                msg = {"op": "generate", "i": i}
                if way == "0":
                    got = {label: pool.ask(label, msg) for label in asked}
                elif way == "whole-reversed":
                    got = {label: pool.ask(label, msg) for label in asked[::-1]}
                elif way == "whole-settled":
                    got = {}
                    for label in asked:
                        time.sleep(1.0)
                        got[label] = pool.ask(label, msg)
                else:
                    got = pool.ask_in_turns(asked, msg, float(way) / 1000)
                for label, g in got.items():
                    # both ways by our clock (a turn's active_s, a whole request's asked_s)
                    times[way][label][i][r] = g["active_s"] if "active_s" in g else g["asked_s"]
                    if outputs[label][i] is None:
                        outputs[label][i] = g["output"]
                    elif g["output"] != outputs[label][i]:
                        raise SystemExit(f"verdict_turns: {label}'s output on prompt {i} changed between requests")
            print(f"verdict_turns: round {r + 1}, prompt {i + 1} of {len(prompts)}", file=sys.stderr, flush=True)
        idle = {"cpu_s": round(pool.idle_cpu_s, 3), "timed_s": round(pool.timed_s, 1)}
    lossless = all(outputs[label] == outputs["none"] for label in labels)
    res = analyse(times, tokens)
    print(f"\nmachine: {describe(where)}; {len(prompts)} prompts x {rounds} rounds; lossless: {lossless}; "
          f"idle engines' CPU {idle['cpu_s']} s of {idle['timed_s']} s; {time.monotonic() - t0:.0f} s", file=sys.stderr)
    print("| way | tok/s none / ngram / drafter | time over whole requests none / ngram / drafter | "
          "drafter vs none (these prompts) | drafter vs ngram | ngram vs none |", file=sys.stderr)
    print("|---|---|---|---|---|---|", file=sys.stderr)
    for way, row in res.items():
        t, w = row["tokens_per_s"], row["over_whole"]
        ivs = " | ".join(f"{x['point']:.3f} [{x['interval'][0]:.3f}, {x['interval'][1]:.3f}] (+-{x['half_width']:.3f})"
                         for x in row["ratios"].values())
        name = {"0": "whole requests"}.get(way, way if way.startswith("whole") else f"turns of {way} ms")
        print(f"| {name} | {t['none']:.1f} / {t['ngram']:.1f} / {t['drafter']:.1f} | "
              f"{w['none']:.3f} / {w['ngram']:.3f} / {w['drafter']:.3f} | {ivs} |", file=sys.stderr)
    print(json.dumps({"run": str(run), "machine": where, "prompts": len(prompts), "rounds": rounds,
                      "lossless": lossless, "idle_engines": idle, "ways": res, "per_request_s": times}))


if __name__ == "__main__":
    main()

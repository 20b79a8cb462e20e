"""Drafter architectures side by side (issue 38): DFlash vs DFlash2 (model.arch) and full vs
sliding-window layers, trained the same way on the same data and scored on the same held-out
prompts, at equal steps and at equal training time; docs/architectures.md holds the tables.

Each arm is a real `dflash train` (subprocesses, one after another, so they share the
machine's load alike); its figure is the held-out estimate walked per verify step
(`train.estimate_every`), which equals what our decoder decodes on the same prompts
(tests/unit/test_acceptance_estimate.py; the demo: 1.2693 walked, 1.2693 decoded). --decode
then decodes every arm's export in one `dflash eval` (the decoded figure, the lossless check,
a per-prompt SE). At equal
training time an arm's figure is its estimate at the steps the first arm's time buys at its
own s/step, read off its learning curve. With --engine, one `dflash eval --engine vllm` then
serves every arm vLLM-CPU can serve (DFlash, all-sliding; not DFlash2 nor mixed
sliding/full: docs/architectures.md) beside vLLM's ngram and no speculation, on the same
held-out prompts, our decoder beside it.

    .venv/bin/python bench/architectures.py --base demo --engine     # SmolLM2, configs/demo.yaml, ~45 min
    .venv/bin/python bench/architectures.py --base tiny --seeds 0,1,2 --arms dflash,dflash2

Noise: with --decode each prompt's tau, so the standard error over (seed, prompt) pairs and,
paired against the first arm, the mean difference ± its SE. A seed (train.seed) also draws
the data: its own conversations and held-out prompts, so prompts pair only within a seed. A run
dir already in --out is kept (an interrupted bench resumes). The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # dflash and otel from this checkout (the span reader)

BASES = {
    # a random tiny target: the whole path in a few minutes (its replies are loops)
    "tiny": {"args": ["--target", "tiny-qwen3", "--set", "data.num_conversations=96", "--set", "model.block_size=8",
                      "--set", "data.max_len=96", "--set", "eval.prompts=8", "--set", "eval.max_new_tokens=32",
                      "--set", "eval.before=false", "--set", "train.batch_size=4", "--set", "train.lr=3e-3",
                      "--set", "train.estimate_every=50",
                      "--set", "train.estimate_samples=8"],
             "steps": 200, "window": 16, "target": "tiny-qwen3"},
    # `make demo`: SmolLM2-135M, its regenerated ShareGPT replies, 600 steps, its held-out prompts (64 since 2026-12-08; the recorded tables: 16)
    "demo": {"args": ["--config", "configs/demo.yaml", "--set", "telemetry.console_interval_s=0"],
             "steps": 600, "window": 64, "target": "smollm2"},
}


def arms(base: str) -> dict[str, list[str]]:
    w = BASES[base]["window"]
    two = base == "demo"  # the demo's drafter has 2 layers; the tiny one 1
    slide = "sliding_attention,sliding_attention" if two else "sliding_attention"
    return {
        "dflash": [],
        # DFlash2 at the released checkpoint's sizes; its selector reads the full vocabulary (no draft vocab)
        "dflash2": ["--set", "model.arch=dflash2", "--set", "model.draft_vocab=0"],
        # DFlash on the head DFlash2 has (the full vocabulary): what the draft vocabulary is worth
        "dflash-fullvocab": ["--set", "model.draft_vocab=0"],
        # issue 53: Muon (train.optimizer=muon, at the recipe's lr) and DSpark (its Markov head; with and
        # without its confidence head), all on the full vocabulary as DFlash2 and DSpark need it
        "dflash-muon": ["--set", "model.draft_vocab=0", "--set", "train.optimizer=muon"],
        # Muon on the demo's own DFlash (its 4,096-token draft vocabulary): AdamW against Muon, one change
        "muon": ["--set", "train.optimizer=muon"],
        "dspark": ["--set", "model.arch=dspark", "--set", "model.draft_vocab=0"],
        "dspark-conf": ["--set", "model.arch=dspark", "--set", "model.draft_vocab=0",
                        "--set", "model.confidence_head=true"],
        # DSpark on the demo's own 4,096-token draft vocabulary (vLLM's reduced-vocabulary DSpark: markov_w2
        # one row per draft token, the drafter's head and d2t exported): the one change from the demo is the arch
        "dspark-dv": ["--set", "model.arch=dspark"],
        "dspark-conf-dv": ["--set", "model.arch=dspark", "--set", "model.confidence_head=true"],
        # does the Markov head gain more in a longer block (at block 4 DFlash accepts a second draft in 3% of
        # MT-Bench's verify steps)? both at block 8 (docs/architectures.md: not at the demo's size)
        "dflash-b8": ["--set", "model.block_size=8"],
        "dspark-conf-dv-b8": ["--set", "model.arch=dspark", "--set", "model.confidence_head=true",
                              "--set", "model.block_size=8"],
        "dspark-muon": ["--set", "model.arch=dspark", "--set", "model.draft_vocab=0", "--set", "train.optimizer=muon"],
        # the Markov tables are 2 x V x r parameters (2 x 49,152 x 256 = 25 M on SmolLM2, 3x the drafter's
        # layers): AdamW over them is most of a CPU step; rank 64 is a quarter of that
        "dspark-r64": ["--set", "model.arch=dspark", "--set", "model.draft_vocab=0", "--set", "model.markov_rank=64"],
        f"sliding-w{w}": ["--set", f"model.layer_types={slide}", "--set", f"model.sliding_window={w}"],
        f"mixed-w{w}": (["--set", "model.layer_types=sliding_attention,full_attention",
                         "--set", f"model.sliding_window={w}"] if two else None),
    }


def train(base: str, arm: str, extra: list[str], seed: int, steps: int, out: Path) -> dict:
    run = out / f"{base}-{arm}-s{seed}-{steps}"
    summary = run / "summary.json"
    if not summary.is_file():
        cmd = [sys.executable, "-m", "dflash", "train", *BASES[base]["args"], *extra, "--overwrite", "--no-telemetry", "--set", f"out={run}", "--set", f"train.steps={steps}",
               "--set", f"train.seed={seed}", "--set", "eval.engine=none", "--set", "eval.baseline=none"]
        print(f"[{arm} seed {seed}, {steps} steps] {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
        log = out / f"{run.name}.log"  # a file, not a pipe: the run outlives a killed bench
        out.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            sys.exit(f"bench/architectures.py: {' '.join(cmd)} exited {rc}:\n{log.read_text()[-3000:]}")
    s = json.loads(summary.read_text())
    ev = s.get("eval_after") or {}
    est = s.get("acceptance_estimate") or {}
    last = est.get("last") or {}
    return {"arm": arm, "seed": seed, "steps": s["steps"], "run": str(run), "wall_s": round(s["wall_s"], 1),
            "loss_last": s["loss_last"], "tau": ev.get("tau_per_step"), "tau_per_response": ev.get("acceptance_length"),
            "estimate": last.get("tau"), "estimate_history": est.get("history"), "lossless": ev.get("lossless"),
            "per_prompt": ev.get("per_prompt"), "per_position": ev.get("per_position_acceptance", last.get(
                "per_position_acceptance"))}


def at_step(history: list, k: float) -> float | None:
    """The walked estimate after k steps, read off the learning curve (linear between its points)."""
    pts = sorted(history or [])
    for (s0, t0), (s1, t1) in zip(pts, pts[1:]):
        if s0 <= k <= s1:
            return t0 + (t1 - t0) * (k - s0) / (s1 - s0)
    return None


def se(xs: list[float]) -> float:
    return statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0


def eval_exports(base: str, rows: list[dict], flags: list[str], tag: str) -> list[str]:
    """`dflash eval --json` over the rows' exports, side by side on the same held-out prompts;
    its stdout lines (the last: one JSON object)."""
    cmd = [sys.executable, "-m", "dflash", "eval", *flags, "--json", "--baseline", "none",
           "--target", BASES[base]["target"]]
    for r in rows:
        cmd += ["--checkpoint", str(Path(r["run"]) / "export")]
    print(f"[{tag}] {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"bench/architectures.py: {' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return p.stdout.strip().splitlines()


def _positions(steps: list[dict], k: int = 3) -> list[list[float]]:
    """Per prompt, the share of its verify steps that accepted at least j drafts, j = 1..k
    (from eval's per_prompt_steps: accepted + 1 per step), so positions pair prompt by prompt."""
    out = []
    for r in steps:
        al = r["acceptance_lengths"]
        out.append([sum(a - 1 >= j for a in al) / len(al) if al else 0.0 for j in range(1, k + 1)])
    return out


def _decoded(base: str, rs: list[dict], path: Path, flags: list[str], tag: str) -> dict:
    """Our decoder over the rows' exports, by export dir, cached in ``path``: an arm added later
    is decoded alone (its own `dflash eval`, on the same prompts: a seed's held-out prompts are
    its data split's) and added to the cache, so the arms already decoded are not decoded again."""
    def results(lines: list[str]) -> dict:
        got = json.loads(lines[-1])
        return {res["checkpoint"]: res for res in got.get("drafters", [got])}
    by_dir = json.loads(path.read_text()) if path.is_file() else {}
    if "drafters" in by_dir or "checkpoint" in by_dir:  # a cache written as one eval's JSON (before)
        by_dir = results([json.dumps(by_dir)])
    missing = [r for r in rs if str(Path(r["run"]) / "export") not in by_dir]
    if missing:
        by_dir |= results(eval_exports(base, missing, flags, tag))
        path.write_text(json.dumps(by_dir))
    return by_dir


def decode_side_by_side(rows: list[dict], base: str, out: Path, mt_bench: int = 0, mt_tokens: int = 48) -> None:
    """One `dflash eval` over every arm's export (our decoder, the same held-out prompts, one
    target load): each row gets its decoded tau per verify step, per-prompt taus, per-prompt
    per-position acceptance and the lossless check; with ``mt_bench``, the same on the first
    that many MT-Bench prompts (their first turns, ``mt_tokens`` new tokens each), under row["mt"]."""
    for seed in sorted({r["seed"] for r in rows}):
        rs = [r for r in rows if r["seed"] == seed]
        by_dir = _decoded(base, rs, out / f"{base}-s{seed}-decoded.json", [], f"decode seed {seed}")
        mt = _mt_decoded(base, rs, out, seed, mt_bench, mt_tokens) if mt_bench else {}
        for r in rs:
            res = by_dir[str(Path(r["run"]) / "export")]
            r |= {"tau": res["tau_per_step"], "tau_per_response": res["acceptance_length"],
                  "per_prompt": res["per_prompt"], "lossless": res["lossless"],
                  "per_position": res["per_position_acceptance"],
                  "positions": _positions(res["per_prompt_steps"])}
            if mt:
                m = mt[str(Path(r["run"]) / "export")]  # one set, unwrapped by _mt_decoded
                r["mt"] = {"tau": m["tau_per_step"], "per_prompt": m["per_prompt"], "lossless": m["lossless"],
                           "per_position": m["per_position_acceptance"], "positions": _positions(m["per_prompt_steps"])}


MT_CHUNK = 40  # MT-Bench prompts per `dflash eval`: a chunk decoded once is kept when N grows


def _mt_decoded(base: str, rs: list[dict], out: Path, seed: int, n: int, tokens: int) -> dict:
    """Our decoder on the first ``n`` MT-Bench prompts (both turns), by export dir: decoded
    ``MT_CHUNK`` prompts at a time, each chunk cached in its own file (the first 40 as
    ``--bench mt-bench --prompts 40``, later ones as ``--prompts-from`` a copy of their
    records), then merged into one result as if decoded at once."""
    from dflash.data.prompt_sets import bench_file

    parts, recs = [], None
    for lo in range(0, n, MT_CHUNK):
        hi = min(n, lo + MT_CHUNK)
        if lo == 0:
            path, flags = out / f"{base}-s{seed}-mt{hi}x{tokens}.json", ["--bench", "mt-bench", "--prompts", str(hi)]
        else:
            src = out / f"mt-bench-{lo + 1}-{hi}.jsonl"
            recs = recs or [ln for ln in bench_file("mt-bench").read_text(encoding="utf-8").splitlines() if ln.strip()]
            src.write_text("\n".join(recs[lo:hi]) + "\n", encoding="utf-8")
            path, flags = out / f"{base}-s{seed}-mt{lo + 1}-{hi}x{tokens}.json", ["--prompts-from", str(src)]
        got = _decoded(base, rs, path, [*flags, "--max-new-tokens", str(tokens)], f"MT-Bench {lo + 1}-{hi} seed {seed}")
        parts.append({d: (next(iter(m["sets"].values())) if "sets" in m else m) for d, m in got.items()})
    return {d: merge_decoded([p[d] for p in parts]) for d in parts[0]}


def merge_decoded(parts: list[dict]) -> dict:
    """Decoded results on consecutive prompt chunks -> the result on all of them: prompts and
    their steps in order, tau per verify step and per-position acceptance pooled over every
    step (accepted + 1 per step in ``acceptance_lengths``), lossless only if every chunk was."""
    if len(parts) == 1:
        return parts[0]
    steps = [s for p in parts for s in p["per_prompt_steps"]]
    lengths = [a for s in steps for a in s["acceptance_lengths"]]
    k = max(len(p["per_position_acceptance"]) for p in parts)
    n = max(1, len(lengths))
    return {"per_prompt": [t for p in parts for t in p["per_prompt"]], "per_prompt_steps": steps,
            "lossless": all(p["lossless"] for p in parts), "tau_per_step": round(sum(lengths) / n, 4),
            "per_position_acceptance": [round(sum(a - 1 >= j for a in lengths) / n, 4) for j in range(1, k + 1)]}


def engine_verdict(rows: list[dict], base: str, out: Path) -> str | None:
    """One `dflash eval --engine vllm` over the servable arms' exports (the same held-out
    prompts): our decoder and vLLM side by side, beside vLLM's ngram and no speculation.
    Returns its printed tables (its JSON goes to OUT/BASE-engine.json)."""
    servable = [r for r in rows if r["arm"] == "dflash" or r["arm"].startswith("sliding")]
    if not servable:
        return None
    path, text = out / f"{base}-engine.json", out / f"{base}-engine.txt"
    if not path.is_file():
        lines = eval_exports(base, servable, ["--engine", "vllm", "--engine-no-batched"], "engine")
        path.write_text(lines[-1])
        text.write_text("\n".join(ln for ln in lines if not ln.startswith("{")))
    return text.read_text()


def table(title: str, rows: list[dict], names: list[str]) -> None:
    print(f"\n{title}  (train s, s/step: the run's own, as loaded as the machine was then)")
    print(f"{'arm':16} {'steps':>5} {'train s':>7} {'s/step':>6} {'tau/step walked':>15} {'decoded ± SE':>15} "
          f"{'vs first (paired)':>18}  lossless  per seed (decoded, else walked)")
    first = {r["seed"]: r["per_prompt"] for r in rows if r["arm"] == names[0] and r["per_prompt"]}
    for name in names:
        rs = [r for r in rows if r["arm"] == name]
        if not rs:
            continue
        ests = [r["estimate"] for r in rs if r["estimate"] is not None]
        taus = [r["tau"] for r in rs if r["tau"] is not None]
        # per (seed, prompt): a seed draws its own data split, so prompts pair only within a seed
        pp = [t for r in rs if r["per_prompt"] for t in r["per_prompt"]]
        decoded, diff = "-", ""
        if taus:
            decoded = f"{statistics.mean(taus):.3f} ± {se(pp) if pp else 0.0:.3f}"
        d = [b - a for r in rs if r["per_prompt"] and r["seed"] in first
             for a, b in zip(first[r["seed"]], r["per_prompt"])]
        if name != names[0] and d:
            diff = f"{statistics.mean(d):+.3f} ± {se(d):.3f}"
        wall = statistics.mean(r["wall_s"] for r in rs)
        lossless = all(r["lossless"] for r in rs) if all(r["lossless"] is not None for r in rs) else "-"
        pos = " ".join(f"{r['tau'] if r['tau'] is not None else r['estimate']:.3f}" for r in rs)
        print(f"{name:16} {rs[0]['steps']:5d} {wall:7.0f} {wall / rs[0]['steps']:6.3f} "
              f"{(f'{statistics.mean(ests):.4f}' if ests else '-'):>15} {decoded:>15} {diff:>18}  {lossless!s:8}  {pos}")


def scored(title: str, rows: list[dict], names: list[str], key: str | None) -> None:
    """Decoded tau per verify step and acceptance at positions 1-3 (the share of verify steps
    that accepted at least j drafts) on one prompt set, each arm against the first, paired
    prompt by prompt within each seed (mean difference ± its SE over the (seed, prompt) pairs)."""
    def get(r):
        return r.get(key) if key else r
    ok = [r for r in rows if get(r) and get(r).get("positions")]
    if not ok:
        return
    print(f"\n{title}: decoded tau (each prompt's per verify step, then the mean over prompts) and acceptance at "
          f"positions 1-3, each ± SE over (seed, prompt); 'vs' is paired against {names[0]}")
    print(f"{'arm':16} {'tau':>14} {'vs':>15} {'pos 1':>14} {'pos 2':>14} {'vs':>15} {'pos 3':>14} {'vs':>15}  lossless")
    first = {r["seed"]: get(r) for r in ok if r["arm"] == names[0]}
    for name in names:
        rs = [r for r in ok if r["arm"] == name]
        if not rs:
            continue
        taus = [t for r in rs for t in get(r)["per_prompt"]]
        pos = [[p[j] for r in rs for p in get(r)["positions"]] for j in range(3)]

        def paired(vals):
            if name == names[0]:
                return ""
            d = [b - a for r in rs if r["seed"] in first for a, b in zip(vals(first[r["seed"]]), vals(get(r)))]
            return f"{statistics.mean(d):+.3f} ± {se(d):.3f}" if d else ""
        cell = lambda xs: f"{statistics.mean(xs):.3f} ± {se(xs):.3f}"  # noqa: E731
        lossless = all(get(r)["lossless"] for r in rs)
        print(f"{name:16} {cell(taus):>14} {paired(lambda g: g['per_prompt']):>15} {cell(pos[0]):>14} "
              f"{cell(pos[1]):>14} {paired(lambda g: [p[1] for p in g['positions']]):>15} {cell(pos[2]):>14} "
              f"{paired(lambda g: [p[2] for p in g['positions']]):>15}  {lossless}")


def steady_s_per_step(run: Path, queue: int = 4) -> tuple[float, int]:
    """(seconds per step, steps counted) after the target's last forward: from the run's own
    spans, each model_forward saying where its features came from (`features`: forward, cache).
    Until every training sequence has been seen once a step may wait on the target's forward,
    which `train.feature_cache` then spares (regeneration spares it from the first step when it
    kept this layer set's features, as a fresh run does); the steps after it are the price of a
    step for the rest of the run. ``queue``: the batches a target worker runs ahead."""
    from dflash.analysis.stalls import load_run

    spans = load_run(run)
    source = [(s["attributes"]["step"], s["attributes"].get("features")) for s in spans if s["name"] == "model_forward"]
    fwd = [k for k, f in source if f == "forward"]
    ends = sorted((s["attributes"]["step"], s["end_ns"]) for s in spans if s["name"] == "optimizer_step")
    # no cache in use (every step a forward): that is the steady state, past the pipeline's fill
    first = (max(fwd) if fwd and any(f == "cache" for _, f in source) else 0) + queue + 1
    steady = [(k, t) for k, t in ends if k >= first]
    if len(steady) < 21:
        sys.exit(f"bench/architectures.py: {run}: {len(steady)} steps after the target's last forward (step "
                 f"{max(fwd) if fwd else '-'}): raise --time-steps")
    return (steady[-1][1] - steady[0][1]) / 1e9 / (steady[-1][0] - steady[0][0]), len(steady) - 1


def step_times(base: str, names: list[str], all_arms: dict, steps: int, rounds: int, out: Path) -> dict:
    """Seconds per training step of each arm, timed apart from the long runs: `steps` steps,
    `rounds` rounds with the arms interleaved (A B C, A B C) so a change in the machine's load
    falls on all of them; the median over rounds. No estimate, no checkpoint in between.
    Two prices per arm: "whole" (the run's wall / its steps, first epoch included, with
    whatever features the regeneration cache held for the arm's layers) and "steady" (after the
    target's last forward: `steady_s_per_step`), which equal time uses."""
    per: dict[str, dict[str, list[float]]] = {n: {"whole": [], "steady": []} for n in names}
    for r in range(rounds):
        for n in names:
            run = out / "timing" / f"{base}-{n}-r{r}-t"  # -t: with telemetry (older timing dirs had none)
            summary = run / "summary.json"
            if not summary.is_file():
                cmd = [sys.executable, "-m", "dflash", "train", *BASES[base]["args"], *all_arms[n], "--overwrite",
                       "--set", f"out={run}", "--set", f"train.steps={steps}",
                       "--set", "train.estimate_every=0", "--set", "eval.engine=none"]
                print(f"[timing {n} round {r}] {steps} steps", file=sys.stderr, flush=True)
                run.parent.mkdir(parents=True, exist_ok=True)
                with open(run.parent / f"{run.name}.log", "w") as f:
                    if subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
                        sys.exit(f"bench/architectures.py: {' '.join(cmd)} failed: {run.parent / (run.name + '.log')}")
            s = json.loads(summary.read_text())
            per[n]["whole"].append(s["wall_s"] / s["steps"])
            per[n]["steady"].append(steady_s_per_step(run)[0])
    return {n: {k: statistics.median(v) for k, v in d.items()} for n, d in per.items()}


def equal_time(rows: list[dict], names: list[str], per_step: dict | None) -> None:
    """Each arm at the first arm's training time: its walked estimate (equal to decoding per
    verify step) read off its learning curve at the steps that time buys at its s/step
    (`per_step`: timed side by side; else the long runs' own, which a changing load skews)."""
    def sps(name):
        if per_step:
            return per_step[name]["steady"]
        return statistics.mean(r["wall_s"] / r["steps"] for r in rows if r["arm"] == name)
    t0 = sps(names[0]) * rows[0]["steps"]
    how = "timed side by side, steady state" if per_step else "from the long runs: load-skewed"
    print(f"\nequal training time ({t0:.0f} s, the {names[0]} arm's {rows[0]['steps']} steps; s/step {how}): "
          "the walked estimate at the steps it buys")
    for name in names[1:]:
        rs = [r for r in rows if r["arm"] == name]
        if not rs:
            continue
        per = sps(name)
        k = t0 / per
        vals = [at_step(r["estimate_history"], k) for r in rs]
        got = [v for v in vals if v is not None]
        why = ("past its last step (cheaper per step: its equal-steps figure is a floor)" if k >= rs[0]["steps"]
               else "no learning-curve points around that step (train.estimate_every)")
        print(f"{name:16} {k:6.0f} steps ({per:.3f} s/step)  " + (f"{statistics.mean(got):.4f}" if got else why))


MT_BENCH_PROMPTS = 80  # the set's dialogs


def checked_args(a, all_arms: dict) -> tuple[list[str], list[int], Path]:
    """(arm names, seeds, the output dir made absolute: `dflash train` runs from the repo root)
    from the arguments, or one line and exit 2 before any arm trains."""
    def bad(msg: str):
        print(f"bench/architectures.py: {msg}", file=sys.stderr)
        sys.exit(2)
    names = [n.strip() for n in (a.arms.split(",") if a.arms else all_arms) if n.strip()]
    if not names:
        bad(f"--arms {a.arms!r}: expected a comma list of {', '.join(all_arms)}")
    unknown = [n for n in names if n not in all_arms]
    if unknown:
        bad(f"--arms {','.join(unknown)}: expected some of {', '.join(all_arms)}")
    try:
        seeds = [int(x) for x in a.seeds.split(",") if x.strip()]
    except ValueError:
        seeds = []
    if not seeds or min(seeds) < 0:
        bad(f"--seeds {a.seeds!r}: expected a comma list of integers >= 0, e.g. 0,1,2")
    for flag, v, lo, hi in (("--steps", a.steps, 0, 10**6), ("--mt-bench", a.mt_bench, 0, MT_BENCH_PROMPTS),
                            ("--mt-tokens", a.mt_tokens, 1, 4096), ("--time-steps", a.time_steps, 0, 10**6)):
        if not lo <= v <= hi:
            bad(f"{flag} {v}: expected an integer in {lo}..{hi}")
    if a.mt_bench and not a.decode:
        bad(f"--mt-bench {a.mt_bench} without --decode: the MT-Bench score is decoded; add --decode")
    out = Path(a.out).expanduser().resolve()
    if out.exists() and not out.is_dir():
        bad(f"--out {a.out}: not a directory")
    return names, seeds, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", choices=sorted(BASES), default="demo")
    ap.add_argument("--arms", default="", help="comma list (default: every arm the base has)")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--steps", type=int, default=0, help="default: the base's")
    ap.add_argument("--decode", action="store_true",
                    help="then one `dflash eval` over every arm's export (our decoder on the held-out prompts, the "
                         "lossless check, per-prompt SE); without it the walked estimate, which equals decoding")
    ap.add_argument("--engine", action="store_true", help="then vLLM-CPU's verdict on the servable arms")
    ap.add_argument("--mt-bench", type=int, default=0, metavar="N",
                    help="with --decode: also score every export on the first N MT-Bench prompts (80: all), decoded 40 at a "
                         "time (each 40 cached: raising N decodes only the new ones)")
    ap.add_argument("--mt-tokens", type=int, default=48, metavar="T",
                    help="new tokens per MT-Bench prompt (default %(default)s: 40 prompts x 4 arms took 15-18 min a seed "
                         "on 2 cores)")
    ap.add_argument("--time-steps", type=int, default=0,
                    help="time each arm's steps apart: this many steps, 2 interleaved rounds (for equal time: the steps "
                         "after the target's last forward, read off the run's spans; the demo's first epoch is ~70 "
                         "steps: 200 leaves ~120)")
    ap.add_argument("--out", default="/tmp/dflash-bench-arch")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    all_arms = {k: v for k, v in arms(a.base).items() if v is not None}
    names, seeds, out = checked_args(a, all_arms)
    steps = a.steps or BASES[a.base]["steps"]
    rows = [train(a.base, n, all_arms[n], s, steps, out) for s in seeds for n in names]
    if a.decode:
        decode_side_by_side(rows, a.base, out, a.mt_bench, a.mt_tokens)
    table(f"equal steps ({steps}), base {a.base}, seeds {a.seeds}; tau per verify step", rows, names)
    scored("held-out ShareGPT prompts", rows, names, None)
    scored(f"MT-Bench, first {a.mt_bench} prompts, {a.mt_tokens} new tokens", rows, names, "mt")
    per_step = step_times(a.base, names, all_arms, a.time_steps, 2, out) if a.time_steps else None
    if per_step:
        print("\ns/step, timed side by side (median of 2 interleaved rounds of "
              f"{a.time_steps} steps): steady (after the target's last forward) / whole run: "
              + ", ".join(f"{n} {v['steady']:.3f} / {v['whole']:.3f}" for n, v in per_step.items()))
    equal_time(rows, names, per_step)
    verdict = engine_verdict([r for r in rows if r["seed"] == seeds[0]], a.base, out) if a.engine else None
    if verdict:
        print(f"\nvLLM-CPU and our decoder on the servable arms (concurrency 1, the same held-out prompts):\n{verdict}")
    print(json.dumps({"base": a.base, "steps": steps, "seeds": seeds, "rows": rows, "s_per_step": per_step}))


if __name__ == "__main__":
    main()

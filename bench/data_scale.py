"""The data curve on this machine (issue 47): which use of the CPU's minutes buys the most tau.

Arms (each a real `dflash capture` + `dflash train --features`, subprocesses one after another):
  regen       the target's own replies (regenerated, greedy), CE; few samples, many epochs or
              more samples, fewer epochs (the epochs are a cell's second coordinate)
  read        ShareGPT's own replies, read by the target: KL to its top-64 distribution at every
              position (`train.loss=kl`), captured once (features + top-k) and reused over epochs
  read+regen  a `read` drafter (`--init-from`), then trained on regenerated replies

Data. One pool of ShareGPT conversations in a fixed order (`pool.jsonl`), with every
conversation that repeats a scored prompt left out; a size-N arm trains on the first N
samples of one capture of the pool's first conversations (`data.max_samples`), so the sizes
are nested, and regeneration's cache (one reply per prompt) serves every size at once.

Scored on fixed prompts, the same for every cell: the 16 ShareGPT prompts `make demo` held out
until 2026-12-08 (its split of 304 conversations, pinned here so the tables stay reproducible;
the demo holds out 64 of 352 since) and MT-Bench's 80 first turns, cut to 64 tokens, 96 new tokens, T=0.
tau is per verify step (engines' convention), walked from one drafter pass over the target's
greedy continuation (run/acceptance_estimate.py: equal to decoding up to near-ties), per
prompt, so arms compare prompt by prompt (paired differences +- their SE over prompts).

Cost. Every child's wall time and CPU time (user + sys, the process tree) are recorded. The
machine may be shared while the curve runs (tau does not depend on it: training on the CPU is
deterministic), so the time axis is the CPU seconds each part took, divided by the 2 cores;
`--calibrate` times each unit (a reply regenerated, a sample read, a training step of each
arm) alone on a quiet machine and the table says which it uses.

    .venv/bin/python bench/data_scale.py prep                       # pool + scored prompts (~2 min)
    .venv/bin/python bench/data_scale.py capture --arm regen --n 5000
    .venv/bin/python bench/data_scale.py train --cells regen:300x8,regen:1500x8,read:1500x8
    .venv/bin/python bench/data_scale.py walk                       # every trained cell not walked yet
    .venv/bin/python bench/data_scale.py table                      # docs/demo-recipe.md's table

Everything lives under --work (default runs/data-scale) and is reused: a stopped bench resumes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BASE = ["--config", "configs/demo.yaml", "--set", "telemetry.console_interval_s=0", "--set", "eval.engine=none",
        "--set", "train.estimate_every=0"]
ARM_SETS = {"regen": ["--set", "data.regenerate=on"],
            "read": ["--set", "data.regenerate=off", "--set", "data.long_samples=split", "--set", "train.loss=kl",
                     "--set", "train.kl_topk=64"]}
POOL = 24000          # conversations in the pool (the largest arm's)
HELD = 8              # what a capture's split holds out of the pool (its minimum): never scored here
SETS = ("sharegpt16", "mtbench80")


THREADS = os.environ.get("DATA_SCALE_THREADS", "1")
# The bench's own cache (regenerated replies, the converted target): replies made with one
# thread may differ from two threads' at near-ties, and `make demo` must not read them.
CACHE = os.environ.get("DATA_SCALE_CACHE", str(Path.home() / ".cache" / "dflash-data-scale"))


def child_env() -> dict:
    """One compute thread per child (DATA_SCALE_THREADS): on a shared machine two threads of one
    process wait on each other at every parallel region (a decode step is hundreds of small
    ones), which cost ~10x the CPU seconds here; with one, a child's CPU time is its work, so
    the curve's time axis (core-seconds) holds whatever else runs."""
    return dict(os.environ, OMP_NUM_THREADS=THREADS, MKL_NUM_THREADS=THREADS, DFLASH_CACHE=CACHE)


def run(cmd: list[str], log: Path) -> dict:
    """A child to the end, its output to ``log``; wall and CPU seconds (its whole tree)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    print(f"[{time.strftime('%H:%M:%S')}] {' '.join(cmd[2:])}  (log: {log})", file=sys.stderr, flush=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=child_env()).returncode
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc != 0:
        sys.exit(f"bench/data_scale.py: exited {rc}: {' '.join(cmd)}\n{log.read_text()[-3000:]}")
    return {"wall_s": round(time.monotonic() - t0, 1),
            "cpu_s": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 1),
            "load_avg": round(os.getloadavg()[0], 2), "threads": int(THREADS)}


def dflash(*args) -> list[str]:
    return [sys.executable, "-m", "dflash", *map(str, args)]


# --------------------------------------------------------------------------- prep


def prep(work: Path) -> None:
    """pool.jsonl and the scored prompt sets, once."""
    from dflash.config import load_config
    from dflash.data import prompt_sets
    from dflash.data.conversations import load_conversations
    from dflash.prep.prepare import split

    work.mkdir(parents=True, exist_ok=True)
    demo = load_config(str(ROOT / "configs/demo.yaml"))
    # the split these tables were scored on (the demo's until 2026-12-08): 16 of 304 conversations
    demo.data = dataclasses.replace(demo.data, num_conversations=304, eval_fraction=0.0525)
    _, held = split(demo)
    sharegpt = prompt_sets.first_turns(held)
    prompt_sets.write_jsonl(sharegpt, work / "sharegpt16.jsonl")
    mt = prompt_sets.read_bench("mt-bench")
    mt_first = [prompt_sets.Dialog(d.id, d.turns[:1], d.system) for d in mt.dialogs]
    prompt_sets.write_jsonl(mt_first, work / "mtbench80.jsonl")
    scored = {prompt_sets.prompt_identity(t) for d in sharegpt + mt.dialogs for t in d.turns}
    convs = load_conversations(None, limit=POOL + 2000, seed=1234)
    kept = [c for c in convs if scored.isdisjoint(prompt_sets.user_turn_keys(c))][:POOL]
    with open(work / "pool.jsonl", "w", encoding="utf-8") as f:
        for c in kept:
            f.write(json.dumps({"conversations": c}, ensure_ascii=False) + "\n")
    (work / "prep.json").write_text(json.dumps({"pool": len(kept), "sharegpt16": len(sharegpt),
                                                "mtbench80": len(mt_first)}, indent=1))
    print(f"pool: {len(kept)} conversations; scored: {len(sharegpt)} ShareGPT + {len(mt_first)} MT-Bench",
          file=sys.stderr)


# --------------------------------------------------------------------------- capture


def capture(work: Path, arm: str, n: int, max_samples: int = 0) -> dict:
    """The target's features (and for `read` its top-64) of the pool's first n + HELD
    conversations' samples (the first max_samples of them); timed. Reused when already there."""
    name = f"{arm}-{n}" + (f"-m{max_samples}" if max_samples else "")
    out = work / "feats" / name
    meta = out.with_suffix(".json")
    if meta.is_file():
        return json.loads(meta.read_text())
    cmd = dflash("capture", *BASE, *ARM_SETS[arm], "--set", f"data.path={work / 'pool.jsonl'}",
                 "--set", f"data.num_conversations={n + HELD}", "--set", "data.eval_fraction=0.0001",
                 "--set", f"data.max_samples={max_samples}", "--out", out, "--overwrite")
    t = run(cmd, work / "logs" / f"capture-{name}.log")
    index = json.loads((out / "index.json").read_text())
    log = (work / "logs" / f"capture-{name}.log").read_text()
    regen = next((ln for ln in log.splitlines() if "regenerat" in ln.lower()), "")
    res = {"arm": arm, "name": name, "n": n, "samples": index["samples"], "tokens": index["tokens"], "bytes": index["bytes"],
           "seconds": index["seconds"], **t, "regen_line": regen}
    meta.write_text(json.dumps(res, indent=1))
    return res


# --------------------------------------------------------------------------- train


def cell_name(spec: str) -> str:
    """A file-system name for a cell (no dots: the results sit beside the run dir as NAME.json)."""
    return spec.replace(":", "_").replace("=", "-").replace(".", "p").replace("+", "-")


ARMS = ("regen", "read", "read+regen")
BATCH = 4  # configs/demo.yaml's train.batch_size: a cell's steps are E * N / BATCH


class BadArgument(ValueError):
    """One line for the user (exit 2), raised before any stage starts."""


def cell_steps(n: int, epochs: float) -> int:
    return round(epochs * n / BATCH)


def parse_cell(spec: str) -> dict:
    """ARM:NxE[:from=CELL][:seed=S]: arm, samples, epochs (steps = E * N / batch 4). A spec
    that is not one (an unknown arm or option, N or E not numbers, no training step at all)
    raises BadArgument naming it."""
    form = "expected ARM:NxE[:from=CELL][:seed=S] (ARM regen, read or read+regen; N samples >= 1, E epochs > 0)"
    parts = spec.split(":")
    if len(parts) < 2 or parts[0] not in ARMS or parts[1].count("x") != 1:
        raise BadArgument(f"cell {spec!r}: {form}")
    arm, (n, e) = parts[0], parts[1].split("x")
    try:
        n, e = int(n), float(e)
    except ValueError:
        raise BadArgument(f"cell {spec!r}: {form}") from None
    if n < 1 or not (math.isfinite(e) and e > 0):
        raise BadArgument(f"cell {spec!r}: {form}")
    if cell_steps(n, e) < 1:  # never a silent 1-step run in its place
        raise BadArgument(f"cell {spec!r}: {e:g} epochs of {n} samples is {e * n / BATCH:g} steps of batch "
                          f"{BATCH}; expected at least 1")
    cell = {"name": cell_name(spec), "arm": arm, "n": n, "epochs": e, "seed": 0, "init": None}
    opts: list[list[str]] = []
    for p in parts[2:]:  # from=ARM:NxE holds a colon of its own
        if "=" in p:
            opts.append(p.split("=", 1))
        elif opts:
            opts[-1][1] += ":" + p
        else:
            raise BadArgument(f"cell {spec!r}: {form}")
    for k, v in opts:
        if k == "seed":
            if not v.isdigit():
                raise BadArgument(f"cell {spec!r}: seed={v!r}: expected an integer >= 0")
            cell["seed"] = int(v)
        elif k == "from":
            try:
                parse_cell(v)
            except BadArgument:
                raise BadArgument(f"cell {spec!r}: from={v!r}: {form}") from None
            cell["init"] = cell_name(v)
        else:
            raise BadArgument(f"cell {spec!r}: unknown option {k!r}; {form}")
    return cell


def train(work: Path, spec: str, captures: dict) -> dict:
    c = parse_cell(spec)
    data_arm = "regen" if c["arm"] in ("regen", "read+regen") else "read"
    feats = work / "feats" / captures[data_arm]
    if not (feats / "index.json").is_file():
        sys.exit(f"bench/data_scale.py: no capture {feats}: run `capture --arm {data_arm} ...` first")
    run_dir = work / "runs" / c["name"]
    res_file = run_dir.with_suffix(".json")
    if res_file.is_file():
        return json.loads(res_file.read_text())
    steps = cell_steps(c["n"], c["epochs"])  # >= 1: parse_cell refuses less
    extra = list(ARM_SETS[data_arm])
    if c["init"]:
        init = work / "runs" / c["init"] / "checkpoint"
        if not init.is_dir():
            sys.exit(f"bench/data_scale.py: {spec}: train {c['init']} first")
        extra += ["--init-from", init]
    cmd = dflash("train", *BASE, *extra, "--features", feats, "--set", f"data.max_samples={c['n']}",
                 "--set", f"train.steps={steps}", "--set", f"train.seed={c['seed']}", "--no-telemetry",
                 "--set", "eval.baseline=none", "--out", run_dir, "--overwrite")
    t = run(cmd, work / "logs" / f"train-{c['name']}.log")
    summ = json.loads((run_dir / "summary.json").read_text())
    res = {**c, "spec": spec, "steps": steps, "features": str(feats), **t,
           "loss_first": summ.get("loss_first"), "loss_last": summ.get("loss_last"),
           "train_samples": summ.get("train_samples"), "tokens": summ.get("tokens"),
           "tokens_per_s": summ.get("tokens_per_s")}
    res_file.write_text(json.dumps(res, indent=1))
    return res


# --------------------------------------------------------------------------- walk


class Walker:
    """The scored prompts' rows (prompt + the target's greedy continuation, features) built once
    per set, then any number of drafters walked over them per prompt."""

    def __init__(self, work: Path):
        import torch

        from dflash.config import load_config
        from dflash.model import target as T
        from dflash.run import acceptance_estimate as est

        self.torch, self.est = torch, est
        torch.set_num_threads(int(THREADS))  # as the children (child_env)
        os.environ["DFLASH_CACHE"] = CACHE
        self.cfg = cfg = load_config(str(ROOT / "configs/demo.yaml"))
        self.target, self.tok = T.load_target(cfg.model.target, dtype=torch.float32)
        L = T.num_layers(self.target)
        self.layer_ids = cfg.model.target_layer_ids or T.default_layer_ids(L, cfg.model.num_target_layers)
        self.embed, self.head = self.target.get_input_embeddings(), self.target.get_output_embeddings()
        self.rows = {s: self._rows(work, s) for s in SETS}

    def _rows(self, work: Path, name: str):
        """The set's WalkRows, its token rows cached as JSON (the continuation is the slow part)."""
        from dflash.data import prompt_sets
        from dflash.data.dataset import collate
        from dflash.data.sample import Sample

        cache = work / f"rows-{name}.json"
        if cache.is_file():
            d = json.loads(cache.read_text())
            rows = [Sample(ids, mask) for ids, mask in zip(d["ids"], d["mask"])]
            return self.est.WalkRows(collate(rows, self.tok.pad_token_id, 0), d["start"], d["stop"], d["source"])
        ps = prompt_sets.read_file(str(work / f"{name}.jsonl"))
        convs = [([{"role": "system", "content": d.system}] if d.system else []) +
                 [{"role": "user", "content": d.turns[0]}] for d in ps.dialogs]
        e = self.cfg.eval
        rows = self.est.eval_prompt_rows(self.target, self.tok, convs, n=len(convs), max_prompt_len=e.max_prompt_len,
                                         max_new_tokens=e.max_new_tokens, block_size=self.cfg.model.block_size,
                                         pad_id=self.tok.pad_token_id, batch_size=64)
        b = rows.batch
        ids = [b.input_ids[i, :n].tolist() for i, n in enumerate(b.lengths)]
        mask = [b.loss_mask[i, :n].tolist() for i, n in enumerate(b.lengths)]
        cache.write_text(json.dumps({"ids": ids, "mask": mask, "start": rows.start, "stop": rows.stop,
                                    "source": rows.source}))
        return rows

    def walk(self, ckpt: Path) -> dict:
        """Per set: tau per verify step pooled, and per prompt (accepted + 1 summed, steps)."""
        from types import SimpleNamespace

        from dflash.checkpoint import drafter_dirs

        torch = self.torch
        drafter = drafter_dirs.load(drafter_dirs.inspect(ckpt)).eval()
        side = SimpleNamespace(drafter=drafter, device=torch.device("cpu"), embed=self.embed, lm_head=self.head)
        out = {}
        for name, rows in self.rows.items():
            if name not in self.__dict__.setdefault("_est", {}):
                self._est[name] = self.est.AcceptanceEstimate(side, self.target, rows, layer_ids=self.layer_ids,
                                                              feature_store=None, every=1)
            e = self._est[name]
            e.train_step = side
            with torch.no_grad():
                acc, _ = e._accepted(drafter)
                steps = self.est.walk(acc, e.limit)
            gained = ((acc + 1) * steps).sum(1).tolist()
            n = steps.sum(1).tolist()
            out[name] = {"tau": round(sum(gained) / max(1, sum(n)), 4), "gained": gained, "steps": n}
        return out


def cell_results(work: Path) -> list[Path]:
    return sorted(p for p in (work / "runs").glob("*.json") if not p.name.endswith(".walk.json"))


def walk_all(work: Path) -> None:
    walker = None
    for res_file in cell_results(work):
        w = res_file.with_suffix(".walk.json")
        if w.is_file():
            continue
        walker = walker or Walker(work)
        t0 = time.monotonic()
        figs = walker.walk(res_file.with_suffix("") / "checkpoint")
        figs["walk_s"] = round(time.monotonic() - t0, 1)
        w.write_text(json.dumps(figs))
        print(f"{res_file.stem}: " + "  ".join(f"{s} {figs[s]['tau']:.4f}" for s in SETS), file=sys.stderr)


# --------------------------------------------------------------------------- table


def paired(a: dict, b: dict) -> tuple[float, float]:
    """Mean per-prompt difference of tau (a - b) and its SE over prompts."""
    ta = [g / max(1, n) for g, n in zip(a["gained"], a["steps"])]
    tb = [g / max(1, n) for g, n in zip(b["gained"], b["steps"])]
    d = [x - y for x, y in zip(ta, tb)]
    return statistics.fmean(d), (statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan"))


def table(work: Path, base: str | None) -> None:
    caps = {}
    for m in (work / "feats").glob("*.json"):
        c = json.loads(m.read_text())
        caps[str(work / "feats" / c.get("name", f"{c['arm']}-{c['n']}"))] = c
    calib = work / "calibration.json"
    unit = None
    if calib.is_file():  # the quiet machine's costs, at the product's 2 threads (else: the curve's own, contended)
        c = json.loads(calib.read_text())
        unit = c.get("threads_2") or next(iter(c.values()))
    cells = []
    for res_file in cell_results(work):
        r = json.loads(res_file.read_text())
        w = res_file.with_suffix(".walk.json")
        if not w.is_file():
            continue
        r["walk"] = json.loads(w.read_text())
        def data_cost(cell):  # core-seconds of the cell's samples
            if unit is not None:  # calibrated: a reply regenerated (features kept) or a window read
                per = unit["regen_reply" if cell["arm"] != "read" else "read_sample"]
                return per["s_per_unit"] * 2 * cell["n"]
            cap = caps.get(cell["features"])
            return cap["cpu_s"] / cap["samples"] * cell["n"] if cap else float("nan")

        def train_cost(cell):
            if unit is not None and f"train_step_{cell['arm'].split('+')[-1]}" in unit:
                return unit[f"train_step_{cell['arm'].split('+')[-1]}"]["s_per_unit"] * 2 * cell["steps"]
            return cell["cpu_s"]
        r["data_cpu_s"], r["train_cpu_s"] = data_cost(r), train_cost(r)
        if r["init"]:  # read+regen: the read cell it started from is part of its cost
            src = json.loads((work / "runs" / f"{r['init']}.json").read_text())
            r["data_cpu_s"] += data_cost(src)
            r["train_cpu_s"] += train_cost(src)
        r["minutes"] = (r["data_cpu_s"] + r["train_cpu_s"]) / 2 / 60  # 2 cores
        cells.append(r)
    cells.sort(key=lambda r: (r["arm"], r["n"], r["epochs"], r["seed"]))
    print("minutes: " + ("wall on 2 cores, from the units calibrate timed alone (calibration.json, 2 threads)"
                         if unit is not None else "the children's CPU seconds / 2 (1 thread each, a shared machine)"))
    ref = next((r for r in cells if r["name"] == base), None)
    print("| cell | samples | epochs | steps | data min | train min | minutes (2 cores) | "
          "tau ShareGPT-16 | tau MT-Bench-80 |" + (f" vs {base} (ShareGPT / MT-Bench) |" if ref else ""))
    print("|---|---|---|---|---|---|---|---|---|" + ("---|" if ref else ""))
    for r in cells:
        line = (f"| {r['spec']} | {r['n']} | {r['epochs']:g} | {r['steps']} | {r['data_cpu_s'] / 120:.1f} | "
                f"{r['train_cpu_s'] / 120:.1f} | {r['minutes']:.1f} | {r['walk']['sharegpt16']['tau']:.3f} | "
                f"{r['walk']['mtbench80']['tau']:.3f} |")
        if ref:
            if r is ref:
                line += " — |"
            else:
                d1, s1 = paired(r["walk"]["sharegpt16"], ref["walk"]["sharegpt16"])
                d2, s2 = paired(r["walk"]["mtbench80"], ref["walk"]["mtbench80"])
                line += f" {d1:+.3f} ± {s1:.3f} / {d2:+.3f} ± {s2:.3f} |"
        print(line)
    print(json.dumps({"cells": [{k: r[k] for k in ("spec", "n", "epochs", "steps", "minutes", "wall_s", "cpu_s")}
                                | {s: r["walk"][s]["tau"] for s in SETS} for r in cells]}))


# --------------------------------------------------------------------------- calibrate


def regen_unit(work: Path, spare: Path, t: int) -> dict:
    """A reply regenerated (features kept), on regeneration's own clock: its "regenerated N
    (cached 0) of K replies in S s" line (the replies alone, no load), from an empty cache of
    its own, on ~4 batches of the demo's regen_batch_size (an even number: with 2 workers none
    waits alone at the end). (Differencing a small and a large
    run, as the other units do, undercounted it 2.2x: the two runs shared one cache, and a
    16-row batch costs far more than a quarter of a 64-row one.)"""
    import shutil
    import tempfile

    global CACHE
    fresh = str(work / f"calib-cache-t{t}")
    shutil.rmtree(fresh, ignore_errors=True)
    CACHE, keep = fresh, CACHE
    tmp = Path(tempfile.mkdtemp(prefix="calib-"))
    try:
        log = work / "logs" / f"calib-regen-t{t}.log"
        r = run(dflash("train", *BASE, *ARM_SETS["regen"], "--set", f"data.path={spare}",
                       "--set", "data.num_conversations=264", "--set", "data.eval_fraction=0.0001",
                       "--set", "train.steps=0", "--no-telemetry", "--out", tmp / "out"), log)
        line = next(ln for ln in log.read_text().splitlines() if ln.startswith("regenerated "))
        made, secs = int(line.split()[1]), float(line.split(" in ")[1].split()[0])
        return {"units": made, "s_per_unit": round(secs / made, 4),
                "cpu_s_per_unit": round(r["cpu_s"] * secs / r["wall_s"] / made, 4), "line": line}
    finally:
        CACHE = keep
        shutil.rmtree(fresh, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def calibrate(work: Path, threads: list[int], units: set[str]) -> dict:
    """Each unit's marginal cost, timed alone (stop anything else first): a reply regenerated
    (regeneration's own clock), a sample read (features + top-64) and a training step of each
    arm (two runs each, a small and a large one, so start-up and model loading cancel).
    Replies are regenerated into a cache of their own (nothing cached), from pool
    conversations no cell uses. ``units`` (regen, read, train): the others keep what
    calibration.json holds."""
    import shutil
    import tempfile

    global THREADS
    old = work / "calibration.json"
    res = json.loads(old.read_text()) if old.is_file() else {}
    with open(work / "pool.jsonl", encoding="utf-8") as f:  # lines end at \n only (the text holds U+2028)
        pool = [json.loads(ln) for ln in f if ln.strip()]
    spare = work / "calib-pool.jsonl"  # the pool's last conversations: past every cell's first n
    spare.write_text("".join(json.dumps(c) + "\n" for c in pool[-400:]))  # ASCII escapes: one record a line
    for t in threads:
        THREADS = str(t)
        row = res.get(f"threads_{t}", {})

        def timed(kind, args, units_of):
            walls = []
            for small in (True, False):
                tmp = Path(tempfile.mkdtemp(prefix="calib-"))
                try:
                    out = tmp / "out"
                    r = run(dflash(*args(small, out)), work / "logs" / f"calib-{kind}-t{t}-{int(small)}.log")
                    walls.append((units_of(small, out), r["wall_s"], r["cpu_s"]))
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
            (u0, w0, c0), (u1, w1, c1) = walls
            return {"units": u1 - u0, "s_per_unit": round((w1 - w0) / (u1 - u0), 4),
                    "cpu_s_per_unit": round((c1 - c0) / (u1 - u0), 4)}

        def samples(out):
            return json.loads((out / "index.json").read_text())["samples"]

        if "regen" in units:
            row["regen_reply"] = regen_unit(work, spare, t)
        if "read" in units:
            row["read_sample"] = timed("read", lambda small, out: (
                "capture", *BASE, *ARM_SETS["read"], "--set", f"data.path={spare}", "--set",
                "data.num_conversations=400", "--set", "data.eval_fraction=0.0001", "--set",
                f"data.max_samples={16 if small else 160}", "--out", out), lambda small, out: samples(out))
        for arm in ("regen", "read") if "train" in units else ():  # the arm's largest capture
            caps = sorted((p for p in (work / "feats").glob(f"{arm}-*") if (p / "index.json").is_file()),
                          key=lambda p: json.loads((p / "index.json").read_text())["samples"])
            if not caps:
                continue
            feats = caps[-1]
            row[f"train_step_{arm}"] = timed(f"train-{arm}", lambda small, out, feats=feats, arm=arm: (
                "train", *BASE, *ARM_SETS[arm], "--features", feats, "--set", "data.max_samples=1500",
                "--set", f"train.steps={20 if small else 220}", "--no-telemetry", "--set", "eval.baseline=none",
                "--out", out), lambda small, out: 20 if small else 220)
        res[f"threads_{t}"] = row
        print(json.dumps({f"threads_{t}": row}), file=sys.stderr)
    THREADS = os.environ.get("DATA_SCALE_THREADS", "1")
    (work / "calibration.json").write_text(json.dumps(res, indent=1))
    return res


UNITS = ("regen", "read", "train")


def check_args(a) -> None:
    """Every argument of the stage asked for, and that --work holds what the earlier stages
    left, before the stage starts: BadArgument (one line) otherwise."""
    work = Path(a.work)
    if a.stage == "capture":
        if a.arm is None:
            raise BadArgument(f"capture: --arm is required (one of {', '.join(ARM_SETS)})")
        if a.n is None or a.n < 1:
            raise BadArgument("capture: --n is required: conversations of the pool to capture, an integer >= 1"
                              if a.n is None else f"--n={a.n}: expected an integer >= 1")
        if a.max_samples < 0:
            raise BadArgument(f"--max-samples={a.max_samples}: expected an integer >= 0 (0: every sample)")
    elif a.stage == "train":
        specs = [s for s in a.cells.split(",") if s]
        if not specs:
            raise BadArgument("train: --cells is required: ARM:NxE[:from=CELL][:seed=S], comma-separated")
        for spec in specs:
            parse_cell(spec)
    elif a.stage == "calibrate":
        try:
            a.thread_counts = [int(t) for t in a.threads.split(",")]
        except ValueError:
            a.thread_counts = []
        if not a.thread_counts or min(a.thread_counts) < 1:
            raise BadArgument(f"--threads={a.threads!r}: expected integers >= 1, comma-separated")
        units = a.units.split(",")
        if not units or any(u not in UNITS for u in units):
            raise BadArgument(f"--units={a.units!r}: expected some of {', '.join(UNITS)}, comma-separated")
    # --work: a directory, with what the stage reads (prep makes it)
    if work.exists() and not work.is_dir():
        raise BadArgument(f"--work={a.work!r}: not a directory (expected the bench's work dir; prep makes it)")
    if a.stage == "prep":
        return
    if a.stage == "table":
        walked = {r.stem for r in cell_results(work) if r.with_suffix(".walk.json").is_file()}
        if not walked:
            raise BadArgument(f"--work={a.work!r}: no walked cell under {work / 'runs'}: run train, then walk, first")
        if a.base is not None:
            a.base = cell_name(a.base)  # a spec (regen:300x8) or its name (regen_300x8)
            if a.base not in walked:
                raise BadArgument(f"--base={a.base!r}: not a walked cell under {work / 'runs'} (expected one of "
                                  f"{', '.join(sorted(walked))})")
        return
    if a.stage == "walk" and (work / "runs").is_dir():
        return
    if a.stage == "walk" or not (work / "pool.jsonl").is_file():
        raise BadArgument(f"--work={a.work!r}: no {'runs' if a.stage == 'walk' else 'pool.jsonl'} there: run "
                          f"{'train' if a.stage == 'walk' else 'prep'} first")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=("prep", "capture", "train", "walk", "table", "calibrate"))
    p.add_argument("--threads", default="2,1", help="calibrate: threads per process to time")
    p.add_argument("--units", default="regen,read,train", help="calibrate: the units to time (the rest kept)")
    p.add_argument("--work", default=str(ROOT / "runs" / "data-scale"))
    p.add_argument("--arm", choices=tuple(ARM_SETS))
    p.add_argument("--n", type=int, help="capture: conversations of the pool to capture")
    p.add_argument("--cells", default="", help="train: ARM:NxE[:from=CELL][:seed=S], comma-separated")
    p.add_argument("--max-samples", type=int, default=0, help="capture: the first N samples only")
    p.add_argument("--regen-capture", default="regen-5000", help="train: the regen arms' capture (under feats/)")
    p.add_argument("--read-capture", default="read-5000-m5000", help="train: the read arms' capture")
    p.add_argument("--base", help="table: the cell the others are paired against")
    a = p.parse_args()
    try:
        check_args(a)
    except BadArgument as e:
        print(f"bench/data_scale.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    work = Path(a.work)
    if a.stage == "prep":
        prep(work)
    elif a.stage == "capture":
        print(json.dumps(capture(work, a.arm, a.n, a.max_samples)))
    elif a.stage == "train":
        for spec in [s for s in a.cells.split(",") if s]:
            print(json.dumps(train(work, spec, {"regen": a.regen_capture, "read": a.read_capture})))
    elif a.stage == "walk":
        walk_all(work)
    elif a.stage == "calibrate":
        print(json.dumps(calibrate(work, a.thread_counts, set(a.units.split(",")))))
    else:
        table(work, a.base)


if __name__ == "__main__":
    main()

"""`dflash eval`: acceptance length of one drafter, or of several side by side.

Every --checkpoint is either a `dflash train` checkpoint or a directory in the served DFlash
format (model/drafter_dirs.py): a published drafter, a SpecForge export, our own export.
All of them run on one target (--target, else the first training checkpoint's) and on the
same prompts, so "ours vs the published one, on our prompts" is one command. Bad input
(a missing dir, sampling settings out of range, a drafter whose shapes do not fit the
target) is one line and exit 2; everything but the drafter dirs' shapes is checked before
torch is imported.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .config import MAX_NEW_TOKENS, ConfigError, check_sampling, load_config
from .signals import stop_on_signal


def _check_args(a) -> None:
    from . import trackers
    named = trackers.parse(getattr(a, "tracker", None))
    trackers.check_installed(named)  # --wandb alone: as before, a missing wandb warns and falls back
    a.trackers = (["wandb"] if getattr(a, "wandb", False) and "wandb" not in named else []) + named
    for name, v in (("--prompts", a.prompts), ("--max-new-tokens", a.max_new_tokens)):
        if v is not None and v < 1:
            raise ConfigError(f"{name}={v}: expected an integer >= 1")
    if a.max_new_tokens is not None and a.max_new_tokens > MAX_NEW_TOKENS:
        raise ConfigError(f"--max-new-tokens={a.max_new_tokens}: expected an integer <= {MAX_NEW_TOKENS}")
    if a.temperature is not None or a.top_p is not None or a.top_k is not None:
        check_sampling(a.temperature or 0.0, 1.0 if a.top_p is None else a.top_p, a.top_k or 0)


def _plan(a):
    """The drafter dirs and the run config eval borrows (data, eval settings, target)."""
    from .model.drafter_dirs import inspect

    dirs = [inspect(p) for p in a.checkpoint]
    ours = next((d for d in dirs if d.kind == "checkpoint"), None)
    run_cfg = ours.run_config if ours is not None else {}
    target = a.target or (run_cfg.get("model") or {}).get("target")
    if not target:
        first = next(d for d in dirs if d.kind == "export")
        raise ConfigError(f"--checkpoint {str(first.path)!r} is a served-format drafter, which names no target: "
                          f"add --target (the model it drafts for: a model dir or hub id)")
    # init_from named where training started; eval reads the drafter itself (the dir may be gone)
    model = dict(run_cfg.get("model") or {}) | {"target": target, "init_from": ""}
    ev = dict(run_cfg.get("eval") or {})
    for key, v in (("temperature", a.temperature), ("top_p", a.top_p), ("top_k", a.top_k)):
        if v is not None:
            ev[key] = v
    cfg = load_config(None, [], **{"model": model, "data": run_cfg.get("data", {}),
                                   "train.seed": (run_cfg.get("train") or {}).get("seed", 0), "eval": ev})
    _notice_other_targets(dirs, target)
    return dirs, run_cfg, cfg


def _notice_other_targets(dirs, target: str) -> None:
    """A drafter evaluated on a target other than the one it was trained for decodes, but
    its tau says little about either: say so, naming both (a notice, not an error: a
    fine-tuned or renamed copy of the same model is a fair use)."""
    from .checkpoint_files import _same_target

    for d in dirs:
        own = d.target
        if own and not _same_target(own, target):
            print(f"dflash eval: notice: --checkpoint {str(d.path)!r} was trained for target {own!r}; "
                  f"evaluating it on {target!r}", file=sys.stderr)


def run(a) -> int:
    _check_args(a)
    dirs, run_cfg, cfg = _plan(a)
    from .inputs import TargetSpecError, check_target_spec
    try:  # a hub id that does not exist or cannot be reached: one line now, not after a minute
        check_target_spec(cfg.model.target, probe_hub=True)
    except TargetSpecError as e:
        raise ConfigError(str(e)) from None
    a.phase = "eval set-up"
    import torch

    from .config import resolve_dtype
    from .data import chat_template
    from .data import dataset as data_mod
    from .prep.prepare import split
    from .model import drafter_dirs
    from .model.evaluate import evaluate
    from .model.target import load_target

    # same device kind and dtype as the run's target: eval in the precision training used
    dev = (run_cfg.get("pipeline", {}).get("target_devices") or ["cpu"])[0]
    dev = dev if dev.startswith("cuda") and torch.cuda.is_available() else "cpu"
    target, tok = load_target(cfg.model.target, seed=cfg.model.target_seed, device=dev,
                              dtype=resolve_dtype(cfg, dev))
    chat_template.configure_from(tok, cfg.data)  # the run's data.chat_template(_kwargs): its prompts
    drafters = []
    for d in dirs:  # every one is checked against the target before any is evaluated
        drafter_dirs.check_fits(d, target, f"--checkpoint {str(d.path)!r}")
        drafter = drafter_dirs.load(d, device=dev)
        drafter.use_copy = not a.no_copy_head
        drafters.append(drafter)
    _, eval_convs = split(cfg)
    e = cfg.eval
    prompts = data_mod.prompts_for_eval(tok, eval_convs, max_prompt_len=e.max_prompt_len)[:a.prompts or e.prompts]
    results = []
    a.phase = "eval"
    with stop_on_signal() as stop:  # SIGTERM / Ctrl-C: stop within a verify step, report whole prompts
        for d, drafter in zip(dirs, drafters):
            res = evaluate(target, drafter, tok, eval_convs, prompts=len(prompts),
                           max_new_tokens=a.max_new_tokens or e.max_new_tokens, max_prompt_len=e.max_prompt_len,
                           check_lossless=not a.no_lossless_check, temperature=e.temperature, top_p=e.top_p,
                           top_k=e.top_k, seed=a.seed if a.seed is not None else cfg.train.seed, prompt_ids=prompts,
                           stop=stop)
            res["checkpoint"], res["format"], res["target"] = str(d.path), d.kind, cfg.model.target
            res["interrupted"] = res["interrupted"] or stop.is_set()
            if drafter.copy is not None:
                res["copy_head"] = drafter.use_copy
            results.append(res)
            if stop.is_set():
                break
    if len(results) == 1:
        _print_one(results[0])
    else:
        print(side_by_side_table(results))
    if a.trackers:
        log_trackers(dirs, results, a.trackers)
    if a.json:
        for res in results[:-1] if len(results) > 1 else []:
            print(json.dumps(res))
        print(json.dumps(results[0] if len(results) == 1 else {"drafters": results}))
    if any(r["interrupted"] for r in results):
        import shlex
        print(f"dflash eval: interrupted after {results[-1]['prompts']} prompt(s): the figures above are partial; "
              f"run it again for all: dflash {shlex.join(a.argv)}", file=sys.stderr)
        return 130
    return 0


def _print_one(res: dict) -> None:
    from .model.evaluate import describe_lossless

    sampling = f", T={res['temperature']}" if res.get("temperature") else ""
    print(f"acceptance length tau = {res['acceptance_length']:.3f} over {res['prompts']} prompts "
          f"(block {res['block_size']}, {res['dtype']}{sampling}, {describe_lossless(res)})"
          + (" [interrupted: partial]" if res.get("interrupted") else ""))
    print("histogram (accepted+1 per verify step): " + " ".join(f"{k}:{v}" for k, v in res["histogram"].items()))


def _lossless_word(res: dict) -> str:
    if res.get("lossless") is None:
        return "n/a (T>0)" if res.get("temperature") else "not checked"
    return "yes" if res["lossless"] else f"NO ({res['lossless_divergent_prompts']} prompts)"


def side_by_side_table(results: list[dict]) -> str:
    """One table, a row per drafter: tau, tokens/s, lossless, histogram, per-prompt tau."""
    r0 = results[0]
    head = (f"side by side on {r0.get('target')}: {r0['prompts']} prompts, max {r0['max_new_tokens']} new tokens, "
            f"{r0['dtype']}, T={r0.get('temperature', 0.0)}")
    rows = [("drafter", "tau", "tok/s", "lossless", "histogram (accepted+1: steps)", "per-prompt tau")]
    for res in results:
        hist = " ".join(f"{k}:{v}" for k, v in res["histogram"].items())
        rows.append((res["checkpoint"], f"{res['acceptance_length']:.3f}", str(res.get("tokens_per_s")),
                     _lossless_word(res), hist, " ".join(f"{t:.2f}" for t in res["per_prompt"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join([head, lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def log_trackers(dirs, results, names) -> None:
    """One drafter: its figures into the training run's trackers. Several: every drafter's
    figures under compare/<i>/..., into the first training run's trackers."""
    from . import trackers

    ours = [d for d in dirs if d.kind == "checkpoint"]
    run_dir = ours[0].path.parent if ours else Path(dirs[0].path)
    if len(results) == 1:
        trackers.log_eval(run_dir, results[0], names)
        return
    summary = {}
    for i, res in enumerate(results):
        summary |= {f"compare/{i}/checkpoint": res["checkpoint"], f"compare/{i}/tau": res["acceptance_length"],
                    f"compare/{i}/tokens_per_s": res.get("tokens_per_s"), f"compare/{i}/lossless": res.get("lossless")}
    trackers.log_eval(run_dir, results[0], names, summary=summary)

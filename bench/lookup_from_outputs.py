"""Prompt lookup's tau recomputed from an eval's greedy outputs, apart from the eval's own decode.

Under greedy decoding a prompt-lookup proposal is accepted up to its first token that the
target's output does not have, so its acceptance follows from the output ids alone. This
reads a `dflash eval --json` result (T = 0), decodes each prompt's greedy output a block
past the eval's end (what the last verify step could accept), walks the lookup over it with
its own plain implementation of the rule (dflash/model/prompt_lookup.py states it), and
compares step by step with the eval's `baseline`. It also scores the tie-break vLLM's
n-gram drafter uses (the earliest occurrence of the longest match) on the same outputs.

    dflash eval --checkpoint RUN/export --target smollm2 --json > eval.txt
    .venv/bin/python bench/lookup_from_outputs.py eval.txt
Last line: one JSON object.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def lookup(ids: list[int], length: int, *, earliest: bool = False, max_n: int = 3) -> list[int]:
    p = len(ids) - 1
    for n in range(min(max_n, p), 0, -1):
        key = ids[p - n + 1:]
        order = range(n - 1, p) if earliest else range(p - 1, n - 2, -1)
        for j in order:
            if ids[j - n + 1:j + 1] == key:
                return ids[j + 1:min(j + 1 + length, p + 1)]
    return []


def steps(prompt: list[int], out: list[int], max_new: int, block: int, eos: set, earliest: bool = False) -> list:
    """accepted + 1 per verify step, from the greedy output `out` (decoded past max_new)."""
    from dflash.model.prompt_lookup import accepted_on_output
    return accepted_on_output(prompt, out, max_new_tokens=max_new, block_size=block, eos=eos,
                              proposer=lambda ids, k: lookup(ids, k, earliest=earliest))


def main() -> int:
    from dflash.decode.spec_decode import greedy_generate
    from dflash.model import target as T

    res = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
    if res.get("temperature"):
        print("lookup_from_outputs: needs a T = 0 eval (greedy outputs)", file=sys.stderr)
        return 2
    model, _ = T.load_target(res["target"])
    B, n, eos = res["block_size"], res["max_new_tokens"], set(res["stop_token_ids"])
    latest, earliest, same = [], [], 0
    for mine, theirs in zip(res["per_prompt_steps"], res["baseline"]["per_prompt_steps"]):
        out = greedy_generate(model, mine["prompt_ids"], max_new_tokens=n + B)
        s = steps(mine["prompt_ids"], out, n, B, eos)
        same += s == theirs["acceptance_lengths"]
        latest.append(sum(s) / len(s))
        e = steps(mine["prompt_ids"], out, n, B, eos, earliest=True)
        earliest.append(sum(e) / len(e))
    print(json.dumps({"prompts": len(latest), "prompts_with_identical_steps": same,
                      "lookup_tau_from_outputs": round(sum(latest) / len(latest), 4),
                      "eval_baseline_tau": res["baseline"]["acceptance_length"],
                      "drafter_tau": res["acceptance_length"],
                      "earliest_match_tau": round(sum(earliest) / len(earliest), 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

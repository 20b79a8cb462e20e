"""Prompt lookup's tau on the greedy outputs an eval decoded: the free baseline beside a drafter.

Reads `dflash eval --json` output (or a run's summary.json, whose `eval_after` is the same
object) and replays every prompt's greedy output as a verifier would with a prompt-lookup
drafter: at each step it drafts block_size - 1 tokens with `bench/demo_ceiling.py`'s rule
(the tokens after the latest earlier occurrence of the context's last 3, 2 or 1 tokens,
never past the last known token), accepts the leading ones equal to the output, and moves
on by accepted + 1. Greedy verification makes the output independent of the drafter, so
this is the tau prompt lookup would get on exactly these prompts. Per-prompt means, then
their mean, as eval reports tau. (`dflash eval` prints this itself once its baseline lands.)

    python bench/lookup_from_eval.py EVAL.json [--block 4]
Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from demo_ceiling import lookup_draft  # noqa: E402


def lookup_steps(prompt: list[int], output: list[int], block: int) -> list[int]:
    """accepted + 1 per verify step when prompt lookup drafts for this greedy output."""
    ids, steps, j = list(prompt) + list(output), [], 0
    while j < len(output):
        p = len(prompt) + j - 1                     # the last known token
        accepted = 0
        for k, t in enumerate(lookup_draft(ids, p, block - 1)):
            if j + k + 1 < len(output) and output[j + k] == t:
                accepted += 1   # the step's own (bonus) token must remain inside the output
            else:
                break
        steps.append(accepted + 1)
        j += accepted + 1
    return steps


def lookup_tau(res: dict, block: int | None = None) -> dict:
    block = block or res["block_size"]
    per = []
    for rec in res["per_prompt_steps"]:
        s = lookup_steps(rec["prompt_ids"], rec["output_ids"], block)
        if s:
            per.append(sum(s) / len(s))
    return {"method": "prompt_lookup", "acceptance_length": round(sum(per) / max(1, len(per)), 4),
            "per_prompt": [round(t, 4) for t in per], "block_size": block, "prompts": len(per)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("eval_json")
    ap.add_argument("--block", type=int, default=0, help="block size (default: the eval's)")
    a = ap.parse_args()
    with open(a.eval_json) as f:
        text = f.read()
    try:
        res = json.loads(text)
    except ValueError:  # eval's stdout: the table, then the JSON object on the last line
        res = json.loads(text.strip().splitlines()[-1])
    res = res.get("eval_after", res)
    if "drafters" in res:  # several checkpoints side by side: the first
        res = res["drafters"][0]
    out = lookup_tau(res, a.block or None)
    out["drafter_acceptance_length"] = res["acceptance_length"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()

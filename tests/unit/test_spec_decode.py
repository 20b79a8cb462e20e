"""Speculative decoding is lossless and tau is counted right (hand-made drafters)."""
import pytest
import torch

from dflash.data.dataset import prompts_for_eval
from dflash.decode.spec_decode import greedy_generate, speculative_generate
from dflash.model import target as T
from dflash.model.drafter import DFlashDrafter
from helpers import drafter_config, scripted_drafter

BK = 6


def _cfg(model, tok):
    return drafter_config(model, tok, BK)


@pytest.mark.parametrize("good", [0, 2, BK - 1])
def test_tau_and_losslessness_on_scripted_drafts(tiny, good):
    model, tok = tiny
    prompt = prompts_for_eval(tok, [[{"role": "user", "content": "Tell me about rivers."}]], max_prompt_len=64)[0]
    n = 30
    ref = greedy_generate(model, prompt, max_new_tokens=n + BK)
    d = scripted_drafter(model, tok, ref, len(prompt), good, BK)
    res = speculative_generate(model, d, prompt, max_new_tokens=n)
    assert res.tokens == ref[:n], "speculative decoding must reproduce the target's greedy output"
    # every step accepts exactly `good` drafts, plus the bonus token
    assert set(res.acceptance[:-1]) == {good + 1}
    assert res.tau == pytest.approx(sum(res.acceptance) / len(res.acceptance))
    # first token comes from the prefill; each step then commits acceptance tokens
    assert 1 + sum(res.acceptance) >= n > 1 + sum(res.acceptance[:-1])


def test_untrained_drafter_is_lossless_on_hybrid_target():
    model, tok = T.load_target("tiny-qwen3.5", seed=0)  # no croppable cache: the re-run path
    prompt = prompts_for_eval(tok, [[{"role": "user", "content": "Hi"}]], max_prompt_len=64)[0]
    torch.manual_seed(0)
    d = DFlashDrafter(_cfg(model, tok))
    res = speculative_generate(model, d, prompt, max_new_tokens=12)
    assert res.tokens == greedy_generate(model, prompt, max_new_tokens=12)
    assert all(1 <= a <= BK for a in res.acceptance)


def test_decoding_hands_a_copy_head_the_tokens_so_far(tiny):
    """A copy-head drafter that always trusts its proposal drafts prompt lookup's continuation
    of exactly the tokens committed so far plus the anchor; the output stays the target's."""
    from helpers import load_bench
    ceiling = load_bench("demo_ceiling")

    model, tok = tiny
    cfg = _cfg(model, tok)
    cfg.copy_head = True
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).eval()
    with torch.no_grad():
        drafter.copy.bias.fill_(30.0)  # c = sigmoid(24): a proposal always wins
    seen = []
    real_draft = drafter.draft

    def recording_draft(*args, **kw):
        out = real_draft(*args, **kw)
        seen.append((kw["context_ids"][0].tolist(), out[0].tolist()))
        return out

    drafter.draft = recording_draft
    prompt = prompts_for_eval(tok, [[{"role": "user", "content": "one two one two one two one"}]], max_prompt_len=64)[0]
    res = speculative_generate(model, drafter, prompt, max_new_tokens=24)
    assert res.tokens == greedy_generate(model, prompt, max_new_tokens=24)
    copied = 0
    for ids, draft in seen:
        proposal = ceiling.lookup_draft(ids, len(ids) - 1, BK - 1)
        assert draft[:len(proposal)] == proposal
        copied += len(proposal)
    assert seen and seen[0][0][:len(prompt)] == prompt and copied > 0

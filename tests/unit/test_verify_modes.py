"""Hybrid targets verify a block in O(block): linear-attention states are snapshotted and
restored instead of re-running the sequence — with output identical to the re-run path.
Also: a divergence from the greedy reference is reported with where it happened."""
import pytest
import torch

from dflash.data.dataset import prompts_for_eval
from dflash.decode.spec_decode import _TargetRunner, cache_mode, greedy_generate, speculative_generate
from dflash.model import target as T
from dflash.model.drafter import DFlashDrafter
from helpers import drafter_config, scripted_drafter

BK = 6
QUESTIONS = ["Tell me about rivers.", "Write a haiku about the sea", "What is 12 times 7?"]


@pytest.fixture(scope="module")
def hybrid():
    return T.load_target("tiny-qwen3.5", seed=0)


def _prompts(tok):
    return prompts_for_eval(tok, [[{"role": "user", "content": q}] for q in QUESTIONS], max_prompt_len=64)


def _cfg(model, tok):
    return drafter_config(model, tok, BK)


def test_modes_are_chosen_by_cache_kind(hybrid, tiny):
    assert cache_mode(tiny[0]) == "crop"
    assert cache_mode(hybrid[0]) == "snapshot", "hybrid targets must not fall back to re-running"


@pytest.mark.parametrize("good", [0, 2, BK - 1])
def test_snapshot_path_equals_rerun_path_on_hybrid_target(hybrid, good):
    model, tok = hybrid
    prompt = _prompts(tok)[good % 3]
    ref = greedy_generate(model, prompt, max_new_tokens=16 + BK)
    d = scripted_drafter(model, tok, ref, len(prompt), good, BK)
    fast = speculative_generate(model, d, prompt, max_new_tokens=16, mode="snapshot")
    slow = speculative_generate(model, d, prompt, max_new_tokens=16, mode="rerun")
    assert fast.tokens == slow.tokens == ref[:16]
    assert fast.acceptance == slow.acceptance
    assert set(fast.acceptance[:-1]) == {good + 1}


@pytest.mark.parametrize("mode", ["snapshot", "rerun"])
def test_every_forward_sees_the_positions_of_its_tokens(hybrid, mode):
    """Positions, not only tokens: each target forward's position ids are consecutive and
    start where its first token sits in the final sequence (that token is always kept: a
    pending one or the anchor). transformers 5.25 counts a linear layer's tokens itself and
    takes a hybrid model's positions from that count, so a restore that forgot it shifted
    every later position by the rejected drafts (RoPE and mask off, logits 0.23 off) while
    the argmax tokens of a tiny target still matched."""
    model, tok = hybrid
    prompt = _prompts(tok)[1]
    ref = greedy_generate(model, prompt, max_new_tokens=16 + BK)
    d = scripted_drafter(model, tok, ref, len(prompt), 2, BK)
    fed, ids = [], []
    dec = model.get_decoder()
    hooks = [dec.rotary_emb.register_forward_pre_hook(
                 lambda m, a, kw: fed.append(a[1] if len(a) > 1 else kw["position_ids"]), with_kwargs=True),
             dec.register_forward_pre_hook(lambda m, a, kw: ids.append(kw["input_ids"][0].tolist()), with_kwargs=True)]
    try:
        res = speculative_generate(model, d, prompt, max_new_tokens=16, mode=mode)
    finally:
        for h in hooks:
            h.remove()
    final = prompt + res.tokens
    assert res.tokens == ref[:16] and len(fed) == len(ids) > 3
    starts = []
    for pos, tokens in zip(fed, ids):
        row = pos.reshape(-1, pos.shape[-1])[0].tolist()  # mrope: every section carries the text positions
        assert row == list(range(row[0], row[0] + len(tokens))), f"not the positions of {len(tokens)} tokens: {row}"
        assert tokens[0] == final[row[0]], f"token {tokens[0]} fed at position {row[0]}, which holds {final[row[0]]}"
        starts.append(row[0])
    assert starts[0] == 0
    if mode == "rerun":  # every forward is the whole sequence from 0
        assert set(starts) == {0}


def test_untrained_drafter_snapshot_equals_rerun_and_greedy(hybrid):
    """A real (random) drafter: mostly rejected drafts, the state is restored every step."""
    model, tok = hybrid
    torch.manual_seed(0)
    d = DFlashDrafter(_cfg(model, tok))
    for prompt in _prompts(tok)[:2]:
        fast = speculative_generate(model, d, prompt, max_new_tokens=12, mode="snapshot")
        slow = speculative_generate(model, d, prompt, max_new_tokens=12, mode="rerun")
        assert fast.tokens == slow.tokens == greedy_generate(model, prompt, max_new_tokens=12)


def test_snapshot_verify_forwards_only_the_block(hybrid):
    """What makes it O(block): no forward after the prefill sees more than one block."""
    model, tok = hybrid
    seen = []
    # the decoder: on the CPU the runner calls it alone (lm_head rows as read), else through the model
    hook = model.get_decoder().register_forward_pre_hook(lambda m, a, kw: seen.append(kw["input_ids"].shape[1]),
                                                         with_kwargs=True)
    try:
        torch.manual_seed(0)
        prompt = _prompts(tok)[0]
        speculative_generate(model, DFlashDrafter(_cfg(model, tok)), prompt, max_new_tokens=8, mode="snapshot")
    finally:
        hook.remove()
    assert seen[0] == len(prompt) and len(seen) > 2
    # a block, plus at most the tokens kept from earlier partial accepts (< one block)
    assert max(seen[1:]) <= 2 * BK - 1


def test_partial_accept_restores_states_and_continues_exactly(hybrid):
    """After a partial accept the states go back to before the verify (the kept tokens go
    in front of the next forward): what follows equals a clean forward of the sequence."""
    model, tok = hybrid
    prompt = _prompts(tok)[0]
    r = _TargetRunner(model, [1, 2], "snapshot", max_pending=8)  # layer 2 attends: its output depends on positions
    r.forward(prompt)
    r.commit(prompt, len(prompt))
    lin = [layer for layer in r.cache.layers if hasattr(layer, "recurrent_states")]
    before = [layer.recurrent_states[0].clone() for layer in lin]
    r.forward([10, 11, 12, 13])
    assert any(not torch.equal(b, layer.recurrent_states[0]) for b, layer in zip(before, lin))
    r.commit([10, 11, 12, 13], 1)  # keep one token: states restored, 10 pending
    for b, layer in zip(before, lin):
        assert torch.equal(b, layer.recurrent_states[0])
    assert r.cache.get_seq_length() == len(prompt) and r.pending == [10]
    preds, feats = r.forward([20, 21])
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([prompt + [10, 20, 21]]), use_cache=False, output_hidden_states=True)
    assert preds.tolist() == ref.logits[0, -2:].argmax(-1).tolist()
    torch.testing.assert_close(feats, torch.cat(ref.hidden_states[2:4], -1)[0, -2:], rtol=1e-4, atol=1e-4)
    r.commit([20, 21], 2)  # a full accept: nothing pending any more
    assert r.pending == [] and r.cache.get_seq_length() == len(prompt) + 3
    for k in range(3):  # partial accepts pile up to max_pending, then are replayed on their own
        r.forward([30 + k, 40])
        r.commit([30 + k, 40], 1)
    assert r.pending == [30, 31, 32]
    r.forward([33, 40, 41, 42, 43])
    r.commit([33, 40, 41, 42, 43], 5)
    assert r.pending == [] and r.cache.get_seq_length() == len(prompt) + 3 + 3 + 5
    small = _TargetRunner(model, [1], "snapshot", max_pending=2)
    small.forward(prompt)
    small.commit(prompt, len(prompt))
    for k in range(2):
        small.forward([50 + k, 60])
        small.commit([50 + k, 60], 1)
    assert small.pending == [] and small.cache.get_seq_length() == len(prompt) + 2, "replayed at max_pending"


def test_divergence_is_reported_with_its_position(monkeypatch, tiny):
    """A spec output that departs from the greedy reference is counted and located."""
    from dflash.decode import evaluate as E
    from dflash.decode.spec_decode import DecodeResult, first_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2

    model, tok = tiny
    real = E.speculative_generate

    def flip_fifth(*a, **kw):  # stand-in for a bf16 near-tie flipping one token
        res = real(*a, **kw)
        return DecodeResult(tokens=res.tokens[:4] + [res.tokens[4] + 1] + res.tokens[5:], acceptance=res.acceptance)

    monkeypatch.setattr(E, "speculative_generate", flip_fifth)
    torch.manual_seed(0)
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS[:2]]
    res = E.evaluate(model, DFlashDrafter(_cfg(model, tok)), tok, convs, prompts=2, max_new_tokens=8,
                     max_prompt_len=64, progress=False)
    assert res["lossless"] is False and res["lossless_divergent_prompts"] == 2
    assert [d["position"] for d in res["lossless_divergences"]] == [4, 4]
    assert all(d["margin"] >= 0 for d in res["lossless_divergences"])
    assert "2/2 prompts diverged" in E.describe_lossless(res)


def test_cpu_verify_projects_only_the_rows_read(hybrid):
    """On the CPU a cached verify runs the lm_head only for the rows the acceptance test
    reads (on a small target the lm_head over a block costs more than its layers): a
    rejected first draft costs one row, and each row's id is the full logits' argmax."""
    from dflash.model import lazy_logits

    model, tok = hybrid
    assert lazy_logits.supported(model)
    rows = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, a, o: rows.append(a[0].shape[-2]))
    try:
        prompt = _prompts(tok)[0]
        r = _TargetRunner(model, [1, 2], "snapshot")
        preds, _ = r.forward(prompt)
        last = preds[-1]
        assert rows == [1], "the prefill reads its last position only"
        r.commit(prompt, len(prompt))
        block = [last, 101, 102, 103, 104, 105]
        preds, feats = r.forward(block)
        first = preds[0]
        assert rows == [1, 1], "a first draft's check reads one row"
        ids = preds.tolist()
        assert rows == [1, 1, len(block) - 1], "reading on: the other rows in one product"
        assert ids[0] == first and len(ids) == len(block)
    finally:
        hook.remove()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([prompt + block]), use_cache=False, output_hidden_states=True)
    assert ref.logits[0, len(prompt) - 1].argmax().item() == last
    assert ids == ref.logits[0, -len(block):].argmax(-1).tolist()
    torch.testing.assert_close(feats, torch.cat([ref.hidden_states[i + 1] for i in (1, 2)], -1)[0, -len(block):],
                               rtol=1e-4, atol=1e-4)
    # the replay of kept tokens reads no logits at all; the re-run path keeps every row
    r.commit(block, 1)
    r.pending, rows[:] = list(range(200, 200 + r.max_pending - 1)), []
    r.forward([7, 8])
    r.commit([7, 8], 1)  # pending reaches max_pending: replayed
    assert r.pending == [] and rows == []
    slow = _TargetRunner(model, [1, 2], "rerun")
    assert slow.decoder is None
    preds, _ = slow.forward(prompt)
    assert isinstance(preds, list) and preds[-1] == last


def test_lazy_logits_only_where_logits_are_plain_lm_head(hybrid):
    from dflash.model import lazy_logits

    model, _ = hybrid
    ids = lazy_logits.LazyArgmax(torch.randn(5, model.config.hidden_size), model.get_output_embeddings())
    full = model.get_output_embeddings()(ids.hidden).argmax(-1).tolist()
    assert ids[-2] == full[3] and ids.rows_computed == 1
    assert ids.tolist() == full and ids.rows_computed == 5 and len(ids) == 5
    with pytest.raises(IndexError):
        ids[5]
    model.config.final_logit_softcapping = 30.0  # a transform between lm_head and the logits
    try:
        assert not lazy_logits.supported(model)
    finally:
        del model.config.final_logit_softcapping
    assert lazy_logits.supported(model)


@pytest.mark.parametrize("spec", ["tiny-qwen3", "tiny-qwen3.5"])
def test_one_forward_finds_where_an_output_leaves_the_greedy_decode(spec, hybrid):
    """The lossless check reads one teacher-forced forward, not a decode of its own: the
    greedy output passes, a token changed at k is found at k with the greedy decode's own
    margin there, and an output cut short (or running past an EOS) is found at its end."""
    from dflash.decode.spec_decode import greedy_divergence

    model, tok = hybrid if spec == "tiny-qwen3.5" else T.load_target(spec, seed=0)
    prompt = _prompts(tok)[2]
    margins: list = []
    ref = greedy_generate(model, prompt, max_new_tokens=20, margins=margins)
    assert greedy_divergence(model, prompt, ref, max_new_tokens=20) is None
    for k in (0, 7, 19):
        bad = ref[:k] + [(ref[k] + 1) % 1000] + ref[k + 1:]
        pos, margin = greedy_divergence(model, prompt, bad, max_new_tokens=20, rows=4)  # several chunks
        assert pos == k and margin == pytest.approx(margins[k], abs=1e-4)
    assert greedy_divergence(model, prompt, ref[:12], max_new_tokens=20)[0] == 12
    eos = {ref[5]}
    if ref[5] not in ref[:5]:
        assert greedy_divergence(model, prompt, ref[:8], max_new_tokens=20, eos_ids=eos)[0] == 6


def test_bf16_ties_are_named_and_fp32_stays_strict():
    """A bf16 divergence at an exact tie (margin 0) reads 'lossless up to N bf16 ties'; any
    margin > 0, or fp32, keeps the strict 'lossless=False'."""
    from dflash.commands.eval import _lossless_word
    from dflash.decode import evaluate as E

    tie = {"prompt": 3, "turn": 0, "position": 41, "margin": 0.0}
    res = {"lossless": False, "prompts": 8, "lossless_divergent_prompts": 1, "lossless_divergences": [tie],
           "dtype": "bfloat16"}
    assert E.describe_lossless(res) == "lossless up to 1 bfloat16 tie (margin 0): prompt 3 at token 41 (margin 0)"
    assert _lossless_word(res) == "yes up to 1 bfloat16 ties"
    assert E.only_ties(res)
    near = res | {"lossless_divergences": [tie | {"margin": 0.0312}]}
    assert E.describe_lossless(near).startswith("lossless=False: 1/8 prompts diverged")
    fp32 = res | {"dtype": "float32"}
    assert E.describe_lossless(fp32).startswith("lossless=False") and _lossless_word(fp32) == "NO (1 prompts)"

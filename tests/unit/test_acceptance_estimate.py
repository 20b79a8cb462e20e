"""The held-out estimate (run/acceptance_estimate.py) walks what decoding does: on the same
held-out prompts, cut the same way, its per-step tau, histogram and per-position acceptance
equal `dflash eval`'s (decode.evaluate), with and without a copy head's proposals, up to the
steps near a tie in the target's or the drafter's logits."""
from __future__ import annotations

import random

import pytest
import torch

from dflash.config import load_config
from dflash.data.dataset import prompts_for_eval
from dflash.data.sample import Sample
from dflash.decode.evaluate import evaluate
from dflash.model.build import build_drafter
from dflash.model.features import target_features
from dflash.model.target import load_target
from dflash.prep.regenerate import greedy_continuations
from dflash.run import acceptance_estimate as E
from dflash.run.step import TrainStep

BK, N, PROMPT = 4, 24, 44   # block, eval.max_new_tokens, eval.max_prompt_len
LAYERS = [1, 2, 3]
TIE = 1e-4                  # a top-1/top-2 logit gap this small may flip between two computations


def _walk_by_hand(acc: list[int], limit: int) -> list[int]:
    """speculative_generate's loop over reply anchors: the anchors it verifies at."""
    out, i = [], 0
    while i < limit:
        out.append(i)
        i += acc[i] + 1
    return out


def test_the_device_walk_is_the_decode_loop():
    rng = random.Random(0)
    for _ in range(50):
        L = rng.randrange(1, 40)
        acc = [[rng.choice([0, 0, 1, 2, 3, 7]) for _ in range(L)] for _ in range(3)]
        limit = [rng.randrange(0, L + 1) for _ in range(3)]
        got = E.walk(torch.tensor(acc), torch.tensor(limit))
        for r in range(3):
            assert torch.nonzero(got[r]).flatten().tolist() == _walk_by_hand(acc[r], limit[r]), (acc[r], limit[r])


def test_a_capture_runs_held_out_samples_walk_their_reply():
    rows = E.held_out_rows([Sample([5, 6, 7, 8, 9, 2], [0, 0, 1, 1, 1, 1]), Sample([5, 6, 7], [0, 0, 0])], pad_id=0)
    assert rows.start == [2, 3] and rows.stop == [5, 3]  # no step anchors at the reply's last token


@pytest.fixture(scope="module")
def setup():
    """A tiny target with larger random weights than its init (its greedy text mixes runs of one
    token with varied stretches, not one token forever), held-out prompts (one cut to PROMPT),
    and a copy-head drafter trained a few steps on the continuations: it accepts some drafts,
    not all. One mid-reply token is made an end-of-turn token: the decode stops there."""
    model, tok = load_target("tiny-qwen3", seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    words = "rivers lakes mountains code python music history cats stars ocean".split()
    convs = [[{"role": "user", "content": " ".join(words[i:] + words[:i]) * (1 + 3 * (i == 2))}] for i in range(4)]
    prompts = prompts_for_eval(tok, convs, max_prompt_len=PROMPT)
    assert len(set(map(len, prompts))) > 1 and max(map(len, prompts)) == PROMPT  # one was cut
    # an end-of-turn token: the one the last prompt's reply reaches at its 10th token
    stop = greedy_continuations(model, prompts[-1:], 10, pad=tok.pad_token_id, device="cpu")[0][-1]
    model.generation_config.eos_token_id = [tok.eos_token_id, stop]
    cfg = load_config(None, [f"model.block_size={BK}", "model.num_layers=1", "model.copy_head=true",
                             "train.num_anchors=16", "train.lr=3e-3", "train.warmup_ratio=0", "train.steps=12"])
    drafter = build_drafter(cfg, model, tok, LAYERS)
    with torch.no_grad():
        drafter.copy.bias.fill_(30.0)  # the copy head proposes prompt lookup's continuation
    st = TrainStep(cfg.train, BK, drafter, model.get_input_embeddings(), model.get_output_embeddings(), "cpu")
    rows = E.eval_prompt_rows(model, tok, convs, n=len(convs), max_prompt_len=PROMPT, max_new_tokens=N,
                              block_size=BK, pad_id=tok.pad_token_id)
    feats = target_features(model, rows.batch, LAYERS, "cpu")
    for _ in range(cfg.train.steps):
        loss, _ = st.forward(feats, rows.batch)
        st.backward(loss)
        st.optimizer_step(loss)
    return model, tok, convs, st, rows


def _estimate(st, model, rows):
    est = E.AcceptanceEstimate(st, model, rows, layer_ids=LAYERS, feature_store=None, every=1)
    est(0)
    est.collect(blocking=True)
    return est


def _near_ties(model, st, est) -> int:
    """Reply positions whose target logits, or whose drafter slot logits (with copies or
    without), have their top two within TIE: where two computations may disagree."""
    b, d = est.batch, st.drafter
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
        own, hidden = d.slot_outputs(est.features, est.ids, est.anchors, est.valid, st.embed, st.lm_head)
        mixed = d.add_copies(own, hidden, est.ids, est.anchors, st.lm_head)

    def gap(x):
        top = x.float().topk(2, dim=-1).values
        return top[..., 0] - top[..., 1]
    n = 0
    for r, (a, z) in enumerate(zip(est.rows.start, est.rows.stop)):
        n += int((gap(logits[r, a - 1:min(z + BK, b.lengths[r]) - 1]) < TIE).sum())
        n += int(((gap(own[r, :z - a]) < TIE) | (gap(mixed[r, :z - a]) < TIE)).any(-1).sum())
    return n


def test_the_walk_equals_decoding_the_same_prompts(setup, monkeypatch):
    model, tok, convs, st, rows = setup
    assert any(z - a < N - 1 for a, z in zip(rows.start, rows.stop)), "one reply ends at its end-of-turn token"
    assert all(z - a <= N - 1 for a, z in zip(rows.start, rows.stop))
    est = _estimate(st, model, rows)
    step, tau, per_pos, no_copy, detail = est.latest()
    ties = _near_ties(model, st, est)
    decoded = {}
    for use_copy in (True, False):
        st.drafter.use_copy = use_copy
        decoded[use_copy] = evaluate(model, st.drafter, tok, convs, prompts=len(convs), max_new_tokens=N,
                                     max_prompt_len=PROMPT, progress=False, check_lossless=False)
    st.drafter.use_copy = True
    for walked, hist, res in ((tau, detail["histogram"], decoded[True]),
                              (no_copy, detail["histogram_no_copy"], decoded[False])):
        print(f"walked {walked:.4f} {hist}; decoded {res['tau_per_step']} {res['histogram']}; near-ties {ties}")
        moved = sum(abs(hist[k] - res["histogram"][k]) for k in hist)  # a changed step moves two counts at most
        assert moved <= 2 * ties, (hist, res["histogram"], ties)
        if ties == 0:
            assert hist == res["histogram"] and round(walked, 4) == res["tau_per_step"]
    assert per_pos == decoded[True]["per_position_acceptance"] or ties
    # it is a test of something: some drafts accepted, not all; the copies help
    assert 1.1 < no_copy < tau < BK - 0.5, (no_copy, tau)
    assert detail["tau_anchor_mean"] > tau  # over every anchor: what the estimate reported before
    # the chunks of blocks do not change a thing
    monkeypatch.setattr(E, "ESTIMATE_LOGITS", 5 * (BK - 1) * st.lm_head.weight.shape[0])
    chunked = _estimate(st, model, rows)
    assert len(chunked.chunks) == len(rows.start) and len(chunked.chunks[0][1]) > 1
    assert chunked.latest()[1:4] == est.latest()[1:4]
    s = est.summary()
    assert s["last"]["tau"] == round(tau, 4) and s["last"]["tau_no_copy"] == round(no_copy, 4)
    assert s["last"]["per_position_acceptance"] == per_pos and s["held_out_sequences"] == len(convs)


def test_the_walked_eval_has_the_decoded_evals_steps_outputs_and_lookup(setup):
    """eval.decode=false: as_eval gives, per prompt, the verify steps, the output and prompt
    lookup's steps that evaluate() decodes (up to near-ties), with eval's keys."""
    from dflash.decode.evaluate import stop_token_ids

    model, tok, convs, st, rows = setup
    st.drafter.use_copy = False  # as served: the drafter's own drafts
    try:
        est = _estimate(st, model, rows)
        ties = _near_ties(model, st, est)
        walked = est.as_eval(st.drafter, eos=stop_token_ids(model, tok), max_new_tokens=N, prompts=len(convs),
                             baseline="prompt_lookup", dtype="float32")
        decoded = evaluate(model, st.drafter, tok, convs, prompts=len(convs), max_new_tokens=N,
                           max_prompt_len=PROMPT, progress=False, check_lossless=False, baseline="prompt_lookup")
    finally:
        st.drafter.use_copy = True
    assert walked["method"] == "walked" and walked["lossless"] is None and walked["prompts"] == len(convs)
    assert set(decoded) - set(walked) <= {"prompt_set", "prompt_source", "lossless_mismatches", "lossless_ties",
                                          "lossless_up_to_ties"}, set(decoded) - set(walked)
    for w, d in zip(walked["per_prompt_steps"], decoded["per_prompt_steps"]):
        assert w["prompt_ids"] == d["prompt_ids"]
        if not ties:
            assert w["output_ids"] == d["output_ids"] and w["acceptance_lengths"] == d["acceptance_lengths"]
    lookup_w = [s["acceptance_lengths"] for s in walked["baseline"]["per_prompt_steps"]]
    lookup_d = [s["acceptance_lengths"] for s in decoded["baseline"]["per_prompt_steps"]]
    if not ties:
        assert lookup_w == lookup_d and walked["tau_per_step"] == decoded["tau_per_step"]
        assert walked["baseline"]["tau_per_step"] == decoded["baseline"]["tau_per_step"]
    assert any(a > 1 for s in lookup_d for a in s)  # lookup accepts something here: a test of it

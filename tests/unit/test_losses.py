"""train.loss (ce | kl | lk) and train.loss_weights (decay | dpace): model/losses.py.

Each loss against values worked out by hand (the arithmetic is in the comments), the
D-PACE weights against autograd's derivative of the expected accepted length they stand
for, the target's distribution as the trainer builds it against the target's own logits,
the last hidden state captured during generation and a capture's top-k. Short real runs
with each loss: tests/integration/test_loss_runs.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from dflash.model import losses as L


def _close(a, b, tol=1e-5):
    assert abs(float(a) - b) < tol, (float(a), b)


# -- KL --------------------------------------------------------------------------------------
def test_kl_dense_by_hand():
    # q uniform over 3 tokens; p = (1/2, 1/4, 1/4):
    # KL = 1/2 ln(1.5) + 2 * 1/4 ln(0.75) = 0.2027326 - 0.1438411 = 0.0588915
    logits = torch.zeros(1, 3)
    tgt = L.SlotTargets(torch.tensor([[0.5, 0.25, 0.25]]).log())
    _close(L.kl_per_slot(logits, tgt)[0], 0.0588915)


def test_kl_topk_with_tail_by_hand():
    # q uniform over 4; p = (0.6, 0.3, 0.05, 0.05), top 2 kept: buckets {0: 0.6, 1: 0.3, rest: 0.1}
    # against q's {0.25, 0.25, 0.5}: 0.6 ln 2.4 + 0.3 ln 1.2 + 0.1 ln 0.2
    #   = 0.5252814 + 0.0546965 - 0.1609438 = 0.4190339
    logp = torch.tensor([[0.6, 0.3, 0.05, 0.05]]).log()
    tgt = L.target_slot_dist(logp, 2, None)
    _close(L.kl_per_slot(torch.zeros(1, 4), tgt)[0], 0.4190339)
    # k = V: the buckets are the tokens, no tail: the dense KL
    full = L.target_slot_dist(logp, 4, None)
    dense = L.kl_per_slot(torch.zeros(1, 4), L.SlotTargets(logp))
    _close(L.kl_per_slot(torch.zeros(1, 4), full)[0], float(dense[0]))


def test_kl_topk_on_a_loss_vocabulary_by_hand():
    # the drafter's columns are tokens (0, 2, 3) (train.loss_vocab), uniform: 1/3 each.
    # The target's top 2 are tokens 0 (0.6) and 1 (0.3); token 1 is not a column, so its mass
    # joins the tail: buckets {0: 0.6, rest: 0.4} against {1/3, 2/3}:
    #   0.6 ln 1.8 + 0.4 ln 0.6 = 0.3526721 - 0.2043304 = 0.1483417
    logp = torch.tensor([[0.6, 0.3, 0.05, 0.05]]).log()
    tgt = L.target_slot_dist(logp, 2, torch.tensor([0, 2, 3]))
    assert tgt.present.tolist() == [[True, False]]
    _close(L.kl_per_slot(torch.zeros(1, 3), tgt)[0], 0.1483417)
    # the whole distribution on those columns (kl_topk=0): the mass outside them is dropped
    # 0.6 ln 1.8 + 2 * 0.05 ln 0.15 = 0.3526721 - 0.1897120 = 0.1629601
    whole = L.target_slot_dist(logp, 0, torch.tensor([0, 2, 3]))
    _close(L.kl_per_slot(torch.zeros(1, 3), whole)[0], 0.1629601)


def test_kl_gradient_is_finite_when_the_buckets_cover_everything():
    logits = torch.zeros(1, 2, requires_grad=True)
    tgt = L.target_slot_dist(torch.tensor([[0.7, 0.3]]).log(), 2, None)
    L.kl_per_slot(logits, tgt).sum().backward()
    assert torch.isfinite(logits.grad).all()
    # d KL / d logits = q - p = (0.5 - 0.7, 0.5 - 0.3)
    assert torch.allclose(logits.grad, torch.tensor([[-0.2, 0.2]]), atol=1e-6)


# -- LK --------------------------------------------------------------------------------------
def test_lk_hybrid_by_hand():
    # the dense example above: alpha = min(.5, 1/3) + 2 min(.25, 1/3) = 0.8333333,
    # lam = exp(-3 alpha) = exp(-2.5) = 0.0820850, KL = 0.0588915:
    # lam KL + (1 - lam)(1 - alpha) = 0.0048341 + 0.9179150 * 0.1666667 = 0.1578199
    tgt = L.SlotTargets(torch.tensor([[0.5, 0.25, 0.25]]).log())
    _close(L.lk_per_slot(torch.zeros(1, 3), tgt, eta=3.0)[0], 0.1578199)
    # eta = 0: lam = 1, the KL alone
    _close(L.lk_per_slot(torch.zeros(1, 3), tgt, eta=0.0)[0], 0.0588915)


def test_lk_tail_bucket_counts_in_alpha():
    # top 2 of (0.6, 0.3, 0.05, 0.05) against uniform q: alpha = .25 + .25 + min(.1, .5) = 0.6
    # lam = exp(-1.8) = 0.1652989; loss = lam * 0.4190339 + (1 - lam) * 0.4 = 0.0692659 + 0.3338804 = 0.4031463
    tgt = L.target_slot_dist(torch.tensor([[0.6, 0.3, 0.05, 0.05]]).log(), 2, None)
    _close(L.lk_per_slot(torch.zeros(1, 4), tgt, eta=3.0)[0], 0.4031463)


# -- D-PACE ----------------------------------------------------------------------------------
def test_dpace_weights_by_hand():
    # label probabilities q = (0.5, 0.2, 0.8), a = 0.5: s = (0.75, 0.6, 0.9),
    # prefix products (0.75, 0.45, 0.405); weights = suffix sums (1.605, 0.855, 0.405)
    q = torch.tensor([[0.5, 0.2, 0.8]])
    w = L.dpace_weights(q.log(), torch.ones(1, 3), 0.5)
    assert torch.allclose(w, torch.tensor([[1.605, 0.855, 0.405]]), atol=1e-6)
    # slot 3 masked: it passes through (s = 1) and weighs 0: prefix (0.75, 0.45, 0.45) -> (1.2, 0.45, 0)
    w = L.dpace_weights(q.log(), torch.tensor([[1.0, 1.0, 0.0]]), 0.5)
    assert torch.allclose(w, torch.tensor([[1.2, 0.45, 0.0]]), atol=1e-6)


def test_dpace_weights_are_the_derivative_of_expected_acceptance():
    # unsmoothed (a -> 0): slot k's weight = d E / d log q_k, E = sum_i prod_{l<=i} q_l
    logq = torch.tensor([[-0.3, -1.2, -0.1, -2.0]], requires_grad=True)
    E = torch.cumprod(logq.exp(), -1).sum()
    (grad,) = torch.autograd.grad(E, logq)
    assert torch.allclose(L.dpace_weights(logq.detach(), torch.ones(1, 4), 1e-12), grad, atol=1e-6)


def test_dpace_block_loss_by_hand():
    # one block of 2 slots over 2 tokens; logits (0, 0) at both: q(label) = 1/2, CE = ln 2 each.
    # a = 0.5: s = 0.75 both; weights (0.75 + 0.5625, 0.5625) = (1.3125, 0.5625):
    # loss = sum w CE / sum w = ln 2 whatever the weights; the accuracy uses the decay
    logits = torch.tensor([[[[0.0, 0.0], [0.0, 0.0]]]])
    labels = torch.tensor([[[0, 1]]])
    valid = torch.ones(1, 1, dtype=torch.bool)
    loss, acc = L.block_loss(logits, labels, valid, torch.ones(1, 1, 2), torch.tensor([1.0, 0.5]),
                             loss="ce", weighting="dpace", dpace_alpha=0.5)
    _close(loss, math.log(2))
    # now slot 1 is confident (q = e^2 / (1 + e^2) = 0.8807971 on label 0): CE_1 = 0.1269280;
    # s_1 = 0.9403985, s_2 = 0.75: prefix (0.9403985, 0.7052989); w = (1.6456974, 0.7052989)
    # loss = (1.6456974 * 0.1269280 + 0.7052989 * ln 2) / 2.3509963 = 0.2967938
    logits = torch.tensor([[[[2.0, 0.0], [0.0, 0.0]]]])
    loss, acc = L.block_loss(logits, labels, valid, torch.ones(1, 1, 2), torch.tensor([1.0, 0.5]),
                             loss="ce", weighting="dpace", dpace_alpha=0.5)
    _close(loss, 0.2967938)
    _close(acc, 1.0 / 1.5)  # slot 1 right (decay weight 1), slot 2 wrong (argmax 0, label 1; weight 0.5)


def test_ce_with_decay_through_block_loss_equals_the_default():
    from dflash.model.losses import weighted_block_loss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 4, 11, generator=g)
    labels = torch.randint(0, 11, (2, 3, 4), generator=g)
    valid = torch.tensor([[True, True, False], [True, False, True]])
    mask = (torch.rand(2, 3, 4, generator=g) > 0.2).float()
    w = torch.tensor([1.0, 0.7, 0.5, 0.3])
    a = weighted_block_loss(logits, labels, valid, mask, w)
    b = L.block_loss(logits, labels, valid, mask, w, loss="ce", weighting="decay")
    assert torch.allclose(a[0], b[0], atol=1e-6) and torch.allclose(a[1], b[1])


# -- the target's distribution, as training gets it -----------------------------------------
def test_final_feature_is_what_the_lm_head_reads(tiny):
    from dflash.model import target as T
    model, _ = tiny
    ids = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    feats = T.capture_hidden(model, ids, am, [1, T.FINAL])
    H = model.config.hidden_size
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am).logits
    assert torch.allclose(model.get_output_embeddings()(feats[..., H:]), logits, atol=1e-5)
    # captured during generation (regeneration keeps it for the feature cache): the same rows
    from dflash.model.features import LayerCapture, can_capture
    assert can_capture(model, [1, T.FINAL])
    with LayerCapture(model, [1, T.FINAL]) as cap, torch.no_grad():
        model(input_ids=ids, attention_mask=am)
    assert torch.allclose(cap.calls[0], feats, atol=1e-5)


def _trainer(model, tok, **train):
    from dflash.config import TrainConfig
    from dflash.model.drafter import DFlashDrafter, DrafterConfig
    from dflash.run.step import TrainStep

    cfg = DrafterConfig.from_target(model.config, target_layer_ids=[1], mask_token_id=0,
                                    vocab_size=model.config.vocab_size, block_size=4)
    torch.manual_seed(0)
    return TrainStep(TrainConfig(**train), 4, DFlashDrafter(cfg), model.get_input_embeddings(),
                          model.get_output_embeddings(), "cpu")


def _batch(n=2, S=24, seed=3):
    from dflash.data.batch import Batch
    ids = torch.randint(0, 200, (n, S), generator=torch.Generator().manual_seed(seed))
    lm = torch.zeros(n, S, dtype=torch.long)
    lm[:, 6:] = 1
    return Batch(index=0, input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=lm, lengths=[S] * n)


def test_slot_targets_are_the_targets_next_token_distribution(tiny):
    from dflash.model import target as T
    model, tok = tiny
    tr = _trainer(model, tok, loss="kl", kl_topk=0)
    b = _batch()
    feats = T.capture_hidden(model, b.input_ids, b.attention_mask, [1, T.FINAL])
    H = model.config.hidden_size
    anchors = torch.tensor([[6, 10], [8, 15]])
    tgt = tr.loss.slot_targets(feats[..., H:], b, anchors, tr.lm_head)
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=b.input_ids).logits, -1)
    # slot k of the block at p is token p+k, predicted at position p+k-1
    for i in range(2):
        for a in range(2):
            for k in range(1, 4):
                assert torch.allclose(tgt.logp[i, a, k - 1], ref[i, anchors[i, a] + k - 1], atol=1e-5)
    # top-k: the k largest of the same rows
    tr.train.kl_topk = 5
    top = tr.loss.slot_targets(feats[..., H:], b, anchors, tr.lm_head)
    assert torch.allclose(top.logp[0, 0, 0], ref[0, 6].topk(5).values, atol=1e-5)
    # a full forward with kl: the loss is finite and trains (a gradient reaches the drafter)
    loss, _ = tr.forward(feats, b)
    loss.backward()
    assert torch.isfinite(loss) and any(p.grad is not None and p.grad.abs().sum() > 0
                                        for p in tr.drafter.parameters())


def test_capture_top_logprobs(tiny):
    from dflash.model import target as T
    from dflash.offline.capture import top_logprobs
    model, _ = tiny
    b = _batch(n=1, S=9)
    last = T.capture_hidden(model, b.input_ids, b.attention_mask, [T.FINAL])
    vals, ids = top_logprobs(model, last, 4, chunk=4)  # chunks of 4 positions: 9 = 4 + 4 + 1
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=b.input_ids).logits, -1).topk(4)
    assert vals.dtype == torch.float16 and ids.dtype == torch.int32 and vals.shape == (1, 9, 4)
    assert torch.equal(ids.long(), ref.indices)
    assert torch.allclose(vals.float(), ref.values, atol=1e-2)


@pytest.mark.parametrize("setting,needle", [
    ("train.loss=mse", "train.loss='mse': expected ce, kl or lk"),
    ("train.loss_weights=linear", "train.loss_weights='linear': expected decay or dpace"),
    ("train.kl_topk=-1", "train.kl_topk=-1: expected an integer >= 0"),
    ("train.dpace_alpha=0", "train.dpace_alpha=0.0: expected a finite number > 0 and <= 1"),
    ("train.lk_eta=-1", "train.lk_eta=-1.0: expected a finite number >= 0"),
])
def test_bad_loss_settings_are_one_line(setting, needle):
    from dflash.config import load_config
    from dflash.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        load_config(None, [setting])
    assert needle in str(e.value) and "\n" not in str(e.value)

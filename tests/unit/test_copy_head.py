"""The copy head (model.copy_head): proposals are prompt lookup's, only known tokens are
copied, the bias is learned, and training, the estimate and decoding agree."""
from __future__ import annotations

import math
import random

import torch
from torch import nn

from dflash.model.copy_head import PRIOR, CopyHead, copy_candidates
from dflash.model.loss_vocab import RowsHead
from helpers import load_bench, small_drafter

ceiling = load_bench("demo_ceiling")

H, V, BK = 32, 41, 5


def _small(copy_head: bool):
    """A two-layer drafter of H and V, seeded: with or without the copy head."""
    return small_drafter(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=V,
                         mask_token_id=V - 1, num_hidden_layers=2, block_size=BK, copy_head=copy_head)


def test_proposals_are_prompt_lookups_and_never_read_past_the_anchor():
    rng = random.Random(0)
    for trial in range(20):
        # a small alphabet and a repeated chunk: many matches of every length
        chunk = [rng.randrange(6) for _ in range(7)]
        seq = [rng.randrange(6) for _ in range(5)] + chunk + [rng.randrange(6) for _ in range(4)] + chunk
        ids = torch.tensor([seq])
        anchors = torch.arange(len(seq))[None]
        cand, n, ok = copy_candidates(ids, anchors, BK - 1)
        for p in range(len(seq)):
            want = ceiling.lookup_draft(seq, p, BK - 1)
            got = cand[0, p][ok[0, p]].tolist()
            assert got == want, (trial, p, seq)
            assert int(ok[0, p].sum()) == len(want)
            # the continuation is made of tokens at positions <= p only
            assert (n[0, p] > 0) == bool(want)


def _head(c=None):
    head = CopyHead(BK - 1, H)
    if c is not None:  # every proposal's copy weight = c
        with torch.no_grad():
            head.bias.fill_(math.log(c / (1 - c)) - PRIOR)
    return head


def test_the_mixture_puts_the_copy_weight_on_exactly_the_proposal():
    ids = torch.tensor([[3, 4, 5, 3, 4, 9, 9, 9]])
    anchors = torch.tensor([[4]])  # "3 4" matched at 1: proposals 5 (pos 2), 3 (3), 4 (4), then unknown
    logits, hidden = torch.randn(1, 1, BK - 1, V), torch.randn(1, 1, BK - 1, H)
    p = logits.softmax(-1)
    assert copy_candidates(ids, anchors, BK - 1)[1].tolist() == [[2]]  # the match length picks the bias
    only_other_rows = _head(0.5)
    with torch.no_grad():
        only_other_rows.bias[:, 2] = 0.0
    assert torch.allclose(only_other_rows(logits, hidden, ids, anchors).exp(), p, atol=0.01)
    start = _head()(logits, hidden, ids, anchors).exp()
    assert torch.allclose(start, p, atol=0.01)  # untrained: c = sigmoid(PRIOR), barely any copying
    out = _head(0.5)(logits, hidden, ids, anchors).exp()
    assert torch.allclose(out.sum(-1), torch.ones(1, 1, BK - 1))
    for k, tok in enumerate([5, 3, 4]):
        want = 0.5 * p[0, 0, k]
        want[tok] += 0.5
        assert torch.allclose(out[0, 0, k], want, atol=1e-6)
    assert torch.allclose(out[0, 0, 3], p[0, 0, 3])  # slot 4 would copy position 5 > p: no proposal


def test_the_copy_weight_is_learned_from_the_loss():
    head = _head()
    ids = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]])
    anchors = torch.tensor([[4]])
    hidden = torch.randn(1, 1, BK - 1, H)
    out = head(torch.zeros(1, 1, BK - 1, V), hidden, ids, anchors)
    nn.functional.cross_entropy(out[0, 0, :1], torch.tensor([5])).backward()
    assert head.bias.grad[0, 2] < 0  # a correct proposal: more copy weight lowers the loss
    assert head.gate.weight.grad.abs().sum() > 0  # and the drafter's hidden state learns when to copy


def test_the_copy_lands_on_the_subset_column_of_a_rows_head():
    ids = torch.tensor([[7, 8, 7, 8, 7]])
    rows = RowsHead(nn.Linear(H, V, bias=False), torch.tensor([2, 7, 8, 30]))
    out = _head(0.5)(torch.zeros(1, 1, BK - 1, 4), torch.zeros(1, 1, BK - 1, H), ids, torch.tensor([[4]]),
                     rows.to_subset).exp()
    # "8 7" matched at 2: slot 1 proposes token 8 (column 2), slot 2 token 7 (column 1)
    assert torch.allclose(out[0, 0, 0], torch.tensor([0.125, 0.125, 0.625, 0.125]))
    assert torch.allclose(out[0, 0, 1], torch.tensor([0.125, 0.625, 0.125, 0.125]))


def test_the_gate_starts_at_zero_and_the_rest_of_the_drafter_is_unchanged_by_the_head():
    with_head, without = _small(copy_head=True), _small(copy_head=False)
    assert with_head.copy.gate.weight.abs().sum() == 0 and with_head.copy.bias.abs().sum() == 0
    rest = {k: v for k, v in with_head.state_dict().items() if not k.startswith("copy.")}
    assert rest.keys() == without.state_dict().keys()
    assert all(torch.equal(v, without.state_dict()[k]) for k, v in rest.items())


def test_the_bias_gets_its_learning_rate_multiple_in_the_optimizer():
    from dflash.config import load_config
    from dflash.model.copy_head import BIAS_LR_SCALE
    from dflash.run.step import TrainStep
    d, embed, head = _drafter()
    cfg = load_config(None, ["model.copy_head=true", "train.lr=1e-3"])
    step = TrainStep(cfg.train, cfg.model.block_size, d.float(), embed.float(), head.float(), "cpu")
    lrs = {id(p): g["initial_lr"] for g in step.opt.param_groups for p in g["params"]}  # before the schedule
    assert lrs[id(d.copy.bias)] == 1e-3 * BIAS_LR_SCALE
    assert lrs[id(d.copy.gate.weight)] == lrs[id(d.fc.weight)] == 1e-3


def _drafter():
    d = _small(copy_head=True).double().eval()
    with torch.no_grad():
        d.copy.bias.uniform_(3.0, 9.0)   # copy weights from sigmoid(-3) to sigmoid(3)
        d.copy.gate.weight.normal_(0.0, 0.1)
    return d, nn.Embedding(V, H).double(), nn.Linear(H, V, bias=False).double()


def test_decoding_drafts_what_training_scores():
    d, embed, head = _drafter()
    S = 30
    torch.manual_seed(1)
    ids = torch.randint(0, 6, (1, S))  # a small alphabet: most anchors have a match
    feats = torch.randn(1, S, 2 * H, dtype=torch.float64)
    anchors = torch.tensor([[2, 8, 13, 19, S - BK]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    logits = d.train_forward(feats, ids, anchors, valid, embed, head)
    own, hidden = d.slot_outputs(feats, ids, anchors, valid, embed, head)
    assert not torch.allclose(logits, own.log_softmax(-1))
    assert torch.equal(d.add_copies(own, hidden, ids, anchors, head), logits)
    for j, p in enumerate(anchors[0].tolist()):
        kv = d.context_from_features(feats[:, :p], torch.arange(p)[None], embed)
        draft = d.draft(ids[:, p], p, kv, embed, head, ids[:, :p + 1])
        assert draft[0].tolist() == logits[0, j].argmax(-1).tolist(), f"anchor {p}"
    d.use_copy = False  # `dflash eval --no-copy-head`: the drafter's own guesses
    kv = d.context_from_features(feats[:, :8], torch.arange(8)[None], embed)
    assert d.draft(ids[:, 8], 8, kv, embed, head)[0].tolist() == own[0, 1].argmax(-1).tolist()

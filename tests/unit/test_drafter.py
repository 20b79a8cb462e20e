"""The drafter's one-pass training forward must equal how inference runs each block."""
import torch
from torch import nn

from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.objective import sample_anchors
from dflash.model.losses import decay_weights, weighted_block_loss
from helpers import check_one_pass_equals_per_block

H, V, BK = 64, 101, 8


def make(layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        intermediate_size=128, vocab_size=V, target_layer_ids=[0, 2, 3],
                        mask_token_id=V - 1, num_hidden_layers=layers, block_size=BK)
    d = DFlashDrafter(cfg).double()
    embed = nn.Embedding(V, H).double()
    head = nn.Linear(H, V, bias=False).double()
    return d, embed, head


def inference_logits(d, embed, head, feats, ids, p):
    """One block exactly as spec decoding builds it: context < p from a cache, anchor ids[p]."""
    ctx = d.fuse(feats[:, :p])
    kv = d.context_kv(ctx, torch.arange(p)[None])
    blk = torch.full((1, BK), d.cfg.mask_token_id)
    blk[0, 0] = ids[0, p]
    h = d.blocks_hidden(embed(blk), (p + torch.arange(BK))[None], kv, None)
    return head(h[:, 1:])


def test_one_pass_training_forward_matches_per_block_inference():
    d, embed, head = make()
    check_one_pass_equals_per_block(d, embed, head, lambda feats, ids, p: inference_logits(d, embed, head, feats, ids, p),
                                    hidden=H, vocab=V, block=BK, atol=1e-5)


def test_block_mask_semantics():
    anchors = torch.tensor([[2, 5]])
    m = DFlashDrafter.block_mask(anchors, torch.tensor([[True, True]]), S=10, Bk=3)[0, 0]
    assert m.shape == (6, 10 + 6)
    for q in range(6):
        blk, p = q // 3, anchors[0, q // 3].item()
        ctx = m[q, :10].nonzero().flatten().tolist()
        assert ctx == list(range(p)), "context must be strictly before the anchor"
        own = m[q, 10:].nonzero().flatten().tolist()
        assert own == [blk * 3 + i for i in range(3)], "whole own block (bidirectional), no other block"


def test_future_context_and_other_blocks_do_not_leak():
    d, embed, head = make(layers=1)
    S = 32
    feats = torch.randn(1, S, 3 * H, dtype=torch.float64)
    ids = torch.randint(0, V - 1, (1, S))
    anchors, valid = torch.tensor([[4, 12]]), torch.tensor([[True, True]])
    base = d.train_forward(feats, ids, anchors, valid, embed, head)
    f2, i2 = feats.clone(), ids.clone()
    f2[:, 12:] += 5.0          # context at/after anchor 12 is invisible to block 1
    i2[0, 4] = (i2[0, 4] + 1) % (V - 1)  # block 0's anchor token changes: block 1 must not care
    out = d.train_forward(f2, i2, anchors, valid, embed, head)
    assert torch.allclose(out[0, 1], base[0, 1], atol=1e-9)
    assert not torch.allclose(out[0, 0], base[0, 0])
    # a change in the block's own context does matter (so the test can fail)
    f3 = feats.clone(); f3[:, 11] += 5.0
    out3 = d.train_forward(f3, ids, anchors, valid, embed, head)
    assert not torch.allclose(out3[0, 1], base[0, 1])


def test_loss_weights_and_decay():
    w = decay_weights(16)
    assert w[0] == 0 and w[1] == 1.0
    assert torch.isclose(w[8], torch.exp(torch.tensor(-7 / 7.0)))
    assert torch.isclose(decay_weights(8)[5], torch.exp(torch.tensor(-4 / 4.0)))
    assert torch.isclose(decay_weights(10)[6], torch.exp(torch.tensor(-5 / 5.0)))


def test_weighted_loss_ignores_masked_slots():
    logits = torch.randn(1, 1, 3, 7)
    labels = torch.tensor([[[1, 2, 3]]])
    w = torch.tensor([1.0, 0.5, 0.25])
    full, _ = weighted_block_loss(logits, labels, torch.tensor([[True]]), torch.ones(1, 1, 3), w)
    ce = torch.nn.functional.cross_entropy(logits[0, 0], labels[0, 0], reduction="none")
    assert torch.isclose(full, (ce * w).sum() / w.sum())
    masked, _ = weighted_block_loss(logits, labels, torch.tensor([[True]]), torch.tensor([[[1.0, 0, 0]]]), w)
    assert torch.isclose(masked, ce[0])


def test_sample_anchors_respects_loss_mask_and_bounds():
    lm = torch.zeros(2, 30, dtype=torch.long)
    lm[0, 10:25] = 1
    g = torch.Generator().manual_seed(0)
    a, v = sample_anchors(lm, 8, 8, generator=g)
    for p, ok in zip(a[0].tolist(), v[0].tolist()):
        if ok:
            assert 10 <= p <= 22 and p <= 30 - 8
    assert v[0].sum() == 8 and v[1].sum() == 0  # second sequence has no response tokens


def test_nonfinite_step_is_skipped_on_device():
    """A NaN loss must leave weights and optimizer state untouched (no host read decides it)."""
    from types import SimpleNamespace

    from dflash.run.step import TrainStep

    d, embed, head = make(layers=1)
    d = d.float()
    from dflash.config import TrainConfig
    cfg = SimpleNamespace(train=TrainConfig(lr=1e-2, weight_decay=0.1, steps=10, warmup_ratio=0.0, grad_clip=1.0,
                                            seed=0, loss_gamma=0.0, loss="ce", loss_weights="decay"),
                          model=SimpleNamespace(block_size=BK))
    st = TrainStep(cfg.train, cfg.model.block_size, d, embed.float(), head.float(), "cpu")
    before = {k: v.clone() for k, v in d.state_dict().items()}
    for p in d.parameters():
        p.grad = torch.full_like(p, float("nan"))
    gnorm, skipped = st.optimizer_step(torch.tensor(float("nan")))
    assert bool(skipped)
    assert all(torch.equal(before[k], v) for k, v in d.state_dict().items())
    assert all(float(s["step"]) == 0 for s in st.opt.state.values())
    for p in d.parameters():  # a finite step does move the weights
        p.grad = torch.ones_like(p)
    _, skipped = st.optimizer_step(torch.tensor(1.0))
    assert not bool(skipped)
    assert not torch.equal(before["fc.weight"], d.state_dict()["fc.weight"])


def test_drafter_init_continues_the_target_at_its_deepest_fused_layer(tiny):
    """model.drafter_init=target: the context the drafter's first layer reads is exactly
    what the target's next layer reads (its input norm of the deepest fused hidden state),
    and that layer's weights, plus the final norm, are the target's."""
    from dflash.config import Config
    from dflash.model import target as target_mod
    from dflash.model.build import build_drafter
    from dflash.model.build import init_from_target

    cfg = Config()
    cfg.model.target, cfg.model.drafter_init = "tiny-qwen3", "target"
    target, tok = tiny
    ids = target_mod.default_layer_ids(target_mod.num_layers(target), 3)
    drafter = build_drafter(cfg, target, tok, ids)
    nxt = target.model.layers[max(ids) + 1]
    assert torch.equal(drafter.layers[0].q_proj.weight, nxt.self_attn.q_proj.weight)
    assert torch.equal(drafter.layers[0].k_norm.weight, nxt.self_attn.k_norm.weight)
    assert torch.equal(drafter.layers[0].down_proj.weight, nxt.mlp.down_proj.weight)
    assert torch.equal(drafter.norm.weight, target.model.norm.weight)
    input_ids = torch.randint(0, 1000, (2, 12))
    with torch.no_grad():
        hs = target(input_ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1] for i in ids], dim=-1)
        torch.testing.assert_close(drafter.fuse(feats), nxt.input_layernorm(hs[max(ids) + 1]))
    cfg.model.drafter_init = "random"
    copied = init_from_target(build_drafter(cfg, target, tok, ids), target)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.q_proj.weight"} <= set(copied)


def test_feature_cache_serves_repeated_sequences_without_a_target_forward(monkeypatch, tiny):
    """train.feature_cache: a batch of sequences seen before is assembled from the cache
    (no target forward), with the features a forward gives on the valid tokens and zeros
    on padding; a batch with one new sequence runs the forward."""
    from dflash.data.batch import Batch
    from dflash.model import target as target_mod
    from dflash.model.feature_cache import FeatureCache
    from dflash.model import features as features_mod
    from dflash.model.features import target_features

    target, tok = tiny
    ids = target_mod.default_layer_ids(target_mod.num_layers(target), 3)
    cache = FeatureCache(ids)

    def batch(rows, width=10):
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        am = torch.zeros_like(input_ids)
        for i, r in enumerate(rows):
            input_ids[i, :len(r)], am[i, :len(r)] = torch.tensor(r), 1
        return Batch(index=0, input_ids=input_ids, attention_mask=am, loss_mask=am.clone(),
                     lengths=[len(r) for r in rows])

    a, b, c = list(range(5, 13)), list(range(40, 46)), list(range(70, 79))
    src: dict = {}
    first = target_features(target, batch([a, b]), ids, "cpu", cache=cache, source=src)
    assert src == {"features": "forward"}  # the model_forward span says which (bench/architectures.py reads it)
    calls = []
    real = features_mod.capture  # the target's forward (stopped after the deepest selected layer)
    monkeypatch.setattr(features_mod, "capture", lambda *x, **k: calls.append(1) or real(*x, **k))
    again = target_features(target, batch([b, a], width=9), ids, "cpu", cache=cache, source=src)
    assert src == {"features": "cache"}
    assert not calls and again.shape == (2, 9, first.shape[-1])
    torch.testing.assert_close(again[0, :6], first[1, :6])
    torch.testing.assert_close(again[1, :8], first[0, :8])
    assert not again[0, 6:].any()
    target_features(target, batch([a, c]), ids, "cpu", cache=cache)
    assert calls == [1]
    target_features(target, batch([b, a], width=9), ids, "cpu")  # no cache (the default): a forward
    assert calls == [1, 1]

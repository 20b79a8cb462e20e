"""bench/recipe_step.py's FLOP model, which its TFLOP/s and MFU figures rest on: against a hand
count, and against torch's FlopCounterMode on the real modules (the drafter's forward and
backward, the target's capture forward with and without the early stop), exactly."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from helpers import load_bench

rs = load_bench("recipe_step")


def test_flop_model_by_hand():
    # a drafter layer of hidden 8, 2 heads of 4, 1 KV head, MLP 16, vocab 10; 2 fused layers;
    # 1 sequence of 12 tokens, 2 anchors (positions 2 and 5: mean context 3.5), block 3
    g = rs.Geometry(hidden=8, layers=3, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10)
    assert g.attn_params == 8 * 8 + 2 * 8 * 4 + 8 * 8 == 192      # q, k, v, o
    assert g.mlp_params == 3 * 8 * 16 == 384
    r = rs.Recipe(seqs=1, seq_len=12, anchors=2, block=3, drafter_layers=1, fused=2, head_cols=10, mean_context=3.5)
    f = rs.drafter_flops(g, r)
    fwd = f["forward"]
    assert fwd["fc"] == 2 * 12 * 16 * 8                 # 12 context tokens x (16 -> 8)
    assert fwd["context_kv"] == 2 * 12 * 8 * 8          # k and v: 8 -> 4 each
    assert fwd["block"] == 2 * 6 * 192                  # 2 blocks x 3 tokens
    assert fwd["mlp"] == 2 * 6 * 384
    assert fwd["attention"] == 4 * 2 * 4 * 6 * (3.5 + 3)  # QK^T and AV: 6 queries x (context + own block)
    assert fwd["head"] == 2 * 4 * 8 * 10                 # 2 blocks x 2 scored slots, frozen head
    bwd = f["backward"]
    assert bwd["fc"] == fwd["fc"] and bwd["head"] == fwd["head"]  # weight only / input only
    assert bwd["block"] == 2 * fwd["block"] and bwd["attention"] == 2 * fwd["attention"]
    dense = rs.drafter_flops(g, r, dense_attention=True)["forward"]["attention"]
    assert dense == 4 * 2 * 4 * 6 * (12 + 6)             # every pair the bool mask spans
    # the target: 3 layers over 12 tokens, causal attention at half the pairs
    assert rs.target_forward_flops(g, 1, 12) == 3 * (2 * 12 * (192 + 384) + 4 * 2 * 4 * 12 * 12 * 0.5)
    assert rs.target_forward_flops(g, 1, 12, layers_run=2) == 2 / 3 * rs.target_forward_flops(g, 1, 12)


def test_drafter_flops_equal_the_counted_ones():
    from dflash.model.drafter import DFlashDrafter, DrafterConfig

    g = rs.Geometry(hidden=32, layers=4, heads=4, kv_heads=2, head_dim=8, intermediate=48, vocab=100)
    cfg = DrafterConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        intermediate_size=48, vocab_size=100, target_layer_ids=[0, 1], mask_token_id=5,
                        num_hidden_layers=2, block_size=4)
    torch.manual_seed(0)
    d = DFlashDrafter(cfg)
    embed = torch.nn.Embedding(100, 32).requires_grad_(False)
    head = torch.nn.Linear(32, 100, bias=False).requires_grad_(False)
    S = 20
    feats, ids = torch.randn(2, S, 64), torch.randint(0, 99, (2, S))
    anchors = torch.tensor([[2, 7, 11], [4, 9, 16]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    # the math backend: attention as bmm, which the counter sees (SDPA's fused CPU kernel it does not)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fwd:
        logits = d.train_forward(feats, ids, anchors, valid, embed, head)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as bwd:
        logits.float().logsumexp(-1).sum().backward()
    r = rs.Recipe(seqs=2, seq_len=S, anchors=3, block=4, drafter_layers=2, fused=2, head_cols=100,
                  mean_context=float(anchors.float().mean()))
    model = rs.drafter_flops(g, r, dense_attention=True)  # SDPA with a bool mask computes every pair
    assert fwd.get_total_flops() == model["forward_total"]
    assert bwd.get_total_flops() == model["backward_total"]


@pytest.mark.parametrize("stop_early", [False, True])
def test_target_forward_flops_equal_the_counted_ones(tiny, stop_early, monkeypatch):
    from dflash.model import features as Fm

    model, _ = tiny
    c = model.config
    g = rs.Geometry(hidden=c.hidden_size, layers=c.num_hidden_layers, heads=c.num_attention_heads,
                    kv_heads=c.num_key_value_heads, head_dim=c.head_dim, intermediate=c.intermediate_size,
                    vocab=c.vocab_size)
    monkeypatch.setattr(Fm, "STOP_EARLY", stop_early)
    ids = torch.randint(0, 1000, (2, 24))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        Fm.capture(model, ids, torch.ones_like(ids), [1, 3])
    layers = 4 if stop_early else 6  # through layer 3, or all six
    # the math backend computes the causal scores densely: every pair
    assert fc.get_total_flops() == rs.target_forward_flops(g, 2, 24, layers_run=layers, causal_fraction=1.0)

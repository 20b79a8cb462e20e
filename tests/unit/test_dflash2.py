"""DFlash2 (model/dflash2.py): vLLM 0.32's semantics on tiny dims, one-pass training equals
per-block inference, the selector walk, the loss, and the served format both ways."""
import json
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash.checkpoint import export_format as fmt
from dflash.model.architectures import make_drafter
from dflash.model.dflash2 import DFlash2Drafter, walk
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.objective import slot_labels
from helpers import check_one_pass_equals_per_block

H, V, BK = 64, 101, 6

# a served DFlash2 config.json as vLLM reads it: the field names of z-lab's published
# checkpoint (dflash_config), on tiny dims
SERVED = {
    "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": H,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
    "num_hidden_layers": 2, "vocab_size": V, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "is_causal": False,
    "dflash_config": {"target_layer_ids": [0, 2, 3], "mask_token_id": V - 1, "block_size": BK,
                      "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 5,
                      "output_multiplier": 1.0, "final_logit_softcapping": 0.0, "input_embedding_scale": 1.0,
                      "is_causal": False},
}


def make(seed=0, randomize=True, **over):
    raw = json.loads(json.dumps(SERVED))
    if "layer_types" in over:  # top level, as vLLM reads it; the window in dflash_config
        raw["layer_types"] = over.pop("layer_types")
    raw["dflash_config"].update(over)
    cfg = DrafterConfig(**fmt.drafter_config_fields(raw, "test"))
    torch.manual_seed(seed)
    d = make_drafter(cfg)
    assert isinstance(d, DFlash2Drafter)
    if randomize:  # off identity, so the convolutions matter
        with torch.no_grad():
            for name, p in d.named_parameters():
                if "conv" in name or "codebook" in name:
                    p.add_(torch.randn_like(p) * 0.3)
    d = d.double()
    embed = nn.Embedding(V, H).double()
    head = nn.Linear(H, V, bias=False).double()
    return d, embed, head


def test_built_from_the_served_field_names():
    d, _, _ = make(randomize=False)
    c = d.cfg
    assert (c.arch, c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == \
        ("dflash2", 2, 16, 8, 5)
    sd = d.state_dict()
    assert sd["layers.0.attention_conv.base_kernel"].shape == (2, 2, H)
    assert sd["layers.1.mlp_conv.kernel_projection.weight"].shape == (2 * 2 * H // 16, H)
    assert sd["candidate_selector.predecessor_codebook"].shape == (V, 8)
    assert sd["candidate_selector.hidden_projection.weight"].shape == (8, H)


def test_fresh_dflash2_is_the_dflash_it_wraps():
    """Identity convolutions at init: the same decoder weights give DFlash's logits."""
    d2, embed, head = make(randomize=False)
    base = DFlashDrafter(DrafterConfig(**{**d2.cfg.to_dict(), "arch": "dflash"})).double()
    base.load_state_dict({k: v for k, v in d2.state_dict().items() if k in base.state_dict()})
    feats = torch.randn(1, 20, 3 * H, dtype=torch.float64)
    ids = torch.randint(0, V - 1, (1, 20))
    a, valid = torch.tensor([[2, 9]]), torch.ones(1, 2, dtype=torch.bool)
    assert torch.allclose(d2.slot_outputs(feats, ids, a, valid, embed, head)[0],
                          base.slot_outputs(feats, ids, a, valid, embed, head)[0], atol=1e-10)


def vllm_grouped_conv(x, delta, base, block_size, groups, group_size, taps):
    """vLLM 0.32's CPU path (qwen3_dflash2._grouped_conv) on flattened rows, slot = row % block."""
    blocks = x.unflatten(-1, (groups, group_size))
    coeff = base.view(1, taps, groups, group_size) + delta.unsqueeze(-1)
    out = coeff[:, 0] * blocks
    pos = torch.arange(x.shape[0]) % block_size
    for t in range(1, taps):
        out = out + coeff[:, t] * F.pad(blocks[:-t], (0, 0, 0, 0, t, 0)) * (pos >= t).view(-1, 1, 1)
    return out.flatten(-2)


def test_grouped_conv_is_vllms_on_flattened_rows():
    d, _, _ = make(conv_kernel_size=3)
    conv = d.layers[0].attention_conv
    x = torch.randn(2, 3 * BK, H, dtype=torch.float64)  # 2 sequences x 3 blocks
    y, c1 = conv.prepare(x)
    flat = x.flatten(0, 1)
    coeff = conv.kernel_projection(flat).view(-1, 2, 3, conv.groups)
    ref = vllm_grouped_conv(flat, coeff[:, 0], conv.base_kernel[0], BK, conv.groups, 16, 3)
    assert torch.allclose(y.flatten(0, 1), ref, atol=1e-12)
    ref1 = vllm_grouped_conv(flat, coeff[:, 1], conv.base_kernel[1], BK, conv.groups, 16, 3)
    assert torch.allclose(conv.finish(x, c1).flatten(0, 1), ref1, atol=1e-12)


def per_block(d, embed, head, feats, ids, p):
    ctx = d.fuse(feats[:, :p])
    kv = d.context_kv(ctx, torch.arange(p)[None])
    return kv


@pytest.mark.parametrize("over", [{}, {"output_multiplier": 0.5, "final_logit_softcapping": 7.0,
                                       "input_embedding_scale": 1.7},
                                  # a sliding layer (as z-lab's released DFlash2 has), window inside the block
                                  {"layer_types": ["sliding_attention", "full_attention"], "swa_window_size": 5}],
                         ids=["plain", "scaled", "sliding"])
def test_one_pass_training_forward_matches_per_block_inference(over):
    d, embed, head = make(**over)

    def block_logits(feats, ids, p):
        kv = per_block(d, embed, head, feats, ids, p)
        ref = d.draft_logits(ids[:, p], p, kv, embed, head)
        # the candidates the inference walk scores are the top-k of those same logits
        cand, unary, _ = d.candidates(ids[:, p], p, kv, embed, head)
        top = ref[0].topk(d.cfg.selector_top_k, -1)
        assert torch.equal(cand[0], top.indices) and torch.allclose(unary[0], top.values, atol=1e-9)
        return ref

    check_one_pass_equals_per_block(d, embed, head, block_logits, hidden=H, vocab=V, block=BK, atol=1e-9)


def test_walk_follows_the_previous_pick_and_draft_uses_it():
    d, embed, head = make()
    S = 24
    feats = torch.randn(2, S, 3 * H, dtype=torch.float64)
    p = 10
    kv = d.context_kv(d.fuse(feats[:, :p]), torch.arange(p).expand(2, p))
    anchor = torch.tensor([5, 7])
    cand, unary, scores = d.candidates(anchor, p, kv, embed, head)
    assert scores.shape == (2, BK - 1, 5, 5)
    # by hand, vLLM's kernel: prev = 0; idx = argmax(scores[l, prev]); prev = idx
    for b in range(2):
        prev, want = 0, []
        for l in range(BK - 1):
            idx = int(scores[b, l, prev].argmax())
            want.append(int(cand[b, l, idx]))
            prev = idx
        assert d.draft(anchor, p, kv, embed, head)[b].tolist() == want
    # slot 0's predecessor is the anchor: every row of its score matrix is the same
    assert torch.allclose(scores[:, 0, 0], scores[:, 0, 3])
    # the edge term matters: a different anchor changes slot 0's scores
    other = d.candidates(torch.tensor([6, 8]), p, kv, embed, head)[2]
    assert not torch.allclose(other[:, 0], scores[:, 0])


def test_walk_with_a_pick_rule():
    cand = torch.tensor([[[4, 5], [6, 7], [8, 9]]])
    scores = torch.zeros(1, 3, 2, 2)
    scores[0, 0, 0] = torch.tensor([0.0, 1.0])   # -> 5 (index 1)
    scores[0, 1, 1] = torch.tensor([2.0, 0.0])   # from index 1 -> 6 (index 0)
    scores[0, 2, 0] = torch.tensor([0.0, 3.0])   # from index 0 -> 9
    assert walk(cand, scores)[0].tolist() == [[5, 6, 9]]


def test_selector_loss_trains_the_selector_and_injects_the_missing_gold():
    d, embed, head = make()
    d = d.float()
    embed, head = embed.float(), head.float()
    S = 30
    feats = torch.randn(2, S, 3 * H)
    ids = torch.randint(0, V - 1, (2, S))
    anchors = torch.tensor([[2, 11], [5, 20]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    labels = slot_labels(ids, anchors, d.cfg.block_size)
    logits, ce = d.train_terms(feats, ids, anchors, valid, embed, head, labels)
    assert ce.shape == labels.shape and torch.isfinite(ce).all() and (ce > 0).all()
    ce.sum().backward()
    g = d.candidate_selector.successor_codebook.grad
    assert g is not None and g[labels.flatten()].abs().sum() > 0  # every gold token's row is in some loss
    assert d.candidate_selector.hidden_projection.weight.grad.abs().sum() > 0


def test_export_import_round_trip(tmp_path):
    from safetensors.torch import save_file

    from dflash.checkpoint import drafter_dirs

    d, _, _ = make()
    d = d.float()
    tc = type("T", (), {"num_hidden_layers": 4, "max_position_embeddings": 512, "rope_parameters": None,
                        "rope_scaling": None})()
    cfg = fmt.export_config(d.cfg, tc, dtype="float32")
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
    dc = cfg["dflash_config"]
    assert {k: dc[k] for k in ("block_size", "conv_kernel_size", "conv_group_size", "selector_rank",
                               "selector_top_k")} == {"block_size": BK, "conv_kernel_size": 2,
                                                      "conv_group_size": 16, "selector_rank": 8,
                                                      "selector_top_k": 5}
    tensors = fmt.export_state_dict(d.state_dict())
    assert "layers.0.attention_conv.kernel_projection.weight" in tensors
    assert "candidate_selector.successor_codebook" in tensors
    assert "layers.0.self_attn.q_proj.weight" in tensors
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    back = drafter_dirs.load(drafter_dirs.inspect(str(tmp_path)))
    assert isinstance(back, DFlash2Drafter)
    assert back.cfg.selector_top_k == 5 and back.cfg.arch == "dflash2"
    a, b = d.state_dict(), back.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_bad_dflash2_configs_are_one_line():
    from dflash.errors import ConfigError

    with pytest.raises(ConfigError, match="conv_group_size=24 must divide"):
        make(conv_group_size=24)
    raw = json.loads(json.dumps(SERVED))
    del raw["dflash_config"]["selector_rank"]
    with pytest.raises(fmt.FormatError, match="selector_rank"):
        fmt.drafter_config_fields(raw, "x")


@pytest.mark.parametrize("where, key, value", [
    ("dflash_config", "block_size", "16"), ("dflash_config", "block_size", 8.5), ("top", "num_attention_heads", True),
    ("dflash_config", "target_layer_ids", ["1"]), ("top", "rms_norm_eps", "1e-6"),
    ("dflash_config", "selector_rank", "64"), ("dflash_config", "conv_kernel_size", 2.0)])
def test_a_hand_edited_field_of_the_wrong_json_type_is_named_not_converted(where, key, value):
    """int("16") is 16 and int(8.5) is 8: a served config is read as vLLM would get it, never coerced."""
    raw = json.loads(json.dumps(SERVED))
    (raw["dflash_config"] if where == "dflash_config" else raw)[key] = value
    named = value[0] if isinstance(value, list) else value  # a list's element is named
    with pytest.raises(fmt.FormatError, match=re.escape(f"{named!r}: expected a")):
        fmt.drafter_config_fields(raw, "x")


def test_sampled_chain_draws_each_slot_from_its_selector_row():
    from dflash.decode import sampling

    d, embed, head = make()
    p = 8
    feats = torch.randn(1, p, 3 * H, dtype=torch.float64)
    kv = d.context_kv(d.fuse(feats), torch.arange(p)[None])
    anchor = torch.tensor([3])
    cand, _, scores = d.candidates(anchor, p, kv, embed, head)
    g = torch.Generator().manual_seed(0)
    tokens, q = d.sample_chain(anchor, p, kv, embed, head, lambda x: sampling.probs(x, 0.9), g)
    assert q.shape == (BK - 1, V) and torch.allclose(q.sum(-1), torch.ones(BK - 1, dtype=q.dtype))
    prev = 0
    for l, t in enumerate(tokens.tolist()):
        assert set(q[l].nonzero().flatten().tolist()) <= set(cand[0, l].tolist())  # mass on the k candidates
        want = sampling.probs(scores[0, l, prev], 0.9)  # the row of the previous pick
        assert torch.allclose(q[l, cand[0, l]], want)
        prev = cand[0, l].tolist().index(t)


def test_chain_drafts_of_many_blocks_are_the_per_block_drafts():
    d, embed, head = make()
    S = 36
    feats = torch.randn(1, S, 3 * H, dtype=torch.float64)
    ids = torch.randint(0, V - 1, (1, S))
    anchors = torch.tensor([[4, 13, 25]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    logits, h = d.slot_outputs(feats, ids, anchors, valid, embed, head)
    chains = d.chain_drafts(logits, h, torch.gather(ids, 1, anchors))
    for j, p in enumerate(anchors[0].tolist()):
        kv = d.context_kv(d.fuse(feats[:, :p]), torch.arange(p)[None])
        assert chains[0, j].tolist() == d.draft(ids[:, p], p, kv, embed, head)[0].tolist()


def test_selector_loss_through_a_loss_vocabulary_head():
    """train.loss_vocab: logits over a subset of rows (RowsHead); candidates map back to token ids."""
    from dflash.model.loss_vocab import RowsHead

    d, embed, head = make()
    S = 30
    feats = torch.randn(1, S, 3 * H, dtype=torch.float64)
    ids = torch.randint(0, 40, (1, S))
    anchors, valid = torch.tensor([[3, 14]]), torch.ones(1, 2, dtype=torch.bool)
    rows = RowsHead(head, torch.arange(0, 60))  # the batch's tokens (< 40) and more
    labels = slot_labels(ids, anchors, d.cfg.block_size)
    logits, sub = d.train_terms(feats, ids, anchors, valid, embed, rows, labels)
    assert logits.shape[-1] == 60 and torch.isfinite(sub).all()
    _, full = d.train_terms(feats, ids, anchors, valid, embed, head, labels)
    # the k-way CE differs only through which candidates the subset's top-k holds: same where equal
    assert sub.shape == full.shape

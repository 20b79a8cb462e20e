"""Sliding-window drafter layers (docs/architectures.md, "Sliding-window layers"): the
one-pass training mask and the decoder's context cache + block apply one window, vLLM's:
the query at position t sees key position j only when |t - j| <= W - 1; the export says
so in the fields vLLM 0.32 reads."""
import pytest
import torch
from torch import nn

from dflash.checkpoint import export_format as fmt
from dflash.config import load_config
from dflash.errors import ConfigError
from dflash.model.drafter import DFlashDrafter, DrafterConfig

H, V, BK, W = 64, 101, 8, 16
MIXED = ["sliding_attention", "full_attention"]
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast")  # float64 test weights


def make(layer_types=MIXED, window=W, block=BK, seed=0):
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        intermediate_size=128, vocab_size=V, target_layer_ids=[0, 2, 3],
                        mask_token_id=V - 1, num_hidden_layers=len(layer_types), block_size=block,
                        layer_types=list(layer_types), sliding_window=window)
    d = DFlashDrafter(cfg).double()
    return d, nn.Embedding(V, H).double(), nn.Linear(H, V, bias=False).double()


def decode_logits(d, embed, head, feats, ids, p):
    """One block as spec decoding drafts it: the whole context 0..p-1 in the cache."""
    kv = d.context_from_features(feats[:, :p], torch.arange(p)[None], embed)
    return d.draft_logits(ids[:, p], p, kv, embed, head)


@pytest.mark.parametrize("layer_types,window,block", [(MIXED, W, BK), (["sliding_attention"] * 2, 5, BK)],
                         ids=["mixed-w16", "all-sliding-w5-inside-block"])
def test_training_mask_equals_decoding_with_windows(layer_types, window, block):
    d, embed, head = make(layer_types, window, block)
    S = 60  # contexts longer than the window
    torch.manual_seed(1)
    feats = torch.randn(1, S, 3 * H, dtype=torch.float64)
    ids = torch.randint(0, V - 1, (1, S))
    anchors = torch.tensor([[3, 17, 30, 44, S - block]])
    logits = d.train_forward(feats, ids, anchors, torch.ones_like(anchors, dtype=torch.bool), embed, head)
    for j, p in enumerate(anchors[0].tolist()):
        ref = decode_logits(d, embed, head, feats, ids, p)
        assert torch.allclose(logits[0, j], ref[0], atol=1e-6), f"block at anchor {p} differs"


def test_window_hides_context_beyond_it_and_matters():
    d, embed, head = make(["sliding_attention"] * 2)
    S, p = 60, 44
    torch.manual_seed(2)
    feats = torch.randn(1, S, 3 * H, dtype=torch.float64)
    ids = torch.randint(0, V - 1, (1, S))
    ref = decode_logits(d, embed, head, feats, ids, p)
    far = feats.clone()
    far[:, : p - W + 1] += 5.0  # no slot of the block at p sees these (slot 0 sees p-W+1 .. p-1)
    assert torch.allclose(decode_logits(d, embed, head, far, ids, p), ref, atol=1e-9)
    near = feats.clone()
    near[:, p - W + 1] += 5.0   # the oldest position slot 0 still sees
    assert not torch.allclose(decode_logits(d, embed, head, near, ids, p), ref, atol=1e-6)
    full = DFlashDrafter(DrafterConfig(**{**d.cfg.to_dict(), "layer_types": [], "sliding_window": 0})).double()
    full.load_state_dict(d.state_dict())  # same weights, whole context: differs
    assert not torch.allclose(decode_logits(full, embed, head, feats, ids, p), ref, atol=1e-6)


def test_block_mask_window_off_by_one():
    anchors = torch.tensor([[20, 40]])
    m = DFlashDrafter.block_mask(anchors, torch.tensor([[True, True]]), S=50, Bk=4, window=6)[0, 0]
    for q in range(8):
        blk, k = divmod(q, 4)
        p = anchors[0, blk].item()
        t = p + k
        assert m[q, :50].nonzero().flatten().tolist() == list(range(t - 5, p)), "context t-W+1 .. p-1"
        assert m[q, 50:].nonzero().flatten().tolist() == [blk * 4 + i for i in range(4)], "whole own block"


def test_config_keys_are_validated_in_one_line():
    cfg = load_config(None, ["model.num_layers=2", "model.layer_types=sliding_attention,full_attention",
                             "model.sliding_window=2048"])
    assert cfg.model.layer_types == MIXED and cfg.model.sliding_window == 2048
    for sets, says in ((["model.layer_types=sliding"], "'sliding': expected sliding_attention or full_attention"),
                       (["model.num_layers=2", "model.layer_types=sliding_attention"], "1 entries for model.num_layers=2"),
                       (["model.layer_types=sliding_attention"], "model.sliding_window=0: expected >= 1"),
                       (["model.sliding_window=64"], "without a sliding_attention layer"),
                       (["model.layer_types=sliding_attention", "model.sliding_window=-1"], "model.sliding_window=-1")):
        with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("]", r"\]")) as e:
            load_config(None, sets)
        assert "\n" not in str(e.value)


def test_export_writes_what_vllm_reads_and_reads_it_back():
    from transformers import Qwen3Config

    d, _, _ = make(MIXED, 2048)
    target = Qwen3Config(hidden_size=H, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=128, vocab_size=V)
    raw = fmt.export_config(d.cfg, target, dtype="float32")
    assert raw["layer_types"] == MIXED and raw["sliding_window"] == 2048 and raw["use_sliding_window"] is True
    assert raw["is_causal"] is False
    assert raw["dflash_config"]["causal"] is False and raw["dflash_config"]["swa_window_size"] == 2048
    # transformers keeps them as written (it drops sliding_window without use_sliding_window)
    hf = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    assert hf.layer_types == MIXED and hf.sliding_window == 2048
    f = fmt.drafter_config_fields(raw, "x")
    assert f["layer_types"] == MIXED and f["sliding_window"] == 2048
    plain = fmt.export_config(make(["full_attention"] * 2, 0)[0].cfg, target, dtype="float32")
    assert "is_causal" not in plain and "layer_types" not in plain and plain["use_sliding_window"] is False
    assert fmt.drafter_config_fields(plain, "x")["layer_types"] == []


def test_served_configs_resolve_as_vllm_does():
    base = {"architectures": ["DFlashDraftModel"], "hidden_size": H, "num_attention_heads": 4, "num_hidden_layers": 2,
            "intermediate_size": 128, "vocab_size": V, "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1]}}
    two = ["sliding_attention"] * 2
    # SpecForge's Qwen3.6-27B DFlash2 layout: all sliding, is_causal false, window at the top level
    f = fmt.drafter_config_fields({**base, "layer_types": two, "sliding_window": 2048, "use_sliding_window": True,
                                   "is_causal": False}, "x")
    assert (f["layer_types"], f["sliding_window"]) == (two, 2048)
    # MiMo's way: use_swa + swa_window_size, no layer types -> every layer sliding, non-causal
    f = fmt.drafter_config_fields({**base, "dflash_config": {**base["dflash_config"], "use_swa": True,
                                                             "swa_window_size": 128}}, "x")
    assert (f["layer_types"], f["sliding_window"]) == (two, 128)
    with pytest.raises(fmt.FormatError, match="layer 0 attends causally"):  # no flag: vLLM runs them causal
        fmt.drafter_config_fields({**base, "layer_types": two, "sliding_window": 64, "use_sliding_window": True}, "x")
    with pytest.raises(fmt.FormatError, match="window None"):  # transformers drops it without use_sliding_window
        fmt.drafter_config_fields({**base, "layer_types": two, "sliding_window": 64, "is_causal": False}, "x")

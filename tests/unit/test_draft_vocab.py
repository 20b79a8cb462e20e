"""model.draft_vocab: a drafter that drafts from K tokens only, through their lm_head rows, and
an export that carries them as vLLM reads a draft vocabulary (`draft_vocab_size`,
`lm_head.weight` of K rows, `d2t` int64 offsets: target id = draft id + d2t[draft id])."""
import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

from helpers import small_drafter

H, V, BK, K = 64, 101, 4, 12


def _drafter(k=K):
    d = small_drafter(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                      vocab_size=V, mask_token_id=V - 1, block_size=BK, draft_vocab_size=k).eval()
    embed, head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
    ids = torch.tensor(sorted(torch.randperm(V - 1)[:k].tolist()))
    if k:
        d.set_draft_vocab(ids, head)
    return d, embed, head, ids


def _draft(d, embed, head, p=9, seed=1):
    torch.manual_seed(seed)
    feats = torch.randn(1, p, 2 * H)
    kv = d.context_from_features(feats, torch.arange(p)[None], embed)
    return d.draft(torch.tensor([3]), p, kv, embed, head)[0].tolist(), d.draft_logits(torch.tensor([3]), p, kv,
                                                                                       embed, head)[0]


def test_drafts_come_from_the_draft_vocabulary_as_the_full_head_restricted():
    d, embed, head, ids = _drafter()
    drafts, logits = _draft(d, embed, head)
    assert set(drafts) <= set(ids.tolist())
    full = _drafter(0)[0]
    full.load_state_dict({k: v for k, v in d.state_dict().items() if not k.startswith("draft_")})
    _, full_logits = _draft(full, embed, head)
    # the same network: its logits on the draft vocabulary, -inf elsewhere
    torch.testing.assert_close(logits[:, ids], full_logits[:, ids])
    outside = torch.ones(V, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(logits[:, outside]).all()
    assert drafts == ids[full_logits[:, ids].argmax(-1)].tolist()


def test_export_writes_what_vllm_reads_and_reads_it_back(tmp_path):
    from transformers import Qwen3Config

    from dflash.checkpoint import drafter_dirs
    from dflash.checkpoint.export import write_export

    d, embed, head, ids = _drafter()
    tcfg = Qwen3Config(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       intermediate_size=128, vocab_size=V, num_hidden_layers=4)
    out = write_export(d, tcfg, tmp_path / "export", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == K and cfg["vocab_size"] == V
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("lm_head.weight").shape == (K, H)
        d2t = f.get_tensor("d2t")
    assert d2t.dtype == torch.int64 and (torch.arange(K) + d2t).tolist() == ids.tolist()
    back = drafter_dirs.load(drafter_dirs.inspect(out))
    assert back.cfg.draft_vocab_size == K and back.draft_ids.tolist() == ids.tolist()
    torch.testing.assert_close(back.draft_head, head.weight[ids])
    assert _draft(back, embed, head)[0] == _draft(d, embed, head)[0]


def test_a_draft_vocabulary_with_a_copy_head_is_refused():
    from dflash.config import load_config
    from dflash.errors import ConfigError

    with pytest.raises(ConfigError, match="model.draft_vocab"):
        load_config(None, ["model.draft_vocab=64", "model.copy_head=true"])

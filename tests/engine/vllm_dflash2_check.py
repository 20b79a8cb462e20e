"""Run in vLLM's venv (tests/engine/test_dflash2_vllm.py): vLLM 0.32's DFlash2 module classes
with our export's weights, on what our drafter recorded for two blocks; prints one JSON line.

argv: EXPORT_DIR RECORD_PT. The record holds the blocks' token embeddings (before the input
scale), positions, and per layer the attention's input and output as our drafter computed
them (attention itself is DFlash's, checked by the other engine tests), the target's lm_head,
the anchors, and our final hidden states, candidates, unary scores, edge scores and drafts.

vLLM runs its own layer (DFlash2Qwen3DecoderLayer.forward: RMSNorm with the fused residual,
the grouped convolutions on flattened rows, its Qwen3 MLP), final norm, the candidate head
(LogitsProcessor.get_top_k_tokens with output_multiplier and the soft cap) and
CandidateSelector; the greedy walk is its Triton kernel's rule (the kernel needs a GPU)."""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel


def main(export: str, record: str) -> None:
    cfg = json.loads((Path(export) / "config.json").read_text())
    dc = cfg["dflash_config"]
    weights = load_file(str(Path(export) / "model.safetensors"))
    rec = torch.load(record, weights_only=True)
    vc = VllmConfig()
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{rec['port']}", backend="gloo")
        initialize_model_parallel(1, 1)
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
        from vllm.model_executor.models.qwen2 import Qwen2MLP
        from vllm.model_executor.models.qwen3_dflash2 import (CandidateSelector, DFlash2Qwen3DecoderLayer,
                                                              DFlashGroupedConv)

        H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
        Bk = int(dc["block_size"])  # vLLM: 1 + num_speculative_tokens, served as block_size - 1
        used = set()

        def load(module, prefix):
            for name, p in module.named_parameters():
                key = f"{prefix}.{name}"
                loader = getattr(p, "weight_loader", None)
                if name == "gate_up_proj.weight":
                    for shard, part in enumerate(("gate_proj", "up_proj")):
                        k = f"{prefix}.{part}.weight"
                        loader(p, weights[k], shard)
                        used.add(k)
                    continue
                assert key in weights, f"vLLM parameter {key} has no exported weight"
                (loader or (lambda q, w: q.data.copy_(w)))(p, weights[key])
                used.add(key)

        class Layer(torch.nn.Module):
            """The attributes DFlash2Qwen3DecoderLayer.forward reads, built from vLLM's classes."""

            def __init__(self, i):
                super().__init__()
                conv = dict(hidden_size=H, taps=int(dc["conv_kernel_size"]), group_size=int(dc["conv_group_size"]),
                            block_size=Bk, params_dtype=torch.float32)
                self.input_layernorm = RMSNorm(H, eps=cfg["rms_norm_eps"])
                self.post_attention_layernorm = RMSNorm(H, eps=cfg["rms_norm_eps"])
                self.attention_conv = DFlashGroupedConv(**conv, prefix=f"layers.{i}.attention_conv")
                self.mlp_conv = DFlashGroupedConv(**conv, prefix=f"layers.{i}.mlp_conv")
                self.mlp = Qwen2MLP(hidden_size=H, intermediate_size=cfg["intermediate_size"], hidden_act="silu",
                                    prefix=f"layers.{i}.mlp")
                for part in ("input_layernorm", "post_attention_layernorm", "attention_conv", "mlp_conv", "mlp"):
                    load(getattr(self, part), f"layers.{i}.{part}")
                self.i = i
                self.attn_err = 0.0

            def self_attn(self, positions, hidden_states):
                # our attention's input must be what vLLM's layer hands its attention
                self.attn_err = float((hidden_states - rec["attn_in"][self.i]).abs().max())
                return rec["attn_out"][self.i]

        layers = [Layer(i) for i in range(L)]
        norm = RMSNorm(H, eps=cfg["rms_norm_eps"])
        load(norm, "norm")
        selector = CandidateSelector(vllm_config=vc, hidden_size=H, vocab_size=V, rank=int(dc["selector_rank"]),
                                     top_k=int(dc["selector_top_k"]), params_dtype=torch.float32,
                                     prefix="candidate_selector")
        load(selector, "candidate_selector")
        head = ParallelLMHead(V, H, prefix="lm_head", params_dtype=torch.float32)
        head.weight_loader(head.weight, rec["lm_head"])
        for root in (*layers, norm, selector, head):  # as vLLM's loader does (CPU: picks the GEMM)
            for m in root.modules():
                qm = getattr(m, "quant_method", None)
                if qm is not None and hasattr(qm, "process_weights_after_loading"):
                    qm.process_weights_after_loading(m)
        cap = float(dc.get("final_logit_softcapping") or 0.0)
        lp = LogitsProcessor(V, scale=float(dc.get("output_multiplier", 1.0)), soft_cap=cap if cap > 0 else None)

        with torch.no_grad():
            hidden = rec["emb"] * float(dc.get("input_embedding_scale", 1.0))  # [rows, H], rows = 2 blocks
            residual = None
            for layer in layers:
                hidden, residual = DFlash2Qwen3DecoderLayer.forward(layer, rec["positions"], hidden, residual)
            final, _ = norm(hidden, residual)
            R = final.shape[0] // Bk
            h = final.view(R, Bk, H)[:, 1:]  # the mask slots (sample_from_anchor: false)
            cand, unary = lp.get_top_k_tokens(head, h.flatten(0, 1), selector.top_k)
            cand, unary = cand.view(R, Bk - 1, -1), unary.view(R, Bk - 1, -1)
            scores = selector.forward(cand, unary, h, rec["anchors"])
            drafts = []
            for r in range(R):  # _selector_walk_kernel at temperature 0
                prev, out = 0, []
                for step in range(Bk - 1):
                    idx = int(scores[r, step, prev].argmax())
                    out.append(int(cand[r, step, idx]))
                    prev = idx
                drafts.append(out)

        dflash_own = {k for k in weights if ".self_attn." in k or k in ("fc.weight", "hidden_norm.weight")}
        unused = sorted(set(weights) - used - dflash_own)  # attention and context fusion: DFlash's
        print(json.dumps({
            "architectures": cfg["architectures"],
            "attn_in_err": max(layer.attn_err for layer in layers),
            "hidden_err": float((final.view(R, Bk, H) - rec["final"]).abs().max()),
            "candidates_equal": bool(torch.equal(cand, rec["cand"])),
            "unary_err": float((unary - rec["unary"]).abs().max()),
            "scores_err": float((scores - rec["scores"]).abs().max()),
            "drafts": drafts, "ours": rec["drafts"].tolist(),
            "unused_weights": unused,
        }))


if __name__ == "__main__":
    main(*sys.argv[1:3])

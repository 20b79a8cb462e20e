"""Run in vLLM's venv (tests/engine/test_dspark_vllm.py): vLLM 0.32's own DSpark pieces with our
export's weights, on what our drafter recorded for two blocks; prints one JSON line.

argv: EXPORT_DIR RECORD_PT. With a draft vocabulary (`draft_vocab_size` in config.json) vLLM's
head is the exported `lm_head.weight`, its picks are mapped to target ids by `d2t`, and the
record's logits and biases are ours on the draft tokens' columns. The record holds the blocks' final hidden states at the mask slots
(the backbone is DFlash's Qwen3 stack, which the other engine tests serve), the target's
lm_head, the anchors, and our base logits, greedy drafts, each slot's Markov bias (from the
draft before it) and confidence.

vLLM's side: DSparkMarkovHead and DSparkConfidenceHead (model_executor/models/qwen3_dspark.py)
built as Qwen3DSparkModel builds them from our config.json, loaded by our exported names, and
driven through Qwen3DSparkForCausalLM's own methods (compute_draft_logits, markov_embed,
markov_bias, compute_confidence) in the loop of its GPU speculator's `_sample_sequential` at
temperature 0 (argmax; that runner needs a GPU, the loop is a few lines)."""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel


def main(export: str, record: str) -> None:
    cfg = json.loads((Path(export) / "config.json").read_text())
    weights = load_file(str(Path(export) / "model.safetensors"))
    rec = torch.load(record, weights_only=True)
    vc = VllmConfig()
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{rec['port']}", backend="gloo")
        initialize_model_parallel(1, 1)
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
        from vllm.model_executor.models.qwen3_dspark import (DSparkConfidenceHead, DSparkMarkovHead,
                                                             Qwen3DSparkForCausalLM)

        H, V, r = cfg["hidden_size"], cfg["vocab_size"], cfg["markov_rank"]
        used = set()

        def load(module, prefix):
            for name, p in module.named_parameters():
                key = f"{prefix}.{name}"
                assert key in weights, f"vLLM parameter {key} has no exported weight"
                loader = getattr(p, "weight_loader", None) or (lambda q, w: q.data.copy_(w))
                loader(p, weights[key].to(p.dtype))
                used.add(key)

        # as Qwen3DSparkModel.__init__ builds them from the config
        markov = DSparkMarkovHead(V, cfg.get("draft_vocab_size") or V, r, prefix="markov_head")
        load(markov, "markov_head")
        conf = None
        if cfg.get("enable_confidence_head"):
            with_markov = cfg.get("confidence_head_with_markov", False)
            conf = DSparkConfidenceHead(H + (r if with_markov else 0), prefix="confidence_head", bias=True,
                                        with_markov=with_markov)
            load(conf, "confidence_head")
        DV = cfg.get("draft_vocab_size") or V
        head = ParallelLMHead(DV, H, prefix="lm_head", params_dtype=torch.float32)
        d2t = None
        if DV < V:  # a reduced vocabulary: the drafter's own head and d2t, as Qwen3DSparkForCausalLM loads them
            head.weight_loader(head.weight, weights["lm_head.weight"])
            d2t = weights["d2t"].long()
            used.update({"lm_head.weight", "d2t"})
        else:
            head.weight_loader(head.weight, rec["lm_head"])
        for root in (markov, head, *([conf] if conf is not None else [])):  # as vLLM's loader does
            for m in root.modules():
                qm = getattr(m, "quant_method", None)
                if qm is not None and hasattr(qm, "process_weights_after_loading"):
                    qm.process_weights_after_loading(m)
        me = SimpleNamespace(model=SimpleNamespace(markov_head=markov, confidence_head=conf), lm_head=head,
                             logits_processor=LogitsProcessor(DV, scale=cfg.get("logit_scale", 1.0)),
                             draft_id_to_target_id=d2t)
        lm = Qwen3DSparkForCausalLM  # its methods, on the pieces above

        with torch.no_grad():
            hidden = rec["hidden"]                     # [R, n, H]: the mask slots (sample_from_anchor: false)
            R, n, _ = hidden.shape
            base = lm.compute_draft_logits(me, hidden.flatten(0, 1)).view(R, n, -1)
            prev = rec["anchors"]
            drafts, biases, embeds = [], [], []
            for i in range(n):  # DSparkSpeculator._sample_sequential, greedy
                e = lm.markov_embed(me, prev)
                embeds.append(e)
                bias = lm.markov_bias(me, e)
                biases.append(bias)
                prev = lm.map_draft_to_target(me, (base[:, i] + bias).argmax(-1))
                drafts.append(prev)
            drafts, biases = torch.stack(drafts, 1), torch.stack(biases, 1)
            confidence = None
            if conf is not None:
                confidence = lm.compute_confidence(me, hidden.flatten(0, 1),
                                                   torch.stack(embeds, 1).flatten(0, 1)).view(R, n)

        backbone = {k for k in weights if not k.startswith(("markov_head.", "confidence_head."))}
        unused = sorted(set(weights) - used - backbone)
        out = {"architectures": cfg["architectures"], "sample_from_anchor": cfg.get("sample_from_anchor"),
               "base_err": float((base - rec["base"]).abs().max()),
               "bias_err": float((biases - rec["bias"]).abs().max()),
               "drafts": drafts.tolist(), "ours": rec["drafts"].tolist(), "unused_weights": unused}
        if confidence is not None:
            out["confidence_err"] = float((confidence - rec["confidence"]).abs().max())
        print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:3])

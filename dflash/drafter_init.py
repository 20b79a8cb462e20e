"""Start the drafter from the target's own weights instead of random ones.

`model.drafter_init=target` copies, for drafter layer i of n, the target's decoder layer
L-n+i (the last ones: the layers closest to the lm_head the drafter shares), and the
target's final norm into the drafter's. Only tensors with the same role and shape are
copied: attention projections, the q/k norms where the target has them (Qwen3), the MLP
and the two layer norms. A target layer without attention projections (a linear-attention
layer of a hybrid model) is skipped. docs/demo-recipe.md measures what this buys.
"""
from __future__ import annotations

import torch

# drafter parameter -> the target layer's parameter (Llama / Qwen3 / Qwen3.5 names)
_LAYER_MAP = {
    "q_proj.weight": "self_attn.q_proj.weight", "k_proj.weight": "self_attn.k_proj.weight",
    "v_proj.weight": "self_attn.v_proj.weight", "o_proj.weight": "self_attn.o_proj.weight",
    "q_norm.weight": "self_attn.q_norm.weight", "k_norm.weight": "self_attn.k_norm.weight",
    "gate_proj.weight": "mlp.gate_proj.weight", "up_proj.weight": "mlp.up_proj.weight",
    "down_proj.weight": "mlp.down_proj.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
}


def _decoder(target):
    inner = getattr(target, "model", None)
    inner = getattr(inner, "language_model", inner)
    return inner


@torch.no_grad()
def init_from_target(drafter, target) -> list[str]:
    """Copy what fits; returns the names of the drafter tensors that were copied."""
    dec = _decoder(target)
    layers = list(getattr(dec, "layers", []))
    copied = []
    n = len(drafter.layers)
    attn_layers = [i for i, layer in enumerate(layers) if hasattr(getattr(layer, "self_attn", None), "q_proj")]
    chosen = attn_layers[-n:] if len(attn_layers) >= n else attn_layers
    for i, t_idx in enumerate(chosen):
        src = dict(layers[t_idx].named_parameters())
        for name, p in drafter.layers[i].named_parameters():
            t = src.get(_LAYER_MAP.get(name, ""))
            if t is not None and t.shape == p.shape:
                p.copy_(t.to(p.dtype))
                copied.append(f"layers.{i}.{name}")
    norm = getattr(dec, "norm", None)
    if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.shape == drafter.norm.weight.shape:
        drafter.norm.weight.copy_(norm.weight.to(drafter.norm.weight.dtype))
        copied.append("norm.weight")
    return copied

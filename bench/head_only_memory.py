"""What `dflash train --features` loads of a 27B target, against the whole model: the
model is built on the `meta` device (no memory, no download) from the geometry of
Qwen3.5-27B's text model, and its parameters are counted.

    .venv/bin/python bench/head_only_memory.py
"""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

# Qwen3.5-27B's text_config: 64 layers, three linear-attention layers to one full one
LAYERS = 64
CONFIG = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=LAYERS,
              num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_conv_kernel_dim=4,
              linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
              linear_num_value_heads=48, tie_word_embeddings=False,
              layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(LAYERS)])


def main() -> None:
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(Qwen3_5TextConfig(**CONFIG))
    total = sum(p.numel() for p in m.parameters())
    embed, head = m.get_input_embeddings().weight, m.get_output_embeddings().weight
    pair = embed.numel() + (0 if head is embed else head.numel())
    bf16 = 2
    print(f"{type(m).__name__}: {total / 1e9:.2f} B parameters = {total * bf16 / 1e9:.1f} GB in bf16")
    print(f"embedding + lm_head ({'tied' if head is embed else 'untied'}): {pair / 1e9:.2f} B parameters = "
          f"{pair * bf16 / 1e9:.2f} GB in bf16, {pair / total:.1%} of the model")
    F = 5 * CONFIG["hidden_size"]  # DFlash's usual 5 fused layers
    print(f"features on disk, 5 layers x {CONFIG['hidden_size']} in bf16: {F * bf16 / 1e3:.1f} KB per token "
          f"(+5 bytes of token id and loss mask)")


if __name__ == "__main__":
    main()

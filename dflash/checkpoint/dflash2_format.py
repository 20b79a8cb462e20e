"""The served format's DFlash2 parts (JSON and names only, no torch): what vLLM 0.32 reads.

- config.json: `architectures: ["DFlash2DraftModel"]` (vLLM's registry: qwen3_dflash2's
  DFlash2Qwen3ForCausalLM) and, in `dflash_config`, `conv_kernel_size`, `conv_group_size`,
  `selector_rank`, `selector_top_k` (read with int(dflash_config[...]): required), and
  `output_multiplier`, `final_logit_softcapping`, `input_embedding_scale` (read with
  .get and a neutral default), plus `is_causal: false` (top level, which vLLM's
  `_dflash_layer_causal` reads first, and in dflash_config as z-lab's checkpoints carry it).
  vLLM sizes the convolution's block by the server's `num_speculative_tokens + 1`: serve a
  DFlash2 drafter with num_speculative_tokens = block_size - 1, the block it trained on.
- weights: vLLM's own names under the layers and the model (its load_weights prefixes
  `model.`): `layers.{i}.{attention_conv,mlp_conv}.{base_kernel,kernel_projection.weight}`,
  `candidate_selector.{predecessor_codebook,successor_codebook,hidden_projection.weight}`.
  Ours are the same names (model/dflash2.py), so both directions pass them through.
"""
from __future__ import annotations

import re

ARCHITECTURE = "DFlash2DraftModel"
REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
OPTIONAL = {"output_multiplier": 1.0, "final_logit_softcapping": 0.0, "input_embedding_scale": 1.0}
_NAME = re.compile(r"layers\.\d+\.(attention_conv|mlp_conv)\.(base_kernel|kernel_projection\.weight)"
                   r"|candidate_selector\.(predecessor_codebook|successor_codebook|hidden_projection\.weight)")


def is_dflash2_name(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


def is_dflash2(raw: dict) -> bool:
    return ARCHITECTURE in (raw.get("architectures") or [])


def export_fields(dcfg) -> dict:
    """dflash_config entries of a DFlash2 DrafterConfig."""
    out = {k: int(getattr(dcfg, k)) for k in REQUIRED}
    out.update({k: float(getattr(dcfg, k)) for k in OPTIONAL})
    out["is_causal"] = False
    return out


def import_fields(raw: dict, where: str, error) -> dict:
    """DrafterConfig fields of a served DFlash2 config.json (`error`: the exception to raise)."""
    dc = raw.get("dflash_config") or {}
    missing = [k for k in REQUIRED if dc.get(k) is None]
    if missing:
        raise error(f"{where}: {ARCHITECTURE} without dflash_config.{missing[0]} (vLLM requires it)")
    if dc.get("causal") or raw.get("is_causal") or dc.get("is_causal"):
        raise error(f"{where}: a causal DFlash2 drafter: this trainer's blocks are bidirectional")
    try:
        out = {"arch": "dflash2", **{k: int(dc[k]) for k in REQUIRED}}
        out.update({k: float(dc.get(k) if dc.get(k) is not None else v) for k, v in OPTIONAL.items()})
    except (TypeError, ValueError) as e:
        raise error(f"{where}: dflash_config: {e}") from None
    return out


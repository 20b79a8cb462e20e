"""The drafter a run builds for its target: geometry from the target's config, the mask
token from its tokenizer, optionally decoder layers from the target's own."""
from __future__ import annotations

import sys

import torch

from .. import family
from ..config import Config
from . import target as target_mod
from .architectures import make_drafter
from .drafter import DFlashDrafter, DrafterConfig


def drafter_config(cfg: Config, target, tokenizer, layer_ids) -> DrafterConfig:
    """The drafter this run builds for this target: also what a resumed checkpoint must match."""
    vocab_rows = target.get_input_embeddings().weight.shape[0]
    mask_id, _ = target_mod.choose_mask_token_id(tokenizer, vocab_rows)
    return DrafterConfig.from_target(
        target.config, target_layer_ids=layer_ids, mask_token_id=mask_id, vocab_size=vocab_rows,
        num_hidden_layers=cfg.model.num_layers, block_size=cfg.model.block_size, target=cfg.model.target,
        copy_head=cfg.model.copy_head, draft_vocab_size=draft_vocab_size(cfg.model.draft_vocab, vocab_rows),
        layer_types=list(cfg.model.layer_types), sliding_window=cfg.model.sliding_window,
        **family.get(cfg.model.arch).drafter_fields(cfg.model))  # its family's own (none for dflash)


def draft_vocab_size(asked: int, vocab_rows: int) -> int:
    """model.draft_vocab as the drafter holds it: one that covers the whole vocabulary is none (a
    full head, as engines serve one without `d2t`), never a draft head as wide as the target's."""
    return asked if asked < vocab_rows else 0


def build_drafter(cfg: Config, target, tokenizer, layer_ids) -> DFlashDrafter:
    dcfg = drafter_config(cfg, target, tokenizer, layer_ids)
    torch.manual_seed(cfg.train.seed)
    drafter = make_drafter(dcfg)
    if cfg.model.drafter_init == "target":  # a head-only target (train --features) carries what init reads
        init_from_target(drafter, getattr(target, "init_source", None) or target)
    return drafter


# -- starting from the target's weights ----------------------------------------------------
# Start the drafter from the target's own weights instead of random ones.
#
# With `model.drafter_init=target` the drafter begins as a continuation of the target at
# its deepest fused layer: the context enters the drafter's first layer as the keys and
# values that the target's next layer computes from that hidden state.
# - `fc` (n*H -> H) selects the deepest fused layer's features (identity on that block,
#   zero elsewhere), and `hidden_norm` takes the input norm of the target layer after it;
# - drafter layer i copies target decoder layer d+1+i, where the deepest fused feature is
#   `hidden_states[d+1]` (the input of layer d+1), clipped to the last layers; layers
#   without attention projections (a hybrid model's linear-attention layers) are skipped;
# - the drafter's final norm copies the target's (the lm_head is the target's anyway).
# Only tensors with the same role and shape are copied: attention projections, q/k norms
# where the target has them (Qwen3), the MLP and the layer norms. docs/demo-recipe.md
# measures what this buys.

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
# Norms are not copied weight for weight: the drafter's RMSNorm multiplies by its weight
# (x·w, as Llama and Qwen3 do), but Qwen3.5, Qwen3-Next and Gemma store w near 0 and multiply
# by (1 + w). Copying w there gave a drafter whose every norm was ~0: uniform logits, a loss
# stuck at ln V and no word said. What is copied is the scale the target's norm applies,
# read off the module by running it (norm_scale), so any family's convention carries over.
#
# Roles, not names (Gemma 2/3's layer differs from the drafter's Qwen3 layer in three places):
# - its norm before the MLP is `pre_feedforward_layernorm`; its `post_attention_layernorm`
#   normalises the attention's output before the residual, a norm the drafter has no place for;
# - its attention scales by query_pre_attn_scalar^-1/2, not head_dim^-1/2: the drafter's q norm
#   (copied, or left at 1 where the target has none, as Gemma 2) takes the ratio of the target
#   attention's own `scaling` to the drafter's (any family's: 1 for Llama and Qwen), so the
#   logits scale as the target's (RoPE is linear in q). The drafter has one RoPE base, so on a
#   target whose layers differ in theirs (Gemma 3: sliding and full) the copy is exact only on
#   the layers whose base it has; Gemma 2's soft-capped attention logits are not carried (the
#   drafter's attention has no cap), and the run says so;
# - its MLP is GELU-gated, the drafter's SiLU-gated: the same weights would compute another
#   function, so the MLP stays random and the run says so.
# Embeddings and the head need nothing: the drafter calls the target's own modules (or one
# copy of the pair, model/target.py `embed_and_head`), so a scaled embedding (Gemma's x·sqrt(H))
# and a tied head are the target's as they are.
_SILU = {"silu", "swish"}


def _decoder(target):
    inner = getattr(target, "model", None)
    return getattr(inner, "language_model", inner)


def _copy(dst: torch.Tensor, src, copied: list, name: str) -> None:
    if src is not None and src.shape == dst.shape:
        dst.copy_(src.to(dst.dtype))
        copied.append(name)


@torch.no_grad()
def norm_scale(norm) -> torch.Tensor | None:
    """The per-channel factor an RMSNorm module applies after normalising: its weight for
    x·w norms, 1 + weight for Qwen3.5 / Qwen3-Next / Gemma's x·(1 + w). Measured by running a
    float32 copy of the module on a row of ones (whose RMS is 1, so the output is the factor
    over sqrt(1 + eps)). None where the module is no plain RMSNorm over its weight (a gated
    norm wants a second input; another shape): nothing is copied then."""
    import copy

    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1:
        return None
    eps = next((float(v) for k in ("eps", "variance_epsilon")
                if isinstance(v := getattr(norm, k, None), (int, float))), 0.0)
    probe = copy.deepcopy(norm).float()
    try:
        out = probe(torch.ones(1, w.shape[0]))
    except Exception:  # noqa: BLE001 -- a norm that is not x -> scale(x) * f(w): not copied
        return None
    if not isinstance(out, torch.Tensor) or out.shape != (1, w.shape[0]):
        return None
    return (out[0] * (1.0 + eps) ** 0.5).to(w.dtype)


def _copy_norm(dst: torch.Tensor, norm, copied: list, name: str) -> None:
    _copy(dst, norm_scale(norm) if norm is not None else None, copied, name)


def init_layers(target, target_layer_ids, n: int) -> list[int]:
    """The target decoder layers drafter layers 0..n-1 copy: the attention layers after the
    deepest fused one first, then those before it, deepest first; in the target's order."""
    layers = list(getattr(_decoder(target), "layers", []))
    attn = [i for i, layer in enumerate(layers) if hasattr(getattr(layer, "self_attn", None), "q_proj")]
    deepest = max(target_layer_ids)
    after = [i for i in attn if i > deepest]
    return sorted((after + [i for i in attn if i <= deepest][::-1])[:n])  # next layers first


def init_modules(target, target_layer_ids, n: int) -> list[torch.nn.Module]:
    """What init_from_target reads of the target: the chosen decoder layers and the final norm
    (offline/head_only.py reads only these of a target on disk when training from features)."""
    dec = _decoder(target)
    layers = list(getattr(dec, "layers", []))
    norm = getattr(dec, "norm", None)
    return [layers[i] for i in init_layers(target, target_layer_ids, n)] + ([norm] if norm is not None else [])


def _submodule(root, dotted: str):
    for part in dotted.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


@torch.no_grad()
def init_from_target(drafter, target) -> list[str]:
    """Copy what fits; returns the names of the drafter tensors that were copied. A drafter
    with more layers than the target has attention layers to copy keeps the rest random, and
    says so once (stderr)."""
    dec = _decoder(target)
    layers = list(getattr(dec, "layers", []))
    chosen = init_layers(target, drafter.cfg.target_layer_ids, len(drafter.layers))
    if len(chosen) < len(drafter.layers):
        print(f"dflash: model.drafter_init=target: the target has {len(chosen)} attention layer(s) to copy; "
              f"drafter layers {len(chosen)}..{len(drafter.layers) - 1} of {len(drafter.layers)} stay random",
              file=sys.stderr)
    copied: list[str] = []
    tcfg = getattr(target, "config", None)
    tcfg = getattr(tcfg, "get_text_config", lambda: tcfg)() if tcfg is not None else None
    act = getattr(tcfg, "hidden_activation", None) or getattr(tcfg, "hidden_act", None) or "silu"
    mlp_fits = act in _SILU
    not_carried = set()
    if getattr(tcfg, "attn_logit_softcapping", None):  # Gemma 2: tanh-capped attention logits
        not_carried.add(f"its attention's logit soft-capping at {tcfg.attn_logit_softcapping} (the drafter's "
                        "attention has none)")
    for i, t_idx in enumerate(chosen):
        layer = layers[t_idx]
        src = dict(layer.named_parameters())
        scaling = getattr(getattr(layer, "self_attn", None), "scaling", None)  # the target's attention scale
        q_ratio = scaling * drafter.cfg.head_dim ** 0.5 if isinstance(scaling, float) else 1.0
        for name, p in drafter.layers[i].named_parameters():
            mapped = _LAYER_MAP.get(name, "")
            if name == "post_attention_layernorm.weight" and hasattr(layer, "pre_feedforward_layernorm"):
                mapped = "pre_feedforward_layernorm.weight"  # Gemma: the norm in front of the MLP
                not_carried.add("its norms on the attention's and the MLP's outputs (no place in the drafter)")
            if name.startswith(("gate_proj", "up_proj", "down_proj")) and not mlp_fits:
                not_carried.add(f"the MLP (the target's is {act}-gated, the drafter's SiLU: it stays random)")
                continue
            if name.endswith("norm.weight"):
                _copy_norm(p, _submodule(layer, mapped[:-len(".weight")]), copied, f"layers.{i}.{name}")
                if name == "q_norm.weight" and abs(q_ratio - 1.0) > 1e-6:
                    # the target's attention scale, carried by the q norm: copied or not (Gemma 2
                    # has no q norm; the drafter's starts at 1), its logits scale as the target's
                    p.mul_(q_ratio)
            else:
                _copy(p, src.get(mapped), copied, f"layers.{i}.{name}")
    if not_carried:
        print(f"dflash: model.drafter_init=target: the target's {type(layers[chosen[0]]).__name__} is not the "
              f"drafter's (Qwen3) layer; copied what has the same role, not {'; nor '.join(sorted(not_carried))}",
              file=sys.stderr)
    if chosen:
        _copy_norm(drafter.hidden_norm.weight, getattr(layers[chosen[0]], "input_layernorm", None), copied,
                   "hidden_norm.weight")
    H = drafter.cfg.hidden_size
    k = len(drafter.cfg.target_layer_ids)
    order = sorted(range(k), key=lambda j: drafter.cfg.target_layer_ids[j])
    fc = torch.zeros_like(drafter.fc.weight)
    fc[:, order[-1] * H:(order[-1] + 1) * H] = torch.eye(H, dtype=fc.dtype)
    drafter.fc.weight.copy_(fc)
    copied.append("fc.weight")
    _copy_norm(drafter.norm.weight, getattr(dec, "norm", None), copied, "norm.weight")
    return copied

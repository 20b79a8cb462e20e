"""The DFlash drafter format the serving engines read: z-lab's published layout.

SGLang (`--speculative-algorithm DFLASH`), vLLM (`method: dflash`), z-lab's reference
code (`DFlashDraftModel.from_pretrained`) and SpecForge (`specforge export --to hf`) all
read one directory layout:

- `config.json`: a Qwen3 config of the drafter's own layers (`model_type: qwen3`,
  `architectures: ["DFlashDraftModel"]`) plus `dflash_config` {target_layer_ids,
  mask_token_id, block_size, num_target_layers}. Readers disagree on where they look
  (vLLM reads `dflash_config` only, older loaders the top level), so block_size and
  num_target_layers go in both places.
- `model.safetensors`: the drafter's weights under Qwen3 decoder names (`layers.{i}.self_attn.*`,
  `layers.{i}.mlp.*`), with no embedding and no lm_head: engines use the target's.

`target_layer_ids` in that format mean what ours mean: id i is the output of decoder layer
i, i.e. `hidden_states[i + 1]` of a Hugging Face forward (hidden_states[0] is the embedding).

This module is the format in both directions: our state dict <-> its names, our
DrafterConfig <-> its config. It reads only JSON until a drafter is built, so a bad
directory fails before any model loads. A drafter family's own parts (DFlash2's, DSpark's:
their architecture name, config keys and weight names) are its own to write and read
(dflash/family/<name>.py `export_config`, `import_fields`, `is_weight`).
"""
from __future__ import annotations

import re
from pathlib import Path

from .. import family
from ..errors import ConfigError
from ..preflight.checkpoint_files import BOUNDS

ARCHITECTURE = "DFlashDraftModel"

# our DrafterLayer keeps attention and MLP projections flat; Qwen3 nests them
_NESTED = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "q_norm": "self_attn", "k_norm": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_TOP = ("fc.weight", "hidden_norm.weight", "norm.weight")
_LAYER_OWN = ("input_layernorm", "post_attention_layernorm")
# what a reader may ship beside the drafter and we can drop: engines use the target's
_TARGET_OWNED = ("embed_tokens.weight", "lm_head.weight")
# a draft vocabulary (model.draft_vocab): its own head and, as EAGLE-3 stores it and vLLM
# reads it, `d2t` = target id - draft id (int64 offsets), beside `draft_vocab_size` in config.json
_DRAFT_VOCAB = {"draft_head": "lm_head.weight", "draft_ids": "d2t"}


class FormatError(ConfigError):
    """A directory or drafter the format cannot express (one line naming what): exit 2."""


def is_export_config(raw: dict) -> bool:
    """A config.json in the served format (ours say architectures ['DFlashDrafter'])."""
    archs = [str(a) for a in raw.get("architectures") or []]
    return "dflash_config" in raw or any(a.startswith("DFlash") and a != "DFlashDrafter" for a in archs) \
        or any(f.architecture in archs for f in family.FAMILIES.values())


def _family_weight(name: str) -> bool:
    """A family's own weight (DFlash2's convolutions and selector, DSpark's heads): the same name both ways."""
    return any(f.is_weight(name) for f in family.FAMILIES.values())


def read_config(path: str | Path) -> dict | None:
    """The config.json of `path` (a dir), or None when there is none."""
    from ..preflight.inputs import read_json_object

    from ..preflight.checkpoint_files import shape_error

    f = Path(path) / "config.json"
    if not f.is_file():
        return None
    raw = read_json_object(f, str(path), FormatError)
    err = shape_error(raw)
    if err:
        raise FormatError(f"{path}: config.json: {err}")
    return raw


# -- weights ------------------------------------------------------------------------------
def to_export_name(name: str) -> str:
    """Our state-dict name -> the format's; FormatError for a part the format cannot carry."""
    if name in _TOP:
        return name
    if name in _DRAFT_VOCAB:
        return _DRAFT_VOCAB[name]
    if _family_weight(name):
        return name
    m = re.fullmatch(r"layers\.(\d+)\.(\w+)\.weight", name)
    if m:
        i, part = m.groups()
        if part in _LAYER_OWN:
            return name
        if part in _NESTED:
            return f"layers.{i}.{_NESTED[part]}.{part}.weight"
    raise FormatError(f"weight {name!r}: the DFlash format has no place for it")


def from_export_name(name: str, draft_vocab: bool = False) -> str | None:
    """The format's name -> ours; None for target-owned weights a writer may have added.
    `draft_vocab` (config.json has a draft_vocab_size): `lm_head.weight` and `d2t` are the
    drafter's own."""
    name = name.removeprefix("model.")  # vLLM / speculators prefix the drafter's weights
    if name in _TOP:
        return name
    if draft_vocab and name in _DRAFT_VOCAB.values():
        return next(k for k, v in _DRAFT_VOCAB.items() if v == name)
    if name in _TARGET_OWNED:
        return None
    if _family_weight(name):
        return name
    m = re.fullmatch(r"layers\.(\d+)\.(?:(self_attn|mlp)\.)?(\w+)\.weight", name)
    if m:
        i, group, part = m.groups()
        if (group is None and part in _LAYER_OWN) or (group is not None and _NESTED.get(part) == group):
            return f"layers.{i}.{part}.weight"
    raise FormatError(f"weight {name!r}: not a DFlash drafter weight this trainer knows "
                      f"(a DFlash2 or other variant?)")


def export_state_dict(state: dict) -> dict:
    out = {to_export_name(k): v for k, v in state.items()}
    if "d2t" in out:  # draft ids -> offsets: target id = draft id + d2t[draft id]
        import torch
        ids = out["d2t"].long()
        out["d2t"] = ids - torch.arange(len(ids), device=ids.device)
    return out


def import_state_dict(state: dict, draft_vocab: bool = False) -> dict:
    out = {}
    for k, v in state.items():
        ours = from_export_name(k, draft_vocab)
        if ours is not None:
            out[ours] = v
    if "draft_ids" in out:
        import torch
        out["draft_ids"] = out["draft_ids"].long() + torch.arange(len(out["draft_ids"]))
    return out


# -- config -------------------------------------------------------------------------------
def _rope_type(tcfg) -> str:
    for key in ("rope_parameters", "rope_scaling"):
        rp = getattr(tcfg, key, None)
        if isinstance(rp, dict):
            return str(rp.get("rope_type") or rp.get("type") or "default")
    return "default"


def export_config(dcfg, target_config, *, dtype: str) -> dict:
    """The served config.json of a drafter (DrafterConfig) trained for `target_config`."""
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    num_target_layers = int(tc.num_hidden_layers)
    flags = {"target_layer_ids": list(dcfg.target_layer_ids), "mask_token_id": int(dcfg.mask_token_id),
             "block_size": int(dcfg.block_size), "num_target_layers": num_target_layers}
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": dcfg.hidden_size,
        "num_attention_heads": dcfg.num_attention_heads,
        "num_key_value_heads": dcfg.num_key_value_heads,
        "head_dim": dcfg.head_dim,
        "intermediate_size": dcfg.intermediate_size,
        "num_hidden_layers": dcfg.num_hidden_layers,
        "vocab_size": int(dcfg.vocab_size),   # the target's embedding rows (build_drafter)
        "rms_norm_eps": dcfg.rms_norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "torch_dtype": dtype,                  # transformers 4.x readers (vLLM, SGLang) look here
        # the theta the drafter trained with (DrafterConfig.from_target took it from the target)
        "rope_theta": dcfg.rope_theta,
        "max_position_embeddings": getattr(tc, "max_position_embeddings", None) or 32768,
        "dflash_config": flags,
        "block_size": flags["block_size"],     # older readers (MLX) look at the top level
        "num_target_layers": num_target_layers,
    }
    family.of(dcfg).export_config(dcfg, cfg, flags)  # its family's own parts (dflash/family/): DFlash's none
    if getattr(dcfg, "draft_vocab_size", 0):  # drafts from these tokens only: own lm_head + d2t (EAGLE-3's way)
        cfg["draft_vocab_size"] = int(dcfg.draft_vocab_size)
    if SLIDING in (getattr(dcfg, "layer_types", None) or []):
        cfg.update(sliding_fields(dcfg.layer_types, dcfg.sliding_window))
        flags.update(swa_window_size=int(dcfg.sliding_window), causal=False)
    # plain RoPE is `rope_scaling: null` to transformers-4 readers (vLLM, SGLang), as in z-lab's
    # published configs; transformers 5 reads rope_parameters. A scaling is copied as it is.
    scaled = _rope_type(tc) != "default"
    for key in ("rope_scaling", "rope_parameters"):
        val = getattr(tc, key, None)
        cfg[key] = (dict(val) if isinstance(val, dict) else val) if scaled or key == "rope_parameters" else None
    if isinstance(cfg.get("rope_parameters"), dict):  # one theta, whichever the reader takes
        cfg["rope_parameters"]["rope_theta"] = dcfg.rope_theta
    if cfg["rope_parameters"] is None:
        del cfg["rope_parameters"]
    return cfg


# -- sliding-window layers (docs/architectures.md, "Sliding-window layers") -----------------
SLIDING, FULL = "sliding_attention", "full_attention"


def sliding_fields(layer_types: list[str], window: int) -> dict:
    """What a reader needs to build the sliding layers we trained (top level of config.json;
    dflash_config gets swa_window_size and causal beside them). vLLM 0.32 takes a layer as
    causal when no flag says otherwise and layer_types names it sliding, while this drafter
    (as DFlash and SpecForge train it) is bidirectional inside the block: `is_causal: false`
    says so for every layer. transformers drops `sliding_window` unless `use_sliding_window`."""
    return {"layer_types": list(layer_types), "sliding_window": int(window), "use_sliding_window": True,
            "max_window_layers": 0, "is_causal": False}


def sliding_layout(raw: dict, where: str) -> tuple[list[str], int]:
    """(layer_types, window) of a served config as vLLM 0.32 resolves them
    (qwen3_dflash._resolve_layer_attention, over transformers' Qwen3Config): ([], 0) when every
    layer is full. FormatError for a layer it would run causal (this drafter is bidirectional
    inside a block) or a sliding layer without a window."""
    dc = raw.get("dflash_config") or {}
    types = raw.get("layer_types")
    if types is None and not raw.get("use_sliding_window") and not dc.get("use_swa"):
        return [], 0
    n = int(raw["num_hidden_layers"])
    if not 1 <= n <= BOUNDS["num_hidden_layers"][1]:
        return [], 0  # bounds_error names it, before anything of that size is built
    window = dc.get("swa_window_size", raw.get("sliding_window") if raw.get("use_sliding_window") else None)
    if types is None:  # transformers derives them: sliding from layer max_window_layers on
        on = raw.get("use_sliding_window") and raw.get("sliding_window") is not None
        types = [SLIDING if on and i >= family.integer(raw.get("max_window_layers", 28), "max_window_layers", where, FormatError) else FULL for i in range(n)]
    types = [str(t) for t in types]
    if len(types) != n or any(t not in (SLIDING, FULL) for t in types):
        raise FormatError(f"{where}: layer_types={str(types)[:120]}: expected {n} of {SLIDING!r} / {FULL!r}")
    legacy_causal = list(types)  # without a causal flag vLLM runs the sliding layers causal
    if dc.get("use_swa") and SLIDING not in types:
        types = [SLIDING] * n
    if SLIDING not in types:
        return [], 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise FormatError(f"{where}: sliding layers with window {window!r}: expected dflash_config.swa_window_size "
                          f"or sliding_window (with use_sliding_window) >= 1")
    flag = raw.get("is_causal", dc.get("causal"))
    causal = [bool(flag)] * n if flag is not None else [t == SLIDING for t in legacy_causal]
    if any(causal):
        raise FormatError(f"{where}: layer {causal.index(True)} attends causally (set is_causal: false if it "
                          f"was trained bidirectional): this trainer's drafter is bidirectional inside a block")
    return types, int(window)


def rope_warning(target_config) -> str | None:
    """Our drafter applies plain RoPE; a reader applies the target's scaling if it has one."""
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    kind = _rope_type(tc)
    if kind != "default":
        return (f"the target uses rope type {kind!r}; this drafter trained with plain RoPE, and a reader "
                f"of the exported config applies {kind!r} to it (positions beyond the original context differ)")
    return None


def _value(raw: dict, name: str, default=None):
    """Where the reference looks: dflash_config first, then the top level."""
    return (raw.get("dflash_config") or {}).get(name, raw.get(name, default))


def spread_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """The reference's default when a config names no target_layer_ids (same rule as ours)."""
    if n == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (n - 1)) for i in range(n)]


def drafter_config_fields(raw: dict, where: str) -> dict:
    """DrafterConfig fields from a served config.json; FormatError for what we cannot run."""
    known = [f.architecture for f in family.FAMILIES.values()]
    for arch in raw.get("architectures") or []:
        if arch not in known:
            raise FormatError(f"{where}: architecture {arch!r}: expected {', '.join(known[:-1])} or {known[-1]} "
                              f"(other variants add parts this trainer does not have)")
    extra = family.served(raw).import_fields(raw, where, FormatError)  # its family's own fields
    for key, neutral in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0)):
        if key not in extra and _value(raw, key, neutral) != neutral:  # NaN, "2", [1] too: never equal to 1.0
            raise FormatError(f"{where}: {key}={_value(raw, key)!r}: this trainer's drafter supports {neutral} only")
    if "final_logit_softcapping" not in extra and _value(raw, "final_logit_softcapping"):
        raise FormatError(f"{where}: final_logit_softcapping: not supported by this trainer's drafter")
    if raw.get("attention_bias"):
        raise FormatError(f"{where}: attention_bias=true: this trainer's drafter has no attention biases")
    if raw.get("hidden_act", "silu") != "silu":
        raise FormatError(f"{where}: hidden_act={raw['hidden_act']!r}: expected silu")
    mask = _value(raw, "mask_token_id")
    if mask is None:
        raise FormatError(f"{where}: no mask_token_id (in dflash_config or at the top level)")
    def whole(key: str, v):
        return family.integer(v, key, where, FormatError)

    try:
        heads = whole("num_attention_heads", raw["num_attention_heads"])
        hidden = whole("hidden_size", raw["hidden_size"])
        layers = whole("num_hidden_layers", raw["num_hidden_layers"])
        ids = _value(raw, "target_layer_ids")
        if ids is None:
            ids = spread_layer_ids(whole("num_target_layers", _value(raw, "num_target_layers")), layers)
        if not isinstance(ids, list):
            raise FormatError(f"{where}: target_layer_ids={str(ids)[:80]}: expected a list of layer ids")
        rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
        theta = rope.get("rope_theta") or raw.get("rope_theta") or 10000.0
        layer_types, window = sliding_layout(raw, where)
        return {
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_key_value_heads": whole("num_key_value_heads", raw.get("num_key_value_heads") or heads),
            "head_dim": whole("head_dim", raw.get("head_dim") or (hidden // heads if heads else 0)),
            "intermediate_size": whole("intermediate_size", raw["intermediate_size"]),
            "vocab_size": whole("vocab_size", raw["vocab_size"]),
            "target_layer_ids": [whole("target_layer_ids[]", i) for i in ids],
            "mask_token_id": whole("mask_token_id", mask),
            "num_hidden_layers": layers,
            "block_size": whole("block_size", _value(raw, "block_size", family.BLOCK_SIZE)),
            "rms_norm_eps": family.number(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", where, FormatError),
            "rope_theta": family.number(theta, "rope_theta", where, FormatError),
            "draft_vocab_size": draft_vocab_size(raw, where),
            "layer_types": layer_types,
            "sliding_window": window,
            **extra,
        }
    except FormatError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"{where}: config.json lacks or garbles {e} (expected a DFlash drafter config)") from None


def draft_vocab_size(raw: dict, where: str = "config.json") -> int:
    """A served config's draft vocabulary (0: drafts over the target's whole vocabulary)."""
    n = raw.get("draft_vocab_size")
    if n is None:
        return 0
    n = family.integer(n, "draft_vocab_size", where, FormatError)
    return 0 if n == raw.get("vocab_size") else n


def fit_error(fields: dict, *, hidden_size: int, num_layers: int, embed_rows: int, where: str,
              draft_token_max: tuple[int, int] | None = None) -> str | None:
    """One line naming the first way a drafter does not fit a target, or None.
    ``draft_token_max``: (highest target id, its draft id) of a draft vocabulary (d2t)."""
    if fields["hidden_size"] != hidden_size:
        return (f"{where}: drafter hidden_size={fields['hidden_size']} does not fit the target's "
                f"hidden size {hidden_size}")
    bad = [i for i in fields["target_layer_ids"] if not 0 <= i < num_layers]
    if bad:
        return (f"{where}: target_layer_ids {fields['target_layer_ids']} name layer(s) {bad}; the target has "
                f"{num_layers} decoder layers (ids 0..{num_layers - 1})")
    if not 0 <= fields["mask_token_id"] < embed_rows:
        return (f"{where}: mask_token_id={fields['mask_token_id']} is outside the target's {embed_rows} "
                f"embedding rows")
    if draft_token_max is not None and draft_token_max[0] >= embed_rows:
        return (f"{where}: d2t maps draft id {draft_token_max[1]} to token {draft_token_max[0]}, outside the "
                f"target's {embed_rows} embedding rows")
    return None

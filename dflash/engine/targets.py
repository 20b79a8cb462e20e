"""A target the engine can read: a Hugging Face model dir on disk.

vLLM loads models from a dir (or the hub); two of our targets exist only in code:
- `smollm2`: the GGUF dequantized once into a cached HF dir (model/target.py), used as is;
- `tiny-*`: random models built from a config and a seed; written once with
  `save_pretrained` (safetensors, the SmolLM2 tokenizer and chat template beside them) into
  `$DFLASH_CACHE/engine-targets/<spec>-seed<seed>-<transformers version>`, so the engine
  runs the very weights our eval runs.
A local dir or a hub id passes through unchanged.
"""
from __future__ import annotations

from pathlib import Path

from ..preflight.inputs import SMOLLM2, TINY_TARGETS, cache_dir, check_cache_entry


def engine_target(spec: str, seed: int = 0) -> str:
    """The dir (or hub id) vLLM should load for target `spec`."""
    from ..model import target as T

    if spec == SMOLLM2:
        return str(T._smollm2_model_dir())
    if spec not in TINY_TARGETS:  # a local dir absolute (the engine runs in a cwd of its own), or a hub id
        return str(Path(spec).resolve()) if Path(spec).is_dir() else spec
    entry = _entry(spec, seed)

    def write(tmp: Path) -> None:
        model, tok = T.load_target(spec, seed=seed)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return str(T._atomic_dir(entry, write))


def _entry(spec: str, seed: int) -> Path:
    import importlib.metadata  # transformers' version without importing it (seconds)

    return cache_dir() / "engine-targets" / f"{spec}-seed{seed}-tf{importlib.metadata.version('transformers')}"


def check_engine_target(spec: str, seed: int = 0) -> None:
    """The cache entry a tiny target would be written to is a dir or can be made (a file in
    its place: one line, exit 2), checked before torch loads."""
    if spec in TINY_TARGETS:
        check_cache_entry(_entry(spec, seed), f"target {spec!r} (seed {seed}) for the engine")

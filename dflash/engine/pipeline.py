"""The training pipeline's uses of the engine (vLLM, in `.venv-vllm`, as a child:
runner.py): the target's replies (`data.regen_engine: vllm`) and its fused-layer features
(`dflash capture --engine vllm`), each one engine start for all the prompts it is given.

What is asked of the engine is what the HF path does: the same prompt token ids, greedy,
the same `max_new_tokens`, stopping after the first of the same end-of-sequence ids (the
target's generation config, else its tokenizer's: prep/regenerate.py), that id kept; the
features of the same layers (vLLM numbers an auxiliary layer by the layer whose input it
is: our layer i, whose output we keep, is vLLM's i + 1).
"""
from __future__ import annotations

import os
from pathlib import Path

from .runner import EngineError, note, remove_scratch, run_job, scratch_dir


def tensor_parallel() -> int:
    """vLLM's tensor_parallel_size: `$DFLASH_VLLM_TP` (`dflash capture --engine-tp N` sets it), 1 unless set."""
    raw = os.environ.get("DFLASH_VLLM_TP", "").strip() or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise EngineError(f"DFLASH_VLLM_TP={raw!r}: expected an integer >= 1")
    return int(raw)


def _target_dir(spec: str, seed: int) -> str:
    from .targets import engine_target
    return engine_target(spec, seed)


def replies(spec: str, seed: int, prompts: list[list[int]], *, max_new_tokens: int, stop_ids, dtype: str,
            timeout_s: float = 6 * 3600.0) -> list[list[int]]:
    """Greedy replies to ``prompts`` (token ids), cut after the first of ``stop_ids``."""
    if not prompts:
        return []
    job = {"kind": "regenerate", "target": _target_dir(spec, seed), "dtype": dtype, "seed": 0,
           "tensor_parallel_size": tensor_parallel(),
           "max_model_len": max(map(len, prompts)) + max_new_tokens + 1, "prompts": [list(p) for p in prompts],
           "max_tokens": [max_new_tokens] * len(prompts), "stop_token_ids": sorted(int(t) for t in stop_ids)}
    res = run_job(job, label="regenerate", timeout_s=timeout_s)
    note(f"vLLM {res['vllm_version']} regenerated {len(prompts)} replies in {res['run_s']:.1f} s "
         f"(engine start {res['load_s']:.1f} s)")
    out = res["outputs"]
    if len(out) != len(prompts):
        raise RuntimeError(f"vLLM returned {len(out)} replies for {len(prompts)} prompts")
    stops = set(stop_ids)
    for gen in out:  # what the HF path keeps: up to and including the first stop id
        cut = next((k + 1 for k, t in enumerate(gen) if t in stops), len(gen))
        del gen[cut:]
    return out


def hidden_states(spec: str, seed: int, prompts: list[list[int]], layer_ids, *, dtype: str,
                  timeout_s: float = 6 * 3600.0) -> list:
    """The target's outputs of layers ``layer_ids`` (ours) over each of ``prompts``:
    float tensors ``[len, n*H]`` in the order of ``layer_ids``, as `model/features.py` gives."""
    from safetensors.torch import load_file

    if not prompts:
        return []
    store = Path(scratch_dir("hidden"))  # swept by a later start if we are killed
    try:
        job = {"kind": "hidden_states", "target": _target_dir(spec, seed), "dtype": dtype, "seed": 0,
               "tensor_parallel_size": tensor_parallel(),
               "max_model_len": max(map(len, prompts)) + 2, "prompts": [list(p) for p in prompts],
               "layer_ids": [int(i) + 1 for i in layer_ids], "store": str(store)}
        res = run_job(job, label="capture", timeout_s=timeout_s)
        out = []
        for p, f in zip(prompts, res["files"]):
            d = load_file(f)
            if d["token_ids"].tolist() != list(p):
                raise RuntimeError(f"vLLM's hidden states are of other tokens than the prompt's ({f})")
            h = d["hidden_states"]  # [tokens, layers, hidden]
            out.append(h.reshape(h.shape[0], -1))
        note(f"vLLM {res['vllm_version']} captured {len(prompts)} sequences in {res['run_s']:.1f} s "
             f"(engine start {res['load_s']:.1f} s)")
        return out
    finally:
        remove_scratch(store)

"""Warm the target's kernels up before anything is timed.

On CUDA, flash-linear-attention's Triton kernels (hybrid targets: qwen3_5, qwen3_next)
compile and autotune on first use: ~50 s on an H200 before the first hybrid batch, which
otherwise lands inside regeneration, the first training step or the eval. cuBLAS and the
caching allocator have smaller first-call costs too. One batched forward at the training
shape plus a short cached decode (the recurrent kernels are separate ones) pays all of it
up front, and the time is printed, so it is never mistaken for throughput.
"""
from __future__ import annotations

import sys
import time


def uses_fla() -> bool:
    """Whether flash-linear-attention is importable (transformers then routes hybrid layers to it)."""
    import importlib.util

    return importlib.util.find_spec("fla") is not None


def warm_up(target, *, batch_size: int, seq_len: int, quiet: bool = False, force: bool = False) -> float | None:
    """Run the warm-up on a CUDA target; returns its seconds (None on the CPU, where there is
    nothing to compile, unless `force`: tests run the same code there). Synchronises the
    device once, here, outside every timed region."""
    import torch

    dev = torch.device(target.device)
    if dev.type != "cuda" and not force:
        return None
    t0 = time.perf_counter()
    vocab = target.get_input_embeddings().weight.shape[0]
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(100, min(vocab, 30000), (batch_size, seq_len), generator=g).to(dev)
    with torch.no_grad():
        target(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True, use_cache=False)
        target.generate(input_ids=ids[:2, : min(seq_len, 32)], attention_mask=torch.ones_like(ids[:2, :32]),
                        max_new_tokens=4, do_sample=False, pad_token_id=0)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    secs = time.perf_counter() - t0
    if not quiet:
        what = "Triton (flash-linear-attention) compile/autotune and " if uses_fla() else ""
        print(f"warm-up: {what}first-call kernel setup took {secs:.1f} s (outside every timed region)",
              file=sys.stderr)
    return secs

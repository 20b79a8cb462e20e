"""Regeneration: the target writes the replies the drafter learns from.

It runs the model (model/) on conversations (data/), so it lives above both: data/ never
imports a model, and the import graph has no cycle.
"""
from __future__ import annotations

import contextlib
import sys

import torch

from ..data.dataset import truncated_prompt
from ..model.layer_capture import LayerCapture


def _eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    return set(eos if isinstance(eos, (list, tuple)) else [eos])


def regenerate(model, tokenizer, convs, *, max_new_tokens: int, batch_size: int = 16, device="cpu",
               max_prompt_len: int = 256, layer_ids=None, features: dict | None = None) -> list[list[dict]]:
    """Let the target write the reply to each conversation's first user turn (batched greedy).

    Returns ``[system?, user, assistant]`` conversations in input order; the assistant turn holds
    the decoded text and the generated ``token_ids`` (up to and including the first eos).
    Prompts are sorted by length so batches carry little left padding.

    With ``layer_ids`` and a ``features`` dict, the selected layers' outputs of the generating
    forwards are kept too (`model/layer_capture.py`): ``features[tuple(prompt_ids + reply_ids)]``
    is a CPU tensor ``[len, n*H]``, what `capture_hidden` gives for that sequence, except that
    the very last token (never fed back to the target) has a zero row. Nothing trains on that
    row: a block's context is the positions before its anchor, and an anchor needs a label.
    """
    from tqdm.auto import tqdm

    prompts = [truncated_prompt(tokenizer, c, max_prompt_len) for c in convs]
    eos, pad = _eos_ids(model, tokenizer), tokenizer.pad_token_id
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i][1]))
    out: list = [None] * len(prompts)
    keep = features is not None and bool(layer_ids)
    with tqdm(total=len(prompts), desc="regenerate", unit="conv", file=sys.stderr) as bar:
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            batch_prompts = [prompts[i][1] for i in idx]
            gens, feats = _generate_left_padded(model, batch_prompts, pad, eos, max_new_tokens, device,
                                                layer_ids if keep else None)
            for k, (i, gen) in enumerate(zip(idx, gens)):
                reply = tokenizer.decode(gen, skip_special_tokens=True)
                out[i] = prompts[i][0] + [{"role": "assistant", "content": reply, "token_ids": gen}]
                if feats is not None:
                    features[tuple(prompts[i][1] + gen)] = feats[k]
            bar.update(len(idx))
    return out


def _generate_left_padded(model, prompts, pad: int, eos: set[int], max_new_tokens: int, device,
                          layer_ids=None) -> tuple[list[list[int]], list | None]:
    """Greedy continuations of a batch of prompts, cut after the first eos; with ``layer_ids``
    also each row's features over prompt + continuation (see `regenerate`)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    am = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    capture = LayerCapture(model, layer_ids) if layer_ids else contextlib.nullcontext()
    with torch.no_grad(), capture:
        # use_cache: a checkpoint may ship `use_cache: false`, and then every step would re-run
        # the whole sequence (what the capture below reads as one new token per step)
        seqs = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=max_new_tokens, do_sample=False,
                              pad_token_id=pad, eos_token_id=sorted(eos), use_cache=True)
    gens = []
    for row in seqs[:, width:].tolist():
        cut = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
        gens.append(row[:cut])
    if not layer_ids:
        return gens, None
    prefill = capture.calls[0].cpu()                       # [B, width, F]: the prompt positions
    steps = capture.calls[1:]                              # reply token j is the input of step j
    if any(c.shape[1] != 1 for c in steps):
        raise RuntimeError("regeneration: a decoding step ran more than one token (no KV cache?); "
                           "cannot keep its features")
    stepped = torch.cat(steps, dim=1).cpu() if steps else prefill[:, :0]
    feats = []
    for r, (p, gen) in enumerate(zip(prompts, gens)):
        rows = prefill.new_zeros(len(p) + len(gen), prefill.shape[-1])
        rows[:len(p)] = prefill[r, width - len(p):]
        n = min(len(gen), stepped.shape[1])
        rows[len(p):len(p) + n] = stepped[r, :n]
        feats.append(rows)
    return gens, feats

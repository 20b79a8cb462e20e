"""Regeneration: the target writes the replies the drafter learns from.

It runs the model (model/) on conversations (data/), so it lives above both: data/ never
imports a model, and the import graph has no cycle.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time

import torch

from ..data.dataset import truncated_prompt
from ..model.features import LayerCapture
from .regen_cache import prompt_key
from .regen_shard import SOLO, Shard


def _eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    return set(eos if isinstance(eos, (list, tuple)) else [eos])


def regenerate(model, tokenizer, convs, *, max_new_tokens: int, batch_size: int = 16, device="cpu",
               max_prompt_len: int = 256, layer_ids=None, features: dict | None = None, cache=None,
               shard: Shard = SOLO, counts: dict | None = None, engine=None,
               workers: int = 1) -> list[list[dict]] | None:
    """Let the target write the reply to each conversation's first user turn (batched greedy).

    Returns ``[system?, user, assistant]`` conversations in input order; the assistant turn holds
    the decoded text and the generated ``token_ids`` (up to and including the first eos).
    Prompts are sorted by length so batches carry little left padding; a prompt that occurs
    twice is generated once.

    ``cache`` (`regen_cache.RegenCache`): replies already on disk are taken from it and each
    finished batch is written to it, so a killed regeneration resumes where it stopped.
    ``shard`` (`regen_shard.Shard`): under torchrun this rank generates only its part of what
    no rank has yet; the replies are gathered, and a rank that is not the gather's ``dst``
    gets None. ``counts`` receives regenerated (all ranks) / regenerated_here / cached /
    total (distinct prompts) / seconds.

    With ``layer_ids`` and a ``features`` dict, the selected layers' outputs of the generating
    forwards are kept too (`model/features.py`): ``features[tuple(prompt_ids + reply_ids)]``
    is a CPU tensor ``[len, n*H]``, what `capture_hidden` gives for that sequence, except that
    the very last token (never fed back to the target) has a zero row. Nothing trains on that
    row: a block's context is the positions before its anchor, and an anchor needs a label.
    Cached replies bring their features when the cache kept them (this rank wrote them with
    the same layers); where not, the feature cache misses and training runs the forward.

    ``workers`` (``data.regen_workers``): that many batches are generated at once, each by a
    thread of this process with its share of torch's compute threads (a batch is the same
    rows as one at a time; its features are its own thread's). On 2 CPU cores two workers of
    one thread make replies 1.27x as fast as one of two (bench/target_tokens.py): a decode
    step is hundreds of small parallel regions, and torch's ops free the GIL. Batches are
    written to the cache in order, as they finish.

    ``engine`` (``data.regen_engine: vllm``): a function ``(prompts, max_new_tokens, eos ids)
    -> replies`` that generates this rank's pending prompts all at once in another engine
    (engine/pipeline.py: one vLLM start); its replies go to the cache in batches as the HF
    path's do. A kill during that call loses its replies (nothing is on disk until it
    returns); no features are kept (training runs the forward).
    """
    from tqdm.auto import tqdm

    from ..phases import phase

    t0 = time.perf_counter()
    prompts = [truncated_prompt(tokenizer, c, max_prompt_len) for c in convs]
    keys = [prompt_key(p[1]) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i][1]))
    first: dict[str, int] = {}
    for i in order:  # one generation per distinct prompt, at its first place in length order
        first.setdefault(keys[i], i)
    rows = model.get_input_embeddings().weight.shape[0]  # an id at or past it would fail training partway
    have = cache.load(set(first), vocab_size=rows, max_new_tokens=max_new_tokens) if cache is not None else {}
    held = shard.agree(set(have))
    done = set().union(*held)
    pending = [i for i in first.values() if keys[i] not in done]
    mine = shard.mine(pending)
    eos, pad = _eos_ids(model, tokenizer), tokenizer.pad_token_id
    keep = features is not None and bool(layer_ids) and engine is None
    made: dict[str, list[int]] = {}
    outside = None
    if engine is not None and mine:  # another engine (vLLM) generates this rank's share at once
        with phase("regen_engine", replies=len(mine)):
            outside = engine([prompts[i][1] for i in mine], max_new_tokens, eos)
    groups = [mine[b:b + batch_size] for b in range(0, len(mine), batch_size)]

    stop = threading.Event()  # set when this thread stops early: the workers' generate() calls end too

    def generate(k: int):
        idx = groups[k]
        if outside is not None:
            return outside[k * batch_size:(k + 1) * batch_size], None
        with phase("regen_batch", batch=k, replies=len(idx)) as ph:  # a worker thread's: under "regenerate"
            gens, feats = _generate_left_padded(model, [prompts[i][1] for i in idx], pad, eos, max_new_tokens,
                                                device, layer_ids if keep else None,
                                                stop=stop if workers > 1 else None)
            ph.set(tokens=sum(len(g) for g in gens))
        return gens, feats

    with phase("regenerate", cached=len(done), total=len(first), to_generate=len(mine), batches=len(groups),
               workers=workers, engine="vllm" if engine is not None else "hf") as regen_phase, \
            tqdm(total=len(mine), desc="regenerate", unit="conv", file=sys.stderr) as bar, \
            _workers(workers if outside is None else 1, len(groups), stop) as run:
        regen_phase.progress(0, len(mine))  # 0 of N on the dashboard while the first batch runs
        for idx, (gens, feats) in zip(groups, run(generate, range(len(groups)))):
            batch = {keys[i]: gen for i, gen in zip(idx, gens)}
            if feats is not None:
                for i, gen, f in zip(idx, gens, feats):
                    features[tuple(prompts[i][1] + gen)] = f
            if cache is not None:
                cache.write_batch(batch, {keys[i]: f for i, f in zip(idx, feats)} if feats is not None else None)
            made.update(batch)
            bar.update(len(idx))
            regen_phase.progress(len(made), len(mine))
    # each cached reply comes from one rank: the first that holds it
    owned = {k: v for k, v in have.items() if not any(k in h for h in held[:shard.index])}
    replies = shard.gather(owned | made)
    secs = time.perf_counter() - t0
    if counts is not None:
        # every pending reply was made by some rank: the all-rank total needs no extra collective
        counts.update(regenerated=len(pending), regenerated_here=len(made), cached=len(done), total=len(first),
                      seconds=round(secs, 3))
    who = f"rank {shard.index}/{shard.count}: " if shard.count > 1 else ""
    print(f"{who}regenerated {len(made)} (cached {len(done)}) of {len(first)} replies in {secs:.1f} s, "
          f"{len(made) / secs if secs > 0 else 0.0:.2f} replies/s", file=sys.stderr)
    if replies is None:
        return None
    if keep and have:
        cached = cache.load_features(set(have))
        width = len(layer_ids) * model.config.get_text_config().hidden_size
        for i in first.values():
            f, seq = cached.get(keys[i]), prompts[i][1] + replies[keys[i]]
            # only a tensor that fits its sequence: anything else is a miss (training runs the forward)
            if f is not None and f.dim() == 2 and tuple(f.shape) == (len(seq), width) and f.is_floating_point():
                features[tuple(seq)] = f
    out = []
    for (msgs, _), k in zip(prompts, keys):
        gen = replies[k]
        out.append(msgs + [{"role": "assistant", "content": tokenizer.decode(gen, skip_special_tokens=True),
                            "token_ids": gen}])
    return out


@contextlib.contextmanager
def _workers(n: int, batches: int, stop: threading.Event):
    """``run(fn, items)`` -> fn's results in order: in this thread (n <= 1), or by n threads that
    split torch's compute threads among them; the caller's thread count is restored after. If
    the caller stops early (a stop signal's KeyboardInterrupt, an error), batches not started
    are dropped and ``stop`` ends the running ones at their next decoding step, so the
    process does not wait for them at exit."""
    n = max(1, min(n, batches))
    if n == 1:
        yield map
        return
    from concurrent.futures import ThreadPoolExecutor

    total = torch.get_num_threads()
    per = max(1, total // n)
    pool = ThreadPoolExecutor(n, initializer=torch.set_num_threads, initargs=(per,), thread_name_prefix="regen")
    try:
        yield pool.map
    except BaseException:
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    else:
        pool.shutdown(wait=True)
    finally:
        torch.set_num_threads(total)  # set_num_threads reaches process-wide settings (MKL's) too


def _stopping(event: threading.Event):
    """generate()'s stopping criteria: every row is done once ``event`` is set."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Stopped(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), event.is_set(), dtype=torch.bool, device=input_ids.device)
    return StoppingCriteriaList([Stopped()])


def greedy_continuations(model, prompts: list[list[int]], n: int, *, pad: int, device,
                         batch_size: int = 16) -> list[list[int]]:
    """Exactly ``n`` greedy tokens after each prompt, an end-of-turn token no stop (the held-out
    estimate reads the target's tokens past it: run/acceptance_estimate.py); batched and
    left-padded as regeneration is."""
    out = []
    for b in range(0, len(prompts), batch_size):
        out += _generate_left_padded(model, prompts[b:b + batch_size], pad, set(), n, device)[0]
    return out


def _generate_left_padded(model, prompts, pad: int, eos: set[int], max_new_tokens: int, device,
                          layer_ids=None, stop: threading.Event | None = None) -> tuple[list[list[int]], list | None]:
    """Greedy continuations of a batch of prompts, cut after the first eos (no eos ids: never
    cut, never stopped); with ``layer_ids`` also each row's features over prompt +
    continuation (see `regenerate`)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    am = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    capture = LayerCapture(model, layer_ids) if layer_ids else contextlib.nullcontext()
    # a worker's batch (regenerate's workers) ends when the caller stops
    extra = {"stopping_criteria": _stopping(stop)} if stop is not None else {}
    with torch.no_grad(), capture:
        # use_cache: a checkpoint may ship `use_cache: false`, and then every step would re-run
        # the whole sequence (what the capture below reads as one new token per step)
        seqs = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=max_new_tokens, do_sample=False,
                              pad_token_id=pad, eos_token_id=sorted(eos) or None, use_cache=True, **extra)
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

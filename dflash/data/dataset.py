"""ShareGPT conversations -> chat-templated token ids + a loss mask on the assistant tokens.

Conversations are lists of ``{"role": "system"|"user"|"assistant", "content": str}``. An
assistant turn written by :func:`regenerate` also carries ``"token_ids"``: the exact ids the
target generated. :func:`tokenize_conversation` uses them as they are, because decoding and
re-encoding is not an identity (a random tiny target emits non-canonical token sequences),
and the drafter must learn the target's own token stream.
"""

from __future__ import annotations

import logging
import math
import random
from typing import Iterator

import torch

# the torch-free part (reading the file), re-exported under the names it always had
from ..preflight.inputs import DatasetError, cache_dir, check_dataset_path  # noqa: F401
from .batch import Batch
from .conversations import load_conversations, sharegpt_path  # noqa: F401
from .sample import Sample  # loss mask: 1 on assistant tokens, including each turn's end-of-turn token

log = logging.getLogger(__name__)




# ----------------------------------------------------------------------------- tokenization


def template_ids(encoded) -> list[int]:
    # apply_chat_template(tokenize=True) returns a BatchEncoding in transformers 5, a list in 4.
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _prompt_ids(tokenizer, conv) -> list[int]:
    return template_ids(tokenizer.apply_chat_template(conv, tokenize=True, add_generation_prompt=True))


def tokenize_conversation(tokenizer, conv, max_len: int) -> Sample:
    """Chat-template ``conv``; the loss mask covers each assistant reply plus its end-of-turn token.

    Assistant spans are found by character offsets in the rendered text, so any template that
    puts the reply verbatim (or stripped) into its output works; the token right after a reply
    counts too when it is a special token (``<|im_end|>``, ``<|eot_id|>``, ...). Everything else
    (system and user turns, the template's headers such as ``<|im_start|>assistant\n``, an
    empty think block Qwen3's template inserts) carries no loss. A reply with a reasoning block
    (``<think>...</think>answer``) is matched by its answer, plus its reasoning where the template
    renders it (Qwen3 drops it from turns before the last user turn).
    """
    return _truncate(_tokenize_whole(tokenizer, conv), max_len)


def _tokenize_whole(tokenizer, conv) -> Sample:
    """:func:`tokenize_conversation` before the cut to ``max_len``."""
    last = conv[-1]
    if last["role"] == "assistant" and "token_ids" in last:
        ids = _prompt_ids(tokenizer, conv[:-1])
        gen = list(last["token_ids"])
        return Sample(ids + gen, [0] * len(ids) + [1] * len(gen))
    text = tokenizer.apply_chat_template(conv, tokenize=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    cursor, tok_i = 0, 0
    for k, m in enumerate(conv):
        if m["role"] == "assistant":
            found = _find_reply(tokenizer, conv, k, text, cursor)
            if found is None:
                continue  # a template that rewrites content; such a turn simply gets no loss
            start, end = found
            cursor = end
            while tok_i < len(ids) and offsets[tok_i][1] <= start:
                tok_i += 1
            while tok_i < len(ids) and offsets[tok_i][0] < end:
                mask[tok_i] = 1
                tok_i += 1
            if tok_i < len(ids) and ids[tok_i] in special:  # the end-of-turn token the model must emit
                mask[tok_i] = 1
            continue
        # Search each turn after the rendered text of the turns before it (when the template is
        # prefix-consistent), so a reply quoted in an earlier turn or the system prompt never matches.
        prior = tokenizer.apply_chat_template(conv[:k], tokenize=False) if k else ""
        if text.startswith(prior):
            cursor = max(cursor, len(prior))
        content = m["content"].strip()
        start = text.find(content, cursor) if content else -1
        if start >= 0:
            cursor = start + len(content)
    return Sample(ids, mask)


def _find_reply(tokenizer, conv, k: int, text: str, cursor: int) -> tuple[int, int] | None:
    """Character span ``[start, end)`` of assistant turn ``k``'s reply in the rendered ``text``.

    The reply is searched no earlier than where the template's generation prompt for it ends
    (the turns before it rendered with ``add_generation_prompt``), so a short reply ("a",
    "assistant", "id") never matches inside the header or an end-of-turn token's text. Where the
    template renders earlier turns differently once a reply follows (Qwen3 with
    ``enable_thinking: false`` puts an empty think block into the generation prompt only), the
    search starts where the two renderings part, less the reply's length: the reply may begin
    with what the generation prompt has there.
    """
    content = conv[k]["content"]
    answer, reasoning = content.strip(), ""
    if "</think>" in content:  # Qwen3-style reasoning: templates render or drop it apart from the answer
        head, _, tail = content.rpartition("</think>")
        answer, reasoning = tail.strip(), head.split("<think>")[-1].strip()
    if not answer:
        return None
    gen = tokenizer.apply_chat_template(conv[:k], tokenize=False, add_generation_prompt=True)
    if text.startswith(gen):
        lo = len(gen)
    else:
        same = next((i for i, (a, b) in enumerate(zip(gen, text)) if a != b), min(len(gen), len(text)))
        lo = same - len(answer)
    lo = max(cursor, lo)
    start = text.find(answer, lo)
    if start < 0:
        return None
    end = start + len(answer)
    if reasoning:  # rendered before the answer: the reasoning (and its <think> tag) carries loss too
        r = text.rfind(reasoning, lo, start)
        if r >= 0:
            t = text.rfind("<think>", lo, r)
            start = t if t >= 0 else r
    return start, end


def _truncate(s: Sample, max_len: int) -> Sample:
    return s.cut(max_len)


def build_samples(tokenizer, convs, *, max_len: int, min_loss_tokens: int, counts: dict | None = None,
                  long: str = "cut") -> list[Sample]:
    """Tokenize all conversations; drop those with fewer than ``min_loss_tokens`` loss tokens.

    A sample longer than ``max_len`` is cut to it, not dropped: its first ``max_len`` tokens
    still hold whole replies to learn from (the cut may then leave it too few loss tokens, and
    only then is it dropped). ``long="split"`` (`data.long_samples`) keeps the rest too, as
    consecutive windows of ``max_len`` tokens, each a sample of its own (a window starts
    mid-conversation: its context is the window only), ordered by rounds: every
    conversation's first window, then every second one, and so on. ``counts``, when given, gets
    ``over_length`` (cut or split) and ``too_few_loss_tokens`` (dropped), for :func:`data_report`.
    """
    rounds, over, few = [], 0, 0
    for c in convs:
        whole = _tokenize_whole(tokenizer, c)
        over += len(whole) > max_len
        pieces = whole.windows(max_len) if long == "split" else [_truncate(whole, max_len)]
        for k, s in enumerate(pieces):
            if k == len(rounds):
                rounds.append([])
            if s.loss_tokens >= min_loss_tokens:
                rounds[k].append(s)
            else:
                few += 1
    # windows in rounds: every conversation's first, then every second one, ...: the first N
    # samples (data.max_samples) span as many conversations as they can
    out = [s for r in rounds for s in r]
    if counts is not None:
        counts.update(over_length=over, too_few_loss_tokens=few, long=long)
    return out


def data_report(counts: dict, *, max_len: int, samples: int) -> str:
    """The one line a run prints about its data: records read, dropped by reason (reading:
    conversations.DROP_REASONS; tokenizing: too few loss tokens), cut for length."""
    from .conversations import DROP_REASONS

    dropped = [f"{r} {counts[r]}" for r in (*DROP_REASONS, "too_few_loss_tokens") if counts.get(r)]
    read = f"{counts['records_read']} records read, " if "records_read" in counts else ""
    if "conversations" in counts:
        short = f" (asked for {counts['asked']})" if counts["conversations"] < counts.get("asked", 0) else ""
        held = f", {counts['held_out']} held out for eval" if counts.get("held_out") else ""
        if counts.get("held_out_repeats"):
            held += f" ({counts['held_out_repeats']} repeating a held-out prompt left out of training)"
        read += f"{counts['conversations']} conversations{short}{held}, "
    how = "split into windows of" if counts.get("long") == "split" else "cut to"
    return (f"data: {read}{samples} training samples; dropped: {', '.join(dropped) or 'none'}; "
            f"over_length {counts.get('over_length', 0)} ({how} data.max_len={max_len})")


def split_heldout(items, *, eval_fraction: float = 0.05, min_eval: int = 8, seed: int = 0,
                  key=None, counts: dict | None = None) -> tuple[list, list]:
    """Deterministic ``(train, eval)`` split; both keep the input order.

    ``max(min_eval, ceil(eval_fraction * n))`` items go to eval, but never more than half.
    ``key(item)``, when given, returns the set of keys an item is known by: a training item
    that shares one with a held-out item is left out of training (``counts['held_out_repeats']``),
    so a prompt that occurs twice in a data set is never both trained on and scored.
    """
    items = list(items)
    n = len(items)
    n_eval = min(max(min_eval, math.ceil(eval_fraction * n)), n // 2)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    held = set(order[:n_eval])
    train, ev = [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]
    if key is not None:
        seen = set().union(*(key(x) for x in ev))
        kept = [x for x in train if seen.isdisjoint(key(x))]
        if counts is not None:
            counts["held_out_repeats"] = len(train) - len(kept)
        train = kept
    return train, ev


# ----------------------------------------------------------------------------- prompts and regeneration


def _first_turn(conv) -> list[dict]:
    """The optional system prompt and the first user turn."""
    system = [m for m in conv[:1] if m["role"] == "system"]
    user = next(m for m in conv if m["role"] == "user")
    return system + [{"role": "user", "content": user["content"]}]


def truncated_prompt(tokenizer, conv, max_prompt_len: int) -> tuple[list[dict], list[int]]:
    """First turn with the user text cut so the templated prompt fits ``max_prompt_len`` tokens.

    Cutting the user text (not the templated ids) keeps the template's structure intact, and
    re-templating the returned messages gives exactly the returned ids.
    """
    msgs = _first_turn(conv)
    ids = _prompt_ids(tokenizer, msgs)
    if len(ids) <= max_prompt_len:
        return msgs, ids
    user_ids = tokenizer(msgs[-1]["content"], add_special_tokens=False)["input_ids"]
    keep = max(0, len(user_ids) - (len(ids) - max_prompt_len))
    while True:  # decode/encode can shift a token or two: shrink until it fits
        msgs[-1] = {"role": "user", "content": tokenizer.decode(user_ids[:keep])}
        ids = _prompt_ids(tokenizer, msgs)
        if len(ids) <= max_prompt_len or keep == 0:
            return msgs, ids[:max_prompt_len]
        keep = max(0, keep - max(1, len(ids) - max_prompt_len))


def prompts_for_eval(tokenizer, convs, *, max_prompt_len: int) -> list[list[int]]:
    """Chat-templated prompt ids (system?, first user turn, assistant generation prompt)."""
    return [truncated_prompt(tokenizer, c, max_prompt_len)[1] for c in convs]


# ----------------------------------------------------------------------------- batches


def batches(samples, *, batch_size: int, seed: int, pad_id: int, bucket: bool = True,
            start: int = 0, batch_id=None) -> Iterator[Batch]:
    """Infinite, deterministic stream of right-padded batches.

    Each epoch reshuffles with ``(seed, epoch)``. With ``bucket``, samples are sorted by length
    inside pools of ``50 * batch_size`` (less padding) and the batches are shuffled again so
    lengths still mix across steps. The incomplete last batch of an epoch is dropped (a new
    shuffle uses those samples next epoch), so every batch has ``min(batch_size, len(samples))``
    rows. ``start`` skips that many batches without building them (resume). ``batch_id``
    maps the stream position to the batch's id (default: the position itself; a layout's
    drafter shard: the global batch id, see run/roles/layout.py).
    """
    if not samples:
        raise ValueError("batches: no samples")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    bs = min(batch_size, len(samples))
    index, epoch = 0, 0
    while True:
        for group in _epoch_batches(samples, bs, seed, epoch, bucket):
            if index >= start:
                yield collate([samples[i] for i in group], pad_id, index if batch_id is None else batch_id(index))
            index += 1
        epoch += 1


def _epoch_batches(samples, bs: int, seed: int, epoch: int, bucket: bool) -> list[list[int]]:
    rng = random.Random(f"{seed}:{epoch}")
    order = list(range(len(samples)))
    rng.shuffle(order)
    order = order[: len(order) - len(order) % bs]
    if bucket:
        pool = 50 * bs
        order = [i for p in range(0, len(order), pool)
                 for i in sorted(order[p:p + pool], key=lambda i: len(samples[i]))]
    groups = [order[b:b + bs] for b in range(0, len(order), bs)]
    if bucket:
        rng.shuffle(groups)
    return groups


def collate(group: list[Sample], pad_id: int, index: int) -> Batch:
    """The one place a batch is built: its id, padded tensors and (host) lengths."""
    width = max(len(s) for s in group)
    ids = torch.full((len(group), width), pad_id, dtype=torch.long)
    am = torch.zeros((len(group), width), dtype=torch.long)
    lm = torch.zeros((len(group), width), dtype=torch.long)
    for r, s in enumerate(group):
        n = len(s)
        ids[r, :n] = torch.from_numpy(s.ids)  # int32 -> int64 in the copy
        am[r, :n] = 1
        lm[r, :n] = torch.from_numpy(s.mask)
    return Batch(index=index, input_ids=ids, attention_mask=am, loss_mask=lm,
                 lengths=[len(s) for s in group])

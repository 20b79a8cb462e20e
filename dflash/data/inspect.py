"""`dflash data inspect PATH [--target SPEC]`: what a data set holds, before GPU hours go
into it.

- records read, used, and dropped by reason (data/conversations.DROP_REASONS, plus
  `over_length`: longer than data.max_len after the chat template, so training would cut it);
- token lengths after the target's chat template, as a histogram;
- the share of tokens that carry loss (the assistant replies and their end-of-turn tokens);
- a few examples rendered with the loss-masked spans marked `[[...]]`.

It reads up to `--records` records (streamed) and tokenizes the usable ones with the
tokenizer its caller gives it (the command loads the target's).
"""
from __future__ import annotations

import json

BINS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)


def inspect(records: list, tokenizer, *, target: str, max_len: int, examples: int, chat_template: str = "",
            chat_template_kwargs: dict | None = None) -> dict:
    """The report of `records` through `tokenizer` (the target's, which the caller loads: the
    command, model/target.load_tokenizer), with `chat_template` and its variables in place of
    its own template where given. `target` names whose tokenizer it is, in the report."""
    from . import chat_template as T
    from . import conversations as C
    from .dataset import tokenize_conversation

    tok = T.configure(tokenizer, chat_template, chat_template_kwargs)
    dropped = {r: 0 for r in (*C.DROP_REASONS, "over_length")}
    lengths, loss_tokens, shown = [], 0, []
    for rec in records:
        conv, reason = C.classify(rec)
        if conv is None:
            dropped[reason] += 1
            continue
        s = tokenize_conversation(tok, conv, max_len=1 << 30)
        if len(s.input_ids) > max_len:
            dropped["over_length"] += 1
        lengths.append(len(s.input_ids))
        loss_tokens += sum(s.loss_mask)
        if len(shown) < examples:
            shown.append(render(tok, s.input_ids, s.loss_mask))
    used = len(records) - sum(v for k, v in dropped.items() if k != "over_length")
    hist, lo = {}, 0
    for hi in BINS + (None,):
        label = f"{lo}-{hi - 1}" if hi else f">={lo}"
        hist[label] = sum(1 for n in lengths if n >= lo and (hi is None or n < hi))
        lo = hi or lo
    total = sum(lengths)
    return {"target": target, "chat_template": chat_template or None, "chat_template_kwargs": chat_template_kwargs or {},
            "records_read": len(records), "used": used, "dropped": dropped,
            "max_len": max_len, "token_length_histogram": hist,
            "tokens": total, "loss_tokens": loss_tokens, "loss_share": round(loss_tokens / total, 4) if total else 0.0,
            "examples": shown}


def render(tok, ids: list[int], mask: list[int]) -> str:
    """The sample's text with the spans that carry loss inside [[ ]]."""
    out, i = [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and mask[j] == mask[i]:
            j += 1
        text = tok.decode(ids[i:j], skip_special_tokens=False)
        out.append(f"[[{text}]]" if mask[i] else text)
        i = j
    return "".join(out)


def format_report(r: dict) -> str:
    drops = ", ".join(f"{k} {v}" for k, v in r["dropped"].items() if v) or "none"
    head = f"tokenizer and chat template of {r['target']}"
    if r.get("chat_template"):
        head = f"tokenizer of {r['target']}, chat template {r['chat_template']}"
    if r.get("chat_template_kwargs"):
        head += f", template variables {json.dumps(r['chat_template_kwargs'])}"
    lines = [f"data set {r['path']} ({head})",
             f"records read {r['records_read']}, used {r['used']}; dropped: {drops}",
             f"tokens {r['tokens']:,}, of which carry loss {r['loss_tokens']:,} ({100 * r['loss_share']:.1f}%)",
             "token lengths after the chat template:"]
    peak = max(r["token_length_histogram"].values(), default=0) or 1
    for label, n in r["token_length_histogram"].items():
        lines.append(f"  {label:>10} {n:7d} {'#' * round(40 * n / peak)}")
    for k, ex in enumerate(r["examples"], 1):
        lines += [f"example {k} (loss on [[...]]):", "  " + ex.replace("\n", "\n  ")]
    return "\n".join(lines)

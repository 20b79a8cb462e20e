"""`dflash data inspect PATH [--target SPEC]`: what a data set holds, before GPU hours go
into it.

- records read, used, and dropped by reason (data/conversations.DROP_REASONS, plus
  `over_length`: longer than data.max_len after the chat template, so training would cut it);
- token lengths after the target's chat template, as a histogram;
- the share of tokens that carry loss (the assistant replies and their end-of-turn tokens);
- a few examples rendered with the loss-masked spans marked `[[...]]`.

It reads up to `--records` records (streamed) and tokenizes the usable ones.
"""
from __future__ import annotations

import json

from ..config import ConfigError

BINS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)


def add_command(sub) -> None:
    d = sub.add_parser("data", help="look at a data set before training on it")
    dsub = d.add_subparsers(dest="data_cmd", required=True)
    i = dsub.add_parser("inspect", help="records used and dropped (by reason), token lengths, loss share, examples")
    i.add_argument("path", metavar="PATH", help="what data.path takes: a file, a glob, a directory, a comma list")
    i.add_argument("--target", default="tiny-qwen3", help="whose tokenizer and chat template (default tiny-qwen3)")
    i.add_argument("--chat-template", default="", metavar="FILE",
                   help="data.chat_template: a Jinja file that replaces the target's chat template")
    i.add_argument("--chat-template-kwargs", default="", metavar="JSON",
                   help='data.chat_template_kwargs: template variables as a JSON object, e.g. \'{"enable_thinking": false}\'')
    i.add_argument("--max-len", type=int, default=256, help="data.max_len: longer samples count as over_length")
    i.add_argument("--records", type=int, default=10_000, help="read at most this many records (default 10,000)")
    i.add_argument("--examples", type=int, default=3, help="rendered examples (default 3)")
    i.add_argument("--json", action="store_true", help="last line: one JSON object")


def run(a) -> int:
    from . import chat_template
    from . import conversations as C
    from ..preflight.inputs import DatasetError, TargetSpecError, check_dataset_path, check_target_spec, data_files

    for name, v, lo in (("--max-len", a.max_len, 2), ("--records", a.records, 1), ("--examples", a.examples, 0)):
        if v < lo:
            raise ConfigError(f"{name}={v}: expected an integer >= {lo}")
    kwargs = _template_kwargs(a.chat_template_kwargs)
    try:  # before the tokenizer (and torch) loads
        chat_template.check(a.chat_template, kwargs)
        check_dataset_path(a.path)
        check_target_spec(a.target, probe_hub=True)
        records = [r for p in data_files(a.path) for r in _take(C._iter_records(p), a.records)][:a.records]
    except (DatasetError, TargetSpecError) as e:
        raise ConfigError(str(e)) from None
    report = inspect(records, a.target, max_len=a.max_len, examples=a.examples,
                     chat_template=a.chat_template, chat_template_kwargs=kwargs)
    report["path"] = a.path
    print(format_report(report))
    if a.json:
        print(json.dumps(report))
    return 0


def _template_kwargs(text: str) -> dict:
    if not text.strip():
        return {}
    from ..preflight.inputs import json_loads, short_repr as _short

    try:
        return json_loads(text)
    except ValueError as e:  # not JSON, or nested too deeply
        raise ConfigError(f"--chat-template-kwargs={_short(text)}: not JSON ({e}); expected an object such as "
                          f"'{{\"enable_thinking\": false}}'") from None


def _take(it, n):
    for i, r in enumerate(it):
        if i >= n:
            return
        yield r


def inspect(records: list, target: str, *, max_len: int, examples: int, chat_template: str = "",
            chat_template_kwargs: dict | None = None) -> dict:
    from . import chat_template as T
    from . import conversations as C
    from .dataset import tokenize_conversation
    from ..model.target import load_tokenizer

    tok = T.configure(load_tokenizer(target), chat_template, chat_template_kwargs)
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

"""`dflash data inspect PATH [--target SPEC]`: what a data set holds, before GPU hours go
into it (data/inspect.py). The flags and the data path are checked before the tokenizer
(and torch) loads."""
from __future__ import annotations

import json

from ..errors import ConfigError


def add_parser(sub) -> None:
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
    from ..phases import add_telemetry_flag
    add_telemetry_flag(i)


def run(a) -> int:
    from .. import phases
    from ..data import chat_template
    from ..data import conversations as C
    from ..data.inspect import format_report, inspect
    from ..preflight.inputs import check_dataset_path, check_target_spec, data_files

    with phases.phase("check_inputs"):  # before the tokenizer (and torch) loads
        for name, v, lo in (("--max-len", a.max_len, 2), ("--records", a.records, 1), ("--examples", a.examples, 0)):
            if v < lo:
                raise ConfigError(f"{name}={v}: expected an integer >= {lo}")
        phases.check_telemetry_dir(a.telemetry_dir)
        kwargs = _template_kwargs(a.chat_template_kwargs)
        chat_template.check(a.chat_template, kwargs)
        check_dataset_path(a.path)
        check_target_spec(a.target, probe_hub=True)
    phases.start("data inspect", file_dir=a.telemetry_dir, argv=a.argv)
    with phases.phase("read_records") as ph:
        records = [r for p in data_files(a.path) for r in _take(C._iter_records(p), a.records)][:a.records]
        ph.set(records=len(records))
    with phases.phase("load_tokenizer", target=a.target):
        from ..model.target import load_tokenizer  # transformers (and torch): only once the input is good
        tok = load_tokenizer(a.target)
    with phases.phase("inspect", records=len(records)) as ph:
        report = inspect(records, tok, target=a.target, max_len=a.max_len, examples=a.examples,
                         chat_template=a.chat_template, chat_template_kwargs=kwargs)
        ph.set(used=report["used"], **{f"data.{k}": v for k, v in report["dropped"].items()})  # as train's
    report["path"] = a.path
    print(format_report(report))
    if a.json:
        print(json.dumps(report))
    if report["used"] < 2:  # train refuses it (one to train on, one held out): the report says why, the exit status tells a script
        from ..preflight.inputs import DatasetError
        why = ", ".join(f"{k} {v}" for k, v in report["dropped"].items() if v and k != "over_length") or "none read"
        raise DatasetError(f"dataset '{a.path}': {report['used']} usable conversation(s) in {report['records_read']} "
                           f"records ({why}); train would refuse it (it needs at least 2: one to train on, one "
                           f"held out)")
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

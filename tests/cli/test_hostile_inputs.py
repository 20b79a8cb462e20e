"""Files from elsewhere (issue 29, items 4 and 6): bounded work for any input, and one line,
exit 2, for every malformed file. Each test builds the attacker's actual file: a gzip bomb, a
YAML alias bomb, JSON nested 100k deep, a looping chat template, a sparse 3 GB config.json,
an index.json whose shard leaves FEATS, shards and safetensors headers that lie, a poisoned
regeneration cache, telemetry lines that are JSON but not spans.
"""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, TINY, cli_before_torch

GIB = 2**30


def _rec(i: int) -> str:
    return json.dumps({"conversations": [{"from": "human", "value": f"question {i}"},
                                         {"from": "gpt", "value": f"answer {i}"}]})


def _run_py(code: str, *args, env=None, timeout=300) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=timeout)


# ----------------------------------------------------------------------------- data records

# the peak as VmHWM, this process image's own: ru_maxrss would carry pytest's resident set from
# before the exec (bench/peak_rss.py says why)
_LOAD_AND_MEASURE = """
import json, sys
from dflash.data import conversations as C
from dflash.preflight.memory import process_memory
counts = {}
convs = C.load_conversations(sys.argv[1], limit=int(sys.argv[2]), counts=counts)
print(json.dumps({"conversations": len(convs), "counts": counts, "peak_rss_mb": process_memory()[1] // 2**20}))
"""


def _gzip_bomb(path: Path, *, line_bytes: int = GIB) -> None:
    """About 1 MB of gzip holding one 1 GiB line between good records. Written as gzip members
    of 16 MiB each, compressed once (a gzip file may be several members): fast to build."""
    member = gzip.compress(b"a" * (16 << 20), compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress((_rec(0) + '\n{"conversations": "').encode()))
        for _ in range(line_bytes // (16 << 20)):
            f.write(member)
        f.write(gzip.compress(('"}\n' + _rec(1) + "\n" + _rec(2) + "\n").encode()))


def test_a_gzip_bomb_line_is_too_large_and_skipped_in_bounded_memory(tmp_path):
    bomb = tmp_path / "bomb.jsonl.gz"
    _gzip_bomb(bomb)
    assert bomb.stat().st_size < 2 * 2**20
    p = _run_py(_LOAD_AND_MEASURE, bomb, 3, env={"DFLASH_CACHE": str(tmp_path / "cache")})
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"\ngzip bomb (1 GiB line): peak RSS {r['peak_rss_mb']} MB")
    assert r["conversations"] == 3 and r["counts"]["too_large"] == 1, r
    assert r["peak_rss_mb"] < 1536, r  # the bound: under 1.5 GB (it took 2.2 GB)


def test_records_over_the_cap_are_counted_in_every_text_format(tmp_path, monkeypatch):
    """A small cap (DFLASH_MAX_RECORD_MB=1) to keep it fast: a long line, a long array element
    (skipped without parsing it, escapes and brackets in strings included), and a record that
    is small in bytes but millions of values once parsed."""
    from dflash.data import conversations as C

    big = '{"conversations": "' + 'x\\"[{' * (300_000) + '"}'  # 1.5 MB
    dense = '{"conversations": [' + "{}," * 120_000 + "{}]}"   # 0.4 MB, 120k dicts
    (tmp_path / "d.jsonl").write_text("\n".join([_rec(0), big, _rec(1), dense, _rec(2)]) + "\n")
    (tmp_path / "d.json").write_text("[" + ", ".join([_rec(0), big, _rec(1), dense, _rec(2)]) + "]")
    for name in ("d.jsonl", "d.json"):
        recs = list(C._iter_records(tmp_path / name, chunk=4096, max_record=2**20))
        got = C.drop_counts(recs)
        assert len(recs) == 5 and got["too_large"] == 1, (name, got)  # the dense one is only 0.4 MB
    monkeypatch.setattr(C, "MAX_RECORD_VALUES", 100_000)
    for name in ("d.jsonl", "d.json"):
        recs = list(C._iter_records(tmp_path / name, chunk=4096, max_record=2**20))
        assert C.drop_counts(recs)["too_large"] == 2 and sum(isinstance(r, dict) for r in recs) == 3, name


def test_json_nested_100k_deep_in_a_data_file(tmp_path):
    """A JSON Lines record nested 100k deep is a dropped record (`not_json`); a JSON array that
    nests that deep is one line, exit 2, before torch."""
    deep = "[" * 100_000 + "]" * 100_000
    lines = tmp_path / "d.jsonl"
    lines.write_text(deep + "\n" + "\n".join(_rec(i) for i in range(3)) + "\n")
    from dflash.data import conversations as C
    assert C.drop_counts(C._iter_records(lines))["not_json"] == 1
    array = tmp_path / "d.json"
    array.write_text('[{"conversations": ' + deep + "}]")
    out, err = cli_before_torch("train", "--out", tmp_path / "run", *TINY, "--set", f"data.path={array}")
    assert out == {"rc": 2, "torch": False} and len(err) == 1 and "nested too deeply" in err[0], err


@pytest.mark.parametrize("kind", ["random_parquet", "broken_saved", "saved_escapes"])
def test_parquet_and_saved_datasets_that_are_not_what_they_say(tmp_path, kind):
    if kind == "random_parquet":
        path = tmp_path / "d.parquet"
        path.write_bytes(os.urandom(4096))
        needle = "not a parquet file"
    else:
        datasets = pytest.importorskip("datasets")
        path = tmp_path / "saved"
        datasets.Dataset.from_list([json.loads(_rec(i)) for i in range(3)]).save_to_disk(str(path))
        state = json.loads((path / "state.json").read_text())
        if kind == "broken_saved":
            next(path.glob("*.arrow")).unlink()
            needle = "is missing"
        else:
            state["_data_files"] = [{"filename": "../../etc/passwd"}]
            (path / "state.json").write_text(json.dumps(state))
            needle = "leads outside"
    out, err = cli_before_torch("train", "--out", tmp_path / "run", *TINY, "--set", f"data.path={path}")
    assert out == {"rc": 2, "torch": False} and len(err) == 1 and needle in err[0], err


def test_a_saved_dataset_with_a_corrupt_arrow_file_is_one_line(tmp_path):
    """Past the cheap checks: arrow itself fails while rows are read; one line naming the dir."""
    datasets = pytest.importorskip("datasets")
    from dflash.data import conversations as C
    from dflash.preflight.inputs import DatasetError

    path = tmp_path / "saved"
    datasets.Dataset.from_list([json.loads(_rec(i)) for i in range(3)]).save_to_disk(str(path))
    arrow = next(path.glob("*.arrow"))
    arrow.write_bytes(os.urandom(arrow.stat().st_size))
    with pytest.raises(DatasetError, match="not a readable saved dataset"):
        C.load_conversations(str(path), limit=2)


# ----------------------------------------------------------------------------- YAML and JSON

_BOMB_YAML = """data:
  chat_template_kwargs:
    a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
    b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
    c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
    d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
    e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
    f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
    g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
    h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
    i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


@pytest.mark.parametrize("where", ["config", "set", "deep", "cycle", "inspect_kwargs"])
def test_yaml_bombs_and_deep_documents_are_one_line(tmp_path, where):
    """A ~600-byte alias bomb (9^9 values when walked; it took 57 s and 4 GB), a document that
    contains itself, and one nested 100k deep: one line, exit 2, before torch."""
    assert len(_BOMB_YAML) < 620
    args = ["train", "--out", tmp_path / "run", *TINY]
    if where in ("config", "cycle", "deep"):
        cfg = tmp_path / "c.yaml"
        cfg.write_text({"config": _BOMB_YAML, "cycle": "data: {chat_template_kwargs: {x: &x [*x]}}\n",
                        "deep": "data: {chat_template_kwargs: {x: " + "[" * 100_000 + "]" * 100_000 + "}}\n"}[where])
        args += ["--config", cfg]
    elif where == "set":
        inner = "{" + ", ".join(ln.strip() for ln in _BOMB_YAML.splitlines()[2:]) + "}"
        args += ["--set", f"data.chat_template_kwargs={inner}"]
    else:
        args = ["data", "inspect", tmp_path / "d.jsonl", "--chat-template-kwargs", "[" * 100_000]
        (tmp_path / "d.jsonl").write_text(_rec(0) + "\n")
    out, err = cli_before_torch(*args, timeout=60)
    assert out == {"rc": 2, "torch": False} and len(err) == 1, err
    assert ("expand to more than" in err[0] or "refers to a node that contains it" in err[0]
            or "nested too deeply" in err[0]), err
    assert len(err[0]) < 600, err[0]


def test_yaml_anchors_that_stay_small_still_work():
    from dflash.config import load_config

    cfg = load_config(None, ["data.chat_template_kwargs={a: &a [1, 2], b: [*a, *a]}"])
    assert cfg.data.chat_template_kwargs == {"a": [1, 2], "b": [[1, 2], [1, 2]]}


def test_json_files_nested_100k_deep_or_too_large_are_one_line(tmp_path):
    """A target's config.json nested 100k deep, and one of 3 GB (a sparse file: nothing is
    written, and nothing of it may be read): one line, exit 2, before torch."""
    for kind, needle in (("deep", "nested too deeply"), ("huge", "over the")):
        d = tmp_path / kind
        d.mkdir()
        cfg = d / "config.json"
        if kind == "deep":
            cfg.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
        else:
            with open(cfg, "wb") as f:
                f.truncate(3 * GIB)
        out, err = cli_before_torch("train", "--out", tmp_path / "run", "--target", d, *TINY, timeout=60)
        assert out == {"rc": 2, "torch": False} and len(err) == 1 and needle in err[0], (kind, err)


# ----------------------------------------------------------------------------- chat templates

_LOOP = "{% for m in messages %}{{ m.content }}{% endfor %}" \
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("kind,needle", [
    ("loop", "rendering stopped"),  # by the step cap or the clock, whichever this machine reaches first
    ("filtered_loop", "over 2 s"),
    ("literal", "output over"),
    ("repeat", "a repetition of"),
    ("doubling", "a string of"),
    ("width", "an argument of"),
    ("format", "a format with a field width"),
    ("recursion", "recursion too deep"),
])
def test_a_chat_template_that_loops_or_grows_is_one_line(tmp_path, kind, needle):
    """`data.chat_template`: refused before torch loads (the probe render runs in the budgeted
    sandbox), within the time bound."""
    body = {
        "loop": _LOOP,
        "filtered_loop": "{% for i in range(100000) %}{% for j in range(100000) if j < 0 %}{% endfor %}{% endfor %}",
        "literal": "{% for i in range(100000) %}{% for j in range(100000) %}" + "x" * 200 + "{% endfor %}{% endfor %}",
        "repeat": "{{ 'x' * 100000 * 100000 }}",
        "doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                    "{% endfor %}{{ ns.s|length }}",
        "width": "{{ 'x'|center(10000000000) }}",
        "format": "{{ '%999999999d' % 1 }}",
        "recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    }[kind]
    tpl = tmp_path / "chat.jinja"
    tpl.write_text(body)
    out, err = cli_before_torch("train", "--out", tmp_path / "run", *TINY, "--set", f"data.chat_template={tpl}",
                                timeout=60, env={"DFLASH_RENDER_SECONDS": "2"})
    assert out == {"rc": 2, "torch": False} and len(err) == 1, err
    assert f"data.chat_template='{tpl}'" in err[0] and "rendering stopped" in err[0] and needle in err[0], err


def test_a_tokenizer_whose_own_template_loops_is_one_line(tmp_path):
    """The template that comes with a target dir is rendered by transformers: its compile
    step builds it in the budgeted sandbox, so the probe at load time stops it and names it."""
    from dflash.preflight.inputs import smollm2_cache_entry

    tok_dir = smollm2_cache_entry("-tokenizer")
    if tok_dir is None or not tok_dir.is_dir():
        pytest.skip("the SmolLM2 tokenizer is not cached")
    import shutil

    d = tmp_path / "target"
    shutil.copytree(tok_dir, d)
    (d / "chat_template.jinja").write_text(_LOOP)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    data = tmp_path / "d.jsonl"
    data.write_text(_rec(0) + "\n")
    p = subprocess.run([sys.executable, "-m", "dflash", "data", "inspect", str(data), "--target", str(d)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, DFLASH_RENDER_SECONDS="2"))
    err = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(err) == 1, p.stderr[-2000:]
    assert f"the chat template of '{d}'" in err[0] and "rendering stopped" in err[0], err


def test_ordinary_templates_render_as_before(tmp_path):
    """The budget changes nothing a real template renders (the published ones are checked span
    by span in test_chat_templates.py, through the same sandbox)."""
    from dflash.data.chat_template import _environment

    src = ("{% for m in messages %}{{ '<|' + m.role + '|>' }}{{ m.content ~ '\\n' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ '%s' % 'go' }}{% endif %}")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo " * 3}]
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    plain = ImmutableSandboxedEnvironment().from_string(src)
    for gen in (False, True):
        assert _environment().from_string(src).render(messages=msgs, add_generation_prompt=gen) == \
            plain.render(messages=msgs, add_generation_prompt=gen)


# ----------------------------------------------------------------------------- features dirs

def _write_capture(d: Path, positions=(0, 1, 2, 3), *, index: bool = True) -> dict:
    """A features dir as `dflash capture` writes it (its own ShardWriter and index layout),
    small: 4 samples of 8-feature rows."""
    import numpy as np
    import torch

    from dflash.data.sample import Sample
    from dflash.offline.feature_index import FORMAT, VERSION
    from dflash.offline.feature_shards import ShardWriter, capture_id, index_entry

    d.mkdir(parents=True, exist_ok=True)
    key = {"target": "tiny-qwen3", "target_seed": 0, "arch": "0" * 16, "layer_ids": [1, 2, 3],
           "dtype": "float32", "data": "f" * 64}
    w = ShardWriter(d, 0, shard_bytes=1 << 30, capture=capture_id(key))
    for p in positions:
        n = 20 + abs(p)
        w.add(p, Sample(np.arange(n) % 50, np.ones(n, dtype=np.uint8)), torch.zeros(n, 8))
    shards = w.finish()
    idx = {"format": FORMAT, "version": VERSION, "key": key, "feature_dim": 8, "samples": len(positions),
           "tokens": sum(s["tokens"] for s in shards), "shards": [index_entry(s) for s in shards],
           "data": {"max_len": 96, "min_loss_tokens": 16}}
    (d / "target").mkdir(exist_ok=True)
    (d / "target" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    if index:
        (d / "index.json").write_text(json.dumps(idx))
    return idx


def _rewrite_header(f: Path, change) -> None:
    """Edit a safetensors file's JSON header in place (the bytes after it stay as they are)."""
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    change(header)
    new = json.dumps(header).encode()
    f.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])


def _train_features(tmp_path, d):
    return cli_before_torch("train", "--features", d, "--out", tmp_path / "run", "--steps", 2, *TINY, timeout=60)


def test_a_well_formed_capture_passes_the_checks(tmp_path):
    from dflash.offline.feature_index import read_index

    d = tmp_path / "feats"
    _write_capture(d)
    idx = read_index(str(d))
    assert idx["samples"] == 4


@pytest.mark.parametrize("where,needle", [
    ("../run/checkpoint/model.safetensors", "leads outside"),
    ("/etc/passwd", "leads outside"),
    ("symlink", "leads outside"),
])
def test_a_shard_path_that_leaves_feats_is_refused_before_it_is_opened(tmp_path, where, needle):
    d = tmp_path / "feats"
    idx = _write_capture(d)
    if where == "symlink":  # a name inside FEATS that resolves outside it
        (tmp_path / "outside.safetensors").write_bytes((d / idx["shards"][0]["file"]).read_bytes())
        (d / "shard-r0-00009.safetensors").symlink_to(tmp_path / "outside.safetensors")
        where = "shard-r0-00009.safetensors"
    else:
        victim = (d / where).resolve()
        if not victim.exists():
            victim.parent.mkdir(parents=True)
            victim.write_bytes(b"a run's own weights")
    idx["shards"][0]["file"] = where
    (d / "index.json").write_text(json.dumps(idx))
    out, err = _train_features(tmp_path, d)
    assert out == {"rc": 2, "torch": False} and len(err) == 1 and needle in err[0], err
    assert "refused before it is opened" in err[0], err


@pytest.mark.parametrize("case,needle", [
    ("deep", "nested too deeply"),
    ("huge", "over the"),
    ("not_json", "is unreadable"),
    ("shards_not_a_list", "is malformed (shards"),
    ("no_key", "is malformed (key"),
    ("dtype_not_a_dtype", "is malformed (key.dtype"),
    ("layer_ids_strings", "is malformed (key.layer_ids"),
    ("samples_negative", "is malformed (samples"),
    ("counts_lie", "index.json says"),
    ("listed_twice", "lists a shard twice"),
    ("samples_short", "the shards hold 4 samples, index.json says 5"),
])
def test_a_malformed_index_is_one_line(tmp_path, case, needle):
    d = tmp_path / "feats"
    idx = _write_capture(d)
    f = d / "index.json"
    if case == "deep":
        f.write_text('{"format": "dflash-features", "version": 1, "key": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif case == "huge":
        with open(f, "wb") as fh:
            fh.truncate(3 * GIB)  # sparse: nothing written, and nothing may be read
    elif case == "not_json":
        f.write_text('{"format": "dflash-features", ')
    else:
        if case == "shards_not_a_list":
            idx["shards"] = "shard-r0-00000.safetensors"
        elif case == "no_key":
            del idx["key"]
        elif case == "dtype_not_a_dtype":
            idx["key"]["dtype"] = "load"  # getattr(torch, dtype) would hand back torch.load
        elif case == "layer_ids_strings":
            idx["key"]["layer_ids"] = ["1"]
        elif case == "samples_negative":
            idx["samples"] = -1
        elif case == "counts_lie":
            idx["shards"][0]["tokens"] += 1
        elif case == "listed_twice":
            idx["shards"].append(dict(idx["shards"][0]))
        else:
            idx["samples"] = 5
        f.write_text(json.dumps(idx))
    out, err = _train_features(tmp_path, d)
    assert out == {"rc": 2, "torch": False} and len(err) == 1 and needle in err[0], err


def _shard_lies(d: Path, case: str) -> None:
    f = next(d.glob("shard-*.safetensors"))
    if case == "offsets_overlap":  # input_ids moved onto the bytes at the data's start, size unchanged
        def overlap(h):
            b, e = h["input_ids"]["data_offsets"]
            start = 0 if b else h["features"]["data_offsets"][1]
            h["input_ids"]["data_offsets"] = [start, start + e - b]
        _rewrite_header(f, overlap)
    elif case == "offsets_past_end":
        def grow(h):
            b, e = h["loss_mask"]["data_offsets"]
            h["loss_mask"].update(data_offsets=[b, e + 10**12], shape=[e + 10**12 - b])
        _rewrite_header(f, grow)
    elif case == "shape_lies":
        _rewrite_header(f, lambda h: h["features"].update(shape=[h["features"]["shape"][0], 4]))
    elif case == "extra_tensor":
        def extra(h):
            end = max(v["data_offsets"][1] for k, v in h.items() if k != "__metadata__")
            h["evil"] = {"dtype": "U8", "shape": [0], "data_offsets": [end, end]}
        _rewrite_header(f, extra)
    elif case == "wrong_dtype":
        _rewrite_header(f, lambda h: h["sample"].update(dtype="F64"))
    elif case == "offsets_fall":  # the header is honest, the offsets tensor's bytes are not
        import numpy as np
        raw = bytearray(f.read_bytes())
        n = int.from_bytes(raw[:8], "little")
        h = json.loads(raw[8:8 + n])
        b, e = h["offsets"]["data_offsets"]
        offs = np.frombuffer(bytes(raw[8 + n + b:8 + n + e]), dtype="<i8").copy()
        offs[1], offs[2] = offs[2], offs[1]
        raw[8 + n + b:8 + n + e] = offs.tobytes()
        f.write_bytes(bytes(raw))
    elif case == "not_safetensors":
        f.write_bytes(os.urandom(4096))


@pytest.mark.parametrize("case,needle", [
    ("offsets_overlap", "overlap or leave a gap"),
    ("offsets_past_end", "truncated"),
    ("shape_lies", "needs"),
    ("extra_tensor", "is not a features shard"),
    ("wrong_dtype", "expected a 1-d I64"),
    ("offsets_fall", "offsets do not rise"),
    ("not_safetensors", "is not a whole shard"),
])
def test_shards_whose_headers_or_offsets_lie_are_one_line(tmp_path, case, needle):
    d = tmp_path / "feats"
    _write_capture(d)
    _shard_lies(d, case)
    out, err = _train_features(tmp_path, d)
    assert out == {"rc": 2, "torch": False} and len(err) == 1 and needle in err[0], err


@pytest.mark.parametrize("case,needle", [
    ("negative", "negative or repeated"),
    ("repeated_across", "holds samples another shard holds too"),
    ("header_lies", "is not a whole shard"),
])
def test_crafted_shards_on_capture_resume_are_refused_up_front(tmp_path, case, needle):
    """Before torch loads, not after capturing everything else (the first version found a
    negative position only when it wrote the index)."""
    d = tmp_path / "feats"
    if case == "negative":
        _write_capture(d, positions=(0, -5, 2), index=False)
    elif case == "repeated_across":
        _write_capture(d, positions=(0, 1), index=False)
        first = next(d.glob("shard-*.safetensors"))
        first.rename(d / "shard-r1-00000.safetensors")
        _write_capture(d, positions=(1, 2), index=False)
    else:
        _write_capture(d, index=False)
        _shard_lies(d, "offsets_overlap")
    (d / ".dflash-run").write_text(json.dumps({"by": "dflash capture"}))
    out, err = cli_before_torch("capture", "--target", "tiny-qwen3", "--out", d, "--resume", *TINY, timeout=60)
    assert out == {"rc": 2, "torch": False} and len(err) == 1 and needle in err[0], err
    assert "--overwrite" in err[0]


def test_checkpoint_safetensors_headers_that_lie_are_one_line(tmp_path):
    """`dflash eval --checkpoint` on a drafter whose model.safetensors header lies (overlapping
    offsets, a shape its bytes do not hold): one line, before torch."""
    from dflash.preflight.checkpoint_files import CheckpointError, check_safetensors

    import torch
    from safetensors.torch import save_file

    f = tmp_path / "model.safetensors"
    for change, needle in ((lambda h: h["b"].update(data_offsets=h["a"]["data_offsets"]), "overlap"),
                           (lambda h: h["a"].update(shape=[3, 3]), "needs"),
                           (lambda h: h.update(c={"dtype": "X9", "shape": [], "data_offsets": [0, 0]}), "unknown dtype")):
        save_file({"a": torch.zeros(2, 3), "b": torch.ones(6)}, str(f))  # the same size: only the offsets lie
        _rewrite_header(f, change)
        with pytest.raises(CheckpointError, match=needle):
            check_safetensors(f)


# ----------------------------------------------------------------------------- regeneration cache

@pytest.mark.slow   # two regenerations in subprocesses
def test_a_poisoned_regeneration_cache_is_dropped_counted_and_regenerated(tmp_path):
    """A cache copied from elsewhere: entries with out-of-vocabulary ids (they passed before and
    killed training partway), entries that are not replies, a batch file nested 100k deep, and a
    batch file that is a link out of the cache. None is fatal: each is dropped, counted, said
    once, and its reply regenerated, equal to the one a clean cache gives."""
    child = [sys.executable, str(ROOT / "tests" / "regen_child.py")]
    cache = tmp_path / "cache"
    env = dict(os.environ) | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "DFLASH_CACHE": str(cache)}

    def run(out):
        p = subprocess.run([*child, str(out), "--convs", "12", "--new", "8", "--batch", "2"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(out.read_text()), p.stderr

    clean, _ = run(tmp_path / "clean.json")
    files = sorted((cache / "regenerated").glob("*/b-*.json"))
    assert len(files) >= 3, files
    total = clean["counts"]["total"]
    a = json.loads(files[0].read_text())
    k1, k2 = list(a)[:2]
    a[k1] = [10**9]  # out of the vocabulary
    a[k2] = "not a reply"
    a["not-a-key"] = [1, 2]
    files[0].write_text(json.dumps(a))
    lost = len(json.loads(files[1].read_text()))
    files[1].write_text('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    outside = tmp_path / "outside.json"
    moved = json.loads(files[2].read_text())
    outside.write_text(json.dumps({k: [1, 2, 3] for k in moved}))  # if it were read, these would be the replies
    files[2].unlink()
    (files[2].parent / "b-zz-link.json").symlink_to(outside)

    again, err = run(tmp_path / "again.json")
    c = again["counts"]
    assert c["regenerated"] == 2 + lost + len(moved) and c["cached"] == total - c["regenerated"], c
    assert again["replies"] == clean["replies"]
    said = [ln for ln in err.splitlines() if "regeneration cache" in ln]
    assert len(said) == 1 and "2 unreadable batch file(s) skipped" in said[0] and \
        "2 malformed or out-of-vocabulary cached replies dropped" in said[0], err[-2000:]  # not-a-key: never asked for


# ----------------------------------------------------------------------------- telemetry files

def _telemetry_run(run: Path) -> Path:
    """A run dir whose telemetry the real exporter wrote (thread mode, file sink): stage spans
    of a target and a drafter worker, as a training run emits them."""
    import otel

    tel = otel.Telemetry.from_env(service_name="dflash", run_id="run-H", file_dir=str(run / "telemetry"),
                                  resource_attributes={"rank": 0}, console=False, mode="thread",
                                  export_interval_s=0.05)
    for b in range(4):
        with tel.stage("model_forward", trace=("batch", b), worker="target0", batch_id=b):
            pass
        with tel.stage("queue_get", worker="drafter0"):
            pass
        with tel.stage("backward", links=[("batch", b)], worker="drafter0"):
            pass
    assert tel.flush(timeout_s=10.0)
    tel.shutdown()
    return run / "telemetry" / "traces.jsonl"


def test_malformed_telemetry_lines_are_skipped_and_counted(tmp_path):
    """`dflash stalls` and `dflash timeline` on a traces.jsonl with lines that are not JSON,
    JSON that is not a span (missing ids, wrong types), JSON nested 100k deep, and spans whose
    rank or run id cannot be used: the rest is analysed, and each file says how many it skipped."""
    traces = _telemetry_run(tmp_path / "run")
    good = traces.read_text().splitlines()
    span = json.loads(good[0])
    first = span["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span["resourceSpans"][0]["scopeSpans"][0]["spans"] = [first]  # a line of one span
    bad_rank = json.loads(json.dumps(span))
    bad_rank["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["attributes"].append(
        {"key": "rank", "value": {"stringValue": "not-a-rank"}})
    bad_run = json.loads(json.dumps(span))
    bad_run["resourceSpans"][0]["resource"]["attributes"] = [
        {"key": "run.id", "value": {"arrayValue": {"values": [{"stringValue": "a"}]}}}]

    def with_attribute(key, value):  # found by a fuzzer: each crashed stalls with a traceback
        doc = json.loads(json.dumps(span))
        sp = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
        sp["attributes"] = [a for a in sp["attributes"] if a["key"] != key] + [{"key": key, "value": value}]
        return json.dumps(doc)
    unusable = [with_attribute("rank", {"doubleValue": "Infinity"}), with_attribute("blocked_s", {"stringValue": "0.1s"}),
                with_attribute("batch_id", {"kvlistValue": {"values": []}})]
    readable = [with_attribute("batch_id", {"bytesValue": "AAAA"}),  # its base64 text: a name, JSON-safe
                with_attribute("note", {"doubleValue": "NaN"})]  # valid OTLP; strict JSON's text "nan"
    hostile = [
        "{not json",
        json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "model_forward"}]}]}]}),  # no ids, times
        json.dumps({"resourceSpans": "a string"}),
        json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [dict(first, startTimeUnixNano="soon")]}]}]}),
        json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [dict(first, attributes=[{"key": 5}])]}]}]}),
        json.dumps([1, 2, 3]),
        '{"resourceSpans": ' + "[" * 100_000 + "]" * 100_000 + "}",
        json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [dict(first, startTimeUnixNano=1e400)]}]}]}).replace(
            "Infinity", "1e400"),  # a time that overflows
        json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [dict(first, endTimeUnixNano="1")]}]}]}),  # ends first
        json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [dict(first, endTimeUnixNano=str(10**25))]}]}]}),
    ]
    traces.write_text("\n".join(good + hostile + [json.dumps(bad_rank), json.dumps(bad_run)] + unusable + readable) + "\n")
    from helpers import run_dflash

    p = run_dflash("stalls", tmp_path / "run", "--json", check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"skipped {len(hostile)} unreadable line(s)" in p.stderr, p.stderr
    assert f"skipped {2 + len(unusable)} span(s) with unusable attributes" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    t = run_dflash("timeline", tmp_path / "run", "--perfetto", tmp_path / "t.json", check=False)
    assert t.returncode == 0 and (tmp_path / "t.json").is_file(), t.stderr[-2000:]
    assert f"skipped {len(hostile)} unreadable line(s)" in t.stderr, t.stderr
    json.loads((tmp_path / "t.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in Perfetto JSON"))


def test_closed_output_streams_and_a_reader_that_left_are_no_tracebacks(tmp_path):
    """`dflash ... >&-` ended a finished run with exit 1 and a traceback (a flush of None);
    `dflash stalls RUN | head -1` with a BrokenPipeError traceback."""
    import shlex

    _telemetry_run(tmp_path / "run")
    cmd = f"{shlex.quote(sys.executable)} -m dflash stalls {shlex.quote(str(tmp_path / 'run'))}"
    for redirect, rc in ((">&-", 0), ("2>&-", 0), (">&- 2>&-", 0)):
        p = subprocess.run(["bash", "-c", f"{cmd} {redirect}; echo rc=$?"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        assert f"rc={rc}" in p.stdout and "Traceback" not in p.stdout + p.stderr, (redirect, p.stdout, p.stderr)
    p = subprocess.run(["bash", "-c", f"{cmd} | (exec 0<&-; sleep 2); echo rc=${{PIPESTATUS[0]}}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert "rc=141" in p.stdout and "Traceback" not in p.stderr and "Error" not in p.stderr, (p.stdout, p.stderr)


def test_a_jaeger_that_drips_its_answer_is_given_up_on_at_the_deadline():
    """The socket timeout bounds each read: a server sending a byte a second held `dflash
    stalls --jaeger` for ever. Now the whole answer has the deadline."""
    import http.server
    import threading
    import time

    from dflash.analysis.stalls import load_jaeger
    from dflash.errors import ConfigError

    class Drip(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            try:
                for _ in range(40):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.25)
            except (BrokenPipeError, ConnectionResetError):  # the reader gave up: what the test wants
                pass

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match="no whole answer within 1 s"):
            load_jaeger(f"http://127.0.0.1:{srv.server_port}", timeout_s=1.0)
        assert time.monotonic() - t0 < 8  # not the 10 s the drip lasts
    finally:
        srv.shutdown()


def test_a_telemetry_line_over_the_cap_is_read_through_and_skipped(tmp_path):
    from otel import read_lines

    f = tmp_path / "traces.jsonl"
    f.write_text('{"a": 1}\n' + '{"b": "' + "x" * 5000 + '"}\n{"c": 3}\n{"torn": ')
    skipped: list = []
    assert list(read_lines(str(f), skipped, max_line=1000)) == [{"a": 1}, {"c": 3}]
    assert skipped == [2, 4]


# ----------------------------------------------------------------------------- checkpoints and target dirs

def test_training_state_files_that_lie_are_one_line(tmp_path):
    """A checkpoint's training_state.json (nested 100k deep, or a tree dflash never writes)
    and trainer_state.json (nested 100k deep): one line, never a RecursionError or a
    traceback from deep inside the decoder."""
    import torch

    from dflash.checkpoint import state_tree
    from dflash.checkpoint.checkpoint import load_training_state
    from dflash.preflight.checkpoint_files import CheckpointError

    ck = tmp_path / "checkpoint"
    ck.mkdir()
    state_tree.save({"opt": {"step": 3, "m": torch.zeros(2)}}, ck / "training_state.safetensors",
                    ck / "training_state.json")
    (ck / "config.json").write_text("{}")
    (ck / "trainer_state.json").write_text(json.dumps({"step": 3}))
    assert load_training_state(ck)[1] == {"step": 3}
    good = (ck / "training_state.json").read_text()
    for bad, needle in (("[" * 100_000 + "]" * 100_000, "nested too deeply"),
                        (json.dumps({"x": {"__float__": "not a number"}}), "malformed"),
                        (json.dumps({"x": {"__items__": [[1]]}}), "malformed"),
                        (json.dumps({"x": {"__tensor__": ["unhashable"]}}), "malformed")):
        (ck / "training_state.json").write_text(bad)
        with pytest.raises(CheckpointError, match=needle):
            load_training_state(ck)
    (ck / "training_state.json").write_text(good)
    (ck / "trainer_state.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="nested too deeply"):
        load_training_state(ck)


def test_a_weight_map_that_leaves_the_model_dir_is_refused(tmp_path):
    """`train --features` reads only the target's embedding and lm_head, from the shards its
    model.safetensors.index.json names: a name that leads out of the dir is refused unopened."""
    import torch
    from transformers import AutoConfig, Qwen3Config, Qwen3ForCausalLM

    from dflash.offline.head_only import load_head_only
    from dflash.preflight.inputs import TargetSpecError

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    d = tmp_path / "model"
    Qwen3ForCausalLM(cfg).save_pretrained(d, max_shard_size="100KB")
    idx = d / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    data["weight_map"] = {k: "../../../etc/passwd" for k in data["weight_map"]}
    idx.write_text(json.dumps(data))
    with pytest.raises(TargetSpecError, match="leads outside"):
        load_head_only(str(d), AutoConfig.from_pretrained(d))

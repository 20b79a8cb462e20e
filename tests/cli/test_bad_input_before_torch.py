"""Bad input of every kind is one line, exit 2, before torch is imported and before anything
is written: data sets (empty, malformed, not UTF-8, a directory), targets (empty, a broken
config.json, a hub id that does not exist or cannot be reached), `--out`, torchrun's
environment."""
import json

import pytest

from helpers import TINY, cli_before_torch

def _train(tmp_path, *args, env=None):
    out, lines = cli_before_torch("train", "--out", tmp_path / "run", "--target", "tiny-qwen3", *TINY, *args, env=env)
    assert not (tmp_path / "run").exists(), "nothing may be written for bad input"
    return out, lines


def _record(i):
    return {"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i}"}]}


@pytest.mark.parametrize("kind,needle", [
    ("empty_list", "no usable conversation in 0 records"),
    ("all_malformed", "no usable conversation in 3 records"),
    ("late_bad_utf8", "not UTF-8"),
    ("one_record", "1 usable conversation(s); expected at least 2"),
    ("directory", "a directory with no data file"),
])
def test_datasets_without_usable_records_fail_before_any_model_loads(tmp_path, kind, needle):
    path = tmp_path / "data.json"
    if kind == "empty_list":
        path.write_text("[]")
    elif kind == "all_malformed":
        path.write_text(json.dumps([{"x": 1}, {"conversations": "no"}, {"conversations": [{"from": "gpt"}]}]))
    elif kind == "late_bad_utf8":  # valid for the first 4 KB the quick check reads, then a bad byte
        head = json.dumps([_record(i) for i in range(200)])[:-1]
        path.write_bytes(head.encode() + b', {"conversations": [{"from": "human", "value": "\xff\xfe"}]}]')
    elif kind == "one_record":
        path.write_text(json.dumps([_record(0)]))
    else:
        path.mkdir()
    out, lines = _train(tmp_path, "--set", f"data.path={path}")
    assert out == {"rc": 2, "torch": False} and len(lines) == 1 and needle in lines[0], lines


@pytest.mark.parametrize("kind,needle", [
    ("empty", "target '': empty"),
    ("blank", "target '  ': empty"),
    ("bad_config", "config.json is not readable JSON"),
    ("config_not_object", "config.json is not a JSON object"),
])
def test_targets_that_cannot_load_are_one_line(tmp_path, kind, needle):
    spec = {"empty": "", "blank": "  "}.get(kind)
    if spec is None:
        d = tmp_path / "model"
        d.mkdir()
        (d / "config.json").write_text('{"model_type": "llama", ' if kind == "bad_config" else "[1, 2]")
        spec = str(d)
    out, lines = _train(tmp_path, "--target", spec)
    assert out == {"rc": 2, "torch": False} and len(lines) == 1 and needle in lines[0], lines


def test_an_unreachable_hub_is_one_line_in_seconds(tmp_path):
    """No network (here: a hub endpoint nobody listens on): one line, not a traceback after
    about a minute of retries."""
    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "", "HF_HOME": str(tmp_path / "hf")}
    out, lines = _train(tmp_path, "--target", "no-such-org/no-such-model", env=env)
    assert out == {"rc": 2, "torch": False} and len(lines) == 1, lines
    assert "no-such-org/no-such-model" in lines[0] and "unreachable" in lines[0]


@pytest.mark.parametrize("env,needle", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but RANK is not set"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two': expected a non-negative integer"),
    ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK=5: expected < WORLD_SIZE=2"),
])
def test_half_a_torchrun_environment_is_one_line(tmp_path, env, needle):
    out, lines = cli_before_torch("train", "--out", tmp_path / "run", *TINY, env=env, drop=("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    assert out == {"rc": 2, "torch": False} and len(lines) == 1 and needle in lines[0], lines


@pytest.mark.parametrize("where,needle", [
    ("root", "not empty and not a dflash run dir"),
    ("file", "is a file"),
    ("under_file", "is a file, not a directory"),
    ("users_dir", "not empty and not a dflash run dir"),
])
def test_out_is_checked_before_torch(tmp_path, where, needle):
    f = tmp_path / "a_file"
    f.write_text("x")
    users = tmp_path / "mine"
    users.mkdir()
    (users / "thesis.tex").write_text("years of work")
    out = {"root": "/", "file": f, "under_file": f / "run", "users_dir": users}[where]
    res, lines = cli_before_torch("train", "--out", out, "--target", "tiny-qwen3", *TINY, "--overwrite")
    assert res == {"rc": 2, "torch": False} and len(lines) == 1 and needle in lines[0], lines
    assert (users / "thesis.tex").read_text() == "years of work" and sorted(p.name for p in users.iterdir()) == ["thesis.tex"]

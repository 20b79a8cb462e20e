"""Bad input of every kind is one line, exit 2, before torch is imported and before anything
is written: data sets (empty, malformed, not UTF-8, a directory), targets (empty, a broken
config.json, a hub id that does not exist or cannot be reached), `--out`, torchrun's
environment and layouts, chat templates, eval's prompt sources, a KL capture without a
top-k, a float16 target."""
import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT, TINY, UNUSABLE_RECORDS, cli_before_torch, run_dflash

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


def test_a_file_of_unusable_records_names_the_reasons_before_torch(tmp_path):
    records = [json.dumps(r) for r in UNUSABLE_RECORDS]
    records.insert(1, "{this is not json")
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(records) + "\n")
    out, lines = cli_before_torch("train", "--out", tmp_path / "run", *TINY, "--set", f"data.path={path}")
    assert out == {"rc": 2, "torch": False} and len(lines) == 1, lines
    assert "no usable conversation in 5 records" in lines[0] and "not_json 1" in lines[0]
    assert "roles_out_of_order 1" in lines[0]


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
    ({"RANK": "²"}, "RANK='²': expected a non-negative integer"),  # a digit to str.isdigit(), not to int()
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, "WORLD_SIZE=2 but MASTER_ADDR is not set"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"}, "MASTER_PORT='http': expected"),
])
def test_half_a_torchrun_environment_is_one_line(tmp_path, env, needle):
    out, lines = cli_before_torch("train", "--out", tmp_path / "run", *TINY, env=env,
                                  drop=("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
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


@pytest.mark.parametrize("env,args,expect", [
    ({}, ["--layout", "target:x,drafter:1"], "'x' is not an integer"),
    ({}, ["--layout", "target:1,drafter:1"], "roles are given to torchrun's ranks"),
    ({"WORLD_SIZE": "3"}, ["--layout", "target:1,drafter:1"], "needs 2 ranks, but torchrun started WORLD_SIZE=3"),
    ({"WORLD_SIZE": "2"}, ["--layout", "target:1,drafter:1", "--eval"], "no rank holds both the target and the drafter"),
    ({"WORLD_SIZE": "2"}, ["--layout", "target:1,drafter:1", "--set", "train.estimate_every=5"],
     "train.estimate_every=5 with pipeline.layout"),
    ({"WORLD_SIZE": "2"}, ["--layout", "target:1,drafter:1", "--set", "pipeline.handoff=nccl"],
     "pipeline.handoff=nccl: expected every target and drafter device on CUDA"),
])
def test_a_layout_that_cannot_run_is_one_line_and_exit_2(tmp_path, env, args, expect):
    p = subprocess.run([sys.executable, "-m", "dflash", "train", "--out", str(tmp_path / "o"), *args],
                       cwd=ROOT, env=dict(os.environ) | env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and expect in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("cmd", ["train", "inspect"])
def test_bad_template_is_exit_2_before_torch(tmp_path, cmd):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% if %}")
    args = (["train", "--out", str(tmp_path / "run"), "--target", "tiny-qwen3", "--set", f"data.chat_template={bad}"]
            if cmd == "train" else ["data", "inspect", "x.jsonl", "--chat-template", str(bad)])
    out, lines = cli_before_torch(*args)
    assert out == {"rc": 2, "torch": False}
    assert len(lines) == 1 and "data.chat_template=" in lines[0] and "not a valid Jinja template" in lines[0]
    assert not (tmp_path / "run").exists()


# -- eval's prompt sources
@pytest.mark.parametrize("args,needle", [
    (["--bench", "gsm8k"], "--bench gsm8k: unknown set"),
    (["--prompts-from", "/nonexistent/prompts.jsonl"], "/nonexistent/prompts.jsonl"),
])
def test_bad_prompt_sources_fail_before_torch(tmp_path, args, needle):
    out, err = cli_before_torch("eval", "--checkpoint", tmp_path, *args)
    assert out == {"rc": 2, "torch": False}, (out, err)
    assert any(needle in line for line in err) and len(err) == 1, err


def test_a_prompt_file_without_prompts_and_a_bad_baseline_key_fail_before_torch(tmp_path):
    f = tmp_path / "answers.jsonl"
    f.write_text(json.dumps({"answer": "4"}) + "\n")
    run = tmp_path / "run" / "checkpoint"
    run.mkdir(parents=True)
    out, err = cli_before_torch("eval", "--checkpoint", run, "--prompts-from", f)
    assert out["rc"] == 2 and not out["torch"] and "no record with a prompt" in err[-1], err
    out, err = cli_before_torch("train", "--out", tmp_path / "r", "--set", "eval.baseline=ngram")
    assert out == {"rc": 2, "torch": False} and "eval.baseline='ngram'" in err[-1], err


def test_a_kl_capture_needs_a_top_k():
    out, lines = cli_before_torch("capture", "--target", "tiny-qwen3", "--out", "/tmp/never-written",
                                  "--set", "train.loss=kl", "--set", "train.kl_topk=0")
    assert out == {"rc": 2, "torch": False} and "set train.kl_topk=K" in lines[0], lines


def test_float16_is_refused_with_exit_2(tmp_path):
    p = run_dflash("train", "--out", tmp_path / "run", "--set", "model.dtype=float16", check=False, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "model.dtype=float16" in lines[0] and "bfloat16" in lines[0], p.stderr
    assert not (tmp_path / "run").exists()

"""The W&B bridge against the real `wandb` package in offline mode: summary keys in the
W&B run, a hung wandb.log never slows training and never loses the summary, the API key
is written nowhere, and a failing wandb falls back to RUN/wandb_fallback.jsonl."""
import glob
import json
import os
import struct
import threading
import time
from pathlib import Path

import pytest

from helpers import TINY

wandb = pytest.importorskip("wandb")

FAKE_KEY = "dflashtest" + "0123456789abcdef" * 2 + "0123456789"  # 40 chars, like a real key
STAGES = ("data_load", "model_forward", "pack_hidden", "cpu_copy_enqueue", "queue_get",
          "drafter_forward", "backward", "optimizer_step")


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    for k in list(os.environ):
        if k.startswith("OTEL_") or (k.startswith("WANDB_") and k != "WANDB_API_KEY"):
            monkeypatch.delenv(k)
    wdir = tmp_path / "wandb_dir"
    wdir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wdir))
    monkeypatch.setenv("WANDB_PROJECT", "dflash-test")
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    monkeypatch.setenv("DFLASH_WANDB_INTERVAL_S", "0.3")
    yield wdir
    wandb.teardown()
    for t in threading.enumerate():  # a bridge released from a fault must not leak into the next test
        if t.name.startswith("wandb-"):
            t.join(15)


def _cfg(out, steps, wandb_on=True, *extra):
    from dflash.config import load_config

    sets = [v for k, v in zip(TINY[::2], TINY[1::2])] + list(extra)
    return load_config(None, sets, **{"out": str(out), "model.target": "tiny-llama", "train.steps": steps,
                                      "telemetry.wandb": wandb_on, "telemetry.console_interval_s": 0})


def _train(cfg):
    from dflash.run.trainer import train

    return train(cfg)


def _records(path, block=32768):
    """Records of a W&B transaction log (run-*.wandb: a LevelDB-style log, 7-byte header)."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", path
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind == 1:
            yield chunk
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            yield buf + chunk


def _wandb_run(wdir, which=-1):
    """(summary, history rows, config) of an offline run under WANDB_DIR."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(glob.glob(str(wdir / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert files, f"no offline W&B run under {wdir}"
    summary, history, config = {}, [], {}
    for raw in _records(files[which]):
        r = pb.Record()
        r.ParseFromString(raw)
        kind = r.WhichOneof("record_type")
        if kind == "summary":
            for u in r.summary.update:
                summary[u.key or "/".join(u.nested_key)] = json.loads(u.value_json)
        elif kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
        elif kind in ("run", "config"):
            upd = r.run.config.update if kind == "run" else r.config.update
            for u in upd:
                config[u.key or "/".join(u.nested_key)] = json.loads(u.value_json)
    return summary, history, config


def _assert_summary_keys(s: dict):
    for stage in STAGES:
        for k in ("p50_s", "p95_s", "p99_s", "share"):
            assert f"stage/{stage}/{k}" in s, f"stage/{stage}/{k} missing"
    for k in ("tokens_per_s", "tokens", "steps", "wall_s", "idle_fraction/drafter0", "idle_fraction/target0",
              "telemetry/spans_dropped", "telemetry/export_failures"):
        assert k in s, k
    assert 0 <= s["idle_fraction/drafter0"] <= 1


def _no_key_anywhere(*roots):
    for root in roots:
        for p in Path(root).rglob("*"):
            if p.is_file():
                assert FAKE_KEY.encode() not in p.read_bytes(), f"API key written to {p}"


def _wandb_core_children():
    me, out = str(os.getpid()), []
    for d in glob.glob("/proc/[0-9]*"):
        try:
            stat = Path(d, "stat").read_text()
            cmd = Path(d, "cmdline").read_bytes()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[1] == me and b"wandb-core" in cmd:
            out.append(d)
    return out


@pytest.mark.slow
def test_offline_run_holds_summary_and_eval_adds_tau(tmp_path, wandb_env, capfd):
    out = tmp_path / "run"
    s = _train(_cfg(out, 4))
    summary, history, config = _wandb_run(wandb_env)
    _assert_summary_keys(summary)
    assert summary["tokens"] == s["tokens"] and summary["steps"] == 4
    assert summary["idle_source"] in ("telemetry", "spans")
    assert any("train/loss" in h for h in history) and any("stage/backward/p95_s" in h for h in history)
    assert config["train"]["steps"] == 4 and config["telemetry"]["wandb"] is True
    assert not (out / "wandb_fallback.jsonl").exists()
    print("\nW&B summary keys:", sorted(k for k in summary if not k.startswith("_")))  # shown with -s

    from dflash.cli import main
    assert main(["eval", "--checkpoint", str(out / "checkpoint"), "--prompts", "1",
                 "--max-new-tokens", "8", "--wandb"]) == 0
    run_id = json.loads((out / "wandb_run.json").read_text())["id"]
    ev_summary, _, _ = _wandb_run(wandb_env, which=-1)
    assert "tau" in ev_summary and ev_summary["tau"] >= 1
    assert len(glob.glob(str(wandb_env / "wandb" / f"offline-run-*-{run_id}"))) == 2, "eval did not resume the run's id"
    wandb.teardown()
    assert not _wandb_core_children(), "a wandb-core helper outlived the run"
    _no_key_anywhere(out, wandb_env)
    assert FAKE_KEY not in capfd.readouterr().err


@pytest.mark.slow
def test_hung_wandb_log_neither_slows_steps_nor_loses_the_summary(tmp_path, wandb_env, monkeypatch):
    steps = 10  # ~0.2 s of injected backward time per step: the run outlives wandb.init
    slow = "pipeline.inject_delay=backward=0.2"
    base = _train(_cfg(tmp_path / "base", steps, False, slow))

    calls, hung_until, release = [], [], threading.Event()
    from wandb.sdk.wandb_run import Run
    from dflash.trackers.bridge import Bridge as WandbBridge  # its default sinks: W&B alone
    real_log, real_close = Run.log, WandbBridge.close

    def hung_log(self, *a, **kw):  # fault injection: the network stops answering for 10 s
        calls.append(time.monotonic())
        if len(calls) == 1:
            release.wait(10.0)
            hung_until.append(time.monotonic())
        return None

    closing = {}

    def timed_close(self, summary):
        closing["start"] = time.monotonic()
        closing["bound"] = self.join_s + 2 * self.write_s
        try:
            return real_close(self, summary)
        finally:
            closing["end"] = time.monotonic()

    # wandb.init rebinds the module-level wandb.log to run.log, so the fault goes into Run.log
    monkeypatch.setattr(Run, "log", hung_log)
    monkeypatch.setattr(WandbBridge, "close", timed_close)
    s = _train(_cfg(tmp_path / "run", steps, True, slow))
    try:
        assert calls and calls[0] < closing["start"], "wandb.log was never called during the training"
        assert not hung_until or hung_until[0] > closing["start"], "precondition: log still hung at the end"
        took = closing["end"] - closing["start"]
        assert took < closing["bound"], f"the end of the run waited {took:.1f}s on W&B"
        assert not hung_until or hung_until[0] > closing["end"] - 0.5, "close() waited for the hung wandb.log"
        # steps as fast as without W&B (generous: this machine is shared)
        per_step, base_step = s["wall_s"] / steps, base["wall_s"] / steps
        assert per_step < 1.5 * base_step + 0.25, (per_step, base_step)
        for st in ("drafter_forward", "backward", "optimizer_step"):
            a, b = s["telemetry"]["stages"][st]["p50_s"], base["telemetry"]["stages"][st]["p50_s"]
            assert a < 2 * b + 0.05, (st, a, b)
        # the summary still got out: to W&B (written from another thread), else to the fallback
        summary, _, _ = _wandb_run(wandb_env)
        fb = tmp_path / "run" / "wandb_fallback.jsonl"
        if "tokens_per_s" not in summary:
            recs = [json.loads(line) for line in fb.read_text().splitlines()]
            summary = next(r["summary"] for r in recs if r["type"] == "summary")
        _assert_summary_keys(summary)
        print(f"\nhung wandb.log: end of run took {took:.2f}s (bound {closing['bound']:.0f}s); "
              f"s/step {per_step:.3f} vs {base_step:.3f} without W&B")
    finally:
        release.set()
        monkeypatch.setattr(Run, "log", real_log)
    _no_key_anywhere(tmp_path, wandb_env)


@pytest.mark.slow
def test_failing_wandb_init_warns_once_and_falls_back_to_jsonl(tmp_path, wandb_env, monkeypatch, capfd):
    def broken_init(*a, **kw):
        raise RuntimeError(f"could not reach api.wandb.ai (key {FAKE_KEY} rejected)")

    monkeypatch.setattr(wandb, "init", broken_init)
    out = tmp_path / "run"
    s = _train(_cfg(out, 4))
    err = capfd.readouterr().err
    warnings = [line for line in err.splitlines() if "W&B bridge" in line]
    assert len(warnings) == 1, warnings
    assert "wandb_fallback.jsonl" in warnings[0] and FAKE_KEY not in err
    recs = [json.loads(line) for line in (out / "wandb_fallback.jsonl").read_text().splitlines()]
    kinds = [r["type"] for r in recs]
    assert kinds[0] == "config" and kinds[-1] == "summary" and "log" in kinds
    assert recs[0]["config"]["train"]["steps"] == 4
    _assert_summary_keys(recs[-1]["summary"])
    assert recs[-1]["summary"]["tokens"] == s["tokens"]
    assert any("stage/backward/p50_s" in r["data"] for r in recs if r["type"] == "log")
    _no_key_anywhere(out, wandb_env)


def test_config_and_messages_are_redacted(monkeypatch):
    from dflash.trackers.redaction import redact, sanitize

    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    cfg = sanitize({"train": {"lr": 1e-3}, "api_key": "x", "wandb_token": "y", "note": f"key={FAKE_KEY}"})
    assert cfg == {"train": {"lr": 1e-3}, "note": "key=***"}
    assert FAKE_KEY not in redact(f"401: bad key {FAKE_KEY}")


def test_missing_wandb_falls_back_without_training(tmp_path, monkeypatch, capfd):
    """No wandb installed: one warning, and config/log/summary records in the fallback."""
    import sys
    from types import SimpleNamespace

    from dflash.config import Config
    from dflash.trackers.bridge import Bridge as WandbBridge
    from dflash.trackers.wandb_sink import FALLBACK

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    stages = {s: {"count": 2, "total_s": 0.2, "p50_s": 0.1, "p95_s": 0.1, "p99_s": 0.1, "max_s": 0.1, "share": 0.1}
              for s in STAGES}
    tel_summary = {"wall_s": 2.0, "stages": stages, "health": {"spans_dropped": 0, "export_failures": 0}}
    spec = SimpleNamespace(out=tmp_path, cfg=Config(), world_size=1, rank=0)
    state = SimpleNamespace(tel=SimpleNamespace(summary=lambda: tel_summary, run_id="r1"), tokens=100,
                            train_step=SimpleNamespace(step=2), history=[(1, 3.5, 0.1, 1.0)])
    bridge = WandbBridge(spec, state, interval_s=0.05).start()
    time.sleep(0.3)
    t0 = time.monotonic()
    final = bridge.close({"tokens": 100, "steps": 2, "tokens_per_s": 50.0, "wall_s": 2.0, "telemetry": tel_summary})
    assert time.monotonic() - t0 < 3
    err = capfd.readouterr().err
    assert err.count("W&B bridge") == 1 and "not available" in err
    recs = [json.loads(line) for line in (tmp_path / FALLBACK).read_text().splitlines()]
    assert [r["type"] for r in recs][0] == "config" and recs[-1]["type"] == "summary"
    assert sum(r["type"] == "summary" for r in recs) == 1
    assert recs[-1]["summary"] == json.loads(json.dumps(final))
    assert final["idle_source"] == "stage_shares" and "idle_fraction/drafter0" in final
    assert any(r["type"] == "log" and r["data"]["train/loss"] == 3.5 for r in recs)

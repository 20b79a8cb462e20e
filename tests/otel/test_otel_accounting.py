"""Every recorded span is accounted for: recorded = exported + dropped (by reason) +
queued, at any moment; nothing is lost to a signal, a stopped or a killed exporter."""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from otel_test_helpers import MODES, point_env_at_dead_collector

import otel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _balanced(h: dict) -> bool:
    return h["spans_recorded"] == h["spans_exported"] + h["spans_dropped"] + h["spans_queued"]


@pytest.mark.parametrize("mode", MODES)
def test_sum_holds_at_every_moment_under_a_dead_collector(mode, monkeypatch, make_tel):
    point_env_at_dead_collector(monkeypatch)
    tel = make_tel(mode=mode, max_queue=300)
    for i in range(3000):
        with tel.stage("step", trace=("batch", i // 100)):
            pass
        if i % 250 == 0:
            h = tel.summary()["health"]
            assert _balanced(h), h
            time.sleep(0.02)
    deadline = time.monotonic() + 60  # the exporter has met the dead collector (slow on a busy host)
    while tel.summary()["health"]["dropped"]["collector_down"] == 0:
        assert time.monotonic() < deadline
        assert _balanced(tel.summary()["health"])
        time.sleep(0.1)
    tel.shutdown(timeout_s=1.0)
    h = tel.summary()["health"]
    assert _balanced(h), h
    assert h["spans_queued"] == 0 and h["spans_exported"] == 0
    # 3000 stages plus the root spans synthesized before the bound ran out (up to 30);
    # a full per-thread list, the dead collector and the shutdown bound share the drops
    assert 3000 <= h["spans_recorded"] <= 3030, h
    assert h["dropped"]["collector_down"] + h["dropped"]["shutdown_timeout"] + h["dropped"]["buffer_full"] \
        == h["spans_recorded"]
    assert h["dropped"]["collector_down"] > 0


def test_stopped_exporter_process_is_replaced_at_shutdown(tmp_path, make_tel, capfd):
    """An exporter that stops making progress (here: SIGSTOP) costs no span: at shutdown
    the training process kills it and writes what was not acknowledged itself."""
    tel = make_tel(mode="process", file_dir=str(tmp_path), exporter_stuck_s=1.0, exporter_start_wait_s=1.0)
    for i in range(50):
        with tel.stage("before_stop", trace=("batch", i)):
            pass
    assert tel.flush(timeout_s=20.0)
    os.kill(tel._transport.proc.pid, signal.SIGSTOP)
    for i in range(500):
        with tel.stage("while_stopped", trace=("batch", 100 + i // 10)):
            pass
    time.sleep(0.3)
    tel.shutdown(timeout_s=2.0)
    h = tel.summary()["health"]
    assert _balanced(h) and h["spans_dropped"] == 0 and h["spans_queued"] == 0, h
    names = [s["name"] for s in otel.read_spans(str(tmp_path))]
    assert names.count("before_stop") == 50 and names.count("while_stopped") == 500
    assert "made no progress" in capfd.readouterr().err


_SIGNALLED = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
import otel
stop = []
signal.signal({sig}, lambda *a: stop.append(1))   # the trainer saves and exits
tel = otel.Telemetry.from_env("dflash", file_dir={out!r}, console=False, export_interval_s=0.05)
print(tel._transport.proc.pid, flush=True)
i = 0
while not stop:
    with tel.stage("step", trace=("batch", i // 5), worker="w0"):
        time.sleep(0.001)
    i += 1
with tel.stage("after_signal", worker="w0"):
    pass
tel.shutdown(timeout_s=2.0)
import json
print(json.dumps(tel.summary()["health"]), flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_to_the_process_group_loses_nothing(tmp_path, sig):
    """`timeout`, `scancel` and job runners signal the whole group (SIGTERM), and so does a
    closed terminal (SIGHUP): the exporter process ignores it and the training process
    decides when telemetry ends."""
    import json

    proc = subprocess.Popen([sys.executable, "-c", _SIGNALLED.format(root=ROOT, out=str(tmp_path), sig=int(sig))],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child_pid = int(proc.stdout.readline())
        deadline = time.monotonic() + 60
        while not os.path.exists(tmp_path / "traces.jsonl"):  # the exporter is running
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.killpg(proc.pid, sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    h = json.loads(out.strip().splitlines()[-1])
    assert proc.returncode == 0
    assert _balanced(h) and h["spans_dropped"] == 0 and h["spans_queued"] == 0, h
    spans = otel.read_spans(str(tmp_path))
    assert len(spans) == h["spans_exported"] == h["spans_recorded"]
    assert any(s["name"] == "after_signal" for s in spans)
    try:  # and the exporter exited after its parent's shutdown (a zombie at most)
        psutil.Process(child_pid).wait(timeout=10)  # psutil.TimeoutExpired (a failure) if it lingers
    except psutil.NoSuchProcess:
        pass

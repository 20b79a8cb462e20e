"""The exporter subprocess never outlives its parent; the profile table and summary."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from otel_test_helpers import MODES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_exporter_child_dies_with_its_parent(tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        import otel
        tel = otel.Telemetry.from_env("dflash", file_dir={str(tmp_path)!r}, console=False)
        print(tel._transport.proc.pid, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        child = psutil.Process(child_pid)
        assert child.is_running()
        parent.send_signal(signal.SIGKILL)  # no atexit, no shutdown: only the pipe's EOF
        parent.wait()
        child.wait(timeout=10)  # raises psutil.TimeoutExpired if the child lingers
    finally:
        if parent.poll() is None:
            parent.kill()


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_a_killed_parent_leaves_no_orphan_span_and_no_stopped_child(tmp_path, stopped):
    """The parent SIGKILLed after its stages reached the child: the child still closes their
    traces (their root spans are written), and a child that was SIGSTOPped at that moment is
    continued by the parent-death signal, so it exits instead of staying stopped for good."""
    from otel import read_spans

    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        import otel
        tel = otel.Telemetry.from_env("dflash", file_dir={str(tmp_path)!r}, console=False)
        for i in range(40):
            with tel.stage("step", trace=("batch", i // 10)):
                pass
        assert tel.flush(timeout_s=30)
        print(tel._transport.proc.pid, flush=True)
        time.sleep(60)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        if stopped:
            child.send_signal(signal.SIGSTOP)
        parent.send_signal(signal.SIGKILL)  # no atexit, no shutdown: only the pipe's EOF
        parent.wait()
        child.wait(timeout=20)  # raises psutil.TimeoutExpired if it lingers (or stays stopped)
    finally:
        if parent.poll() is None:
            parent.kill()
    spans = read_spans(str(tmp_path))
    ids = {s["span_id"] for s in spans}
    steps = [s for s in spans if s["name"] == "step"]
    assert len(steps) == 40 and all(s["parent_span_id"] in ids for s in steps), "a stage span without its root"


def test_spawned_from_stdin_script_works(tmp_path):
    """subprocess + `python -m`, not multiprocessing spawn: works for code fed on stdin."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        import otel
        tel = otel.Telemetry.from_env("dflash", file_dir={str(tmp_path)!r}, console=True)
        with tel.stage("from_stdin"):
            pass
        tel.shutdown()
    """)
    out = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "from_stdin" in out.stderr  # the console table at shutdown
    import otel
    assert [s["name"] for s in otel.read_spans(str(tmp_path))] == ["from_stdin"]


@pytest.mark.parametrize("mode", MODES)
def test_summary_and_profile_table(tmp_path, mode, make_tel, capfd):
    tel = make_tel(mode=mode, file_dir=str(tmp_path), console=True, console_interval_s=0.2)
    for i in range(20):
        with tel.stage("fast"):
            pass
        with tel.stage("slow"):
            time.sleep(0.005)
    tel.flush(timeout_s=5.0)
    time.sleep(0.35)
    s = tel.summary()
    assert set(s) >= {"wall_s", "stages", "health"}
    slow = s["stages"]["slow"]
    assert slow["count"] == 20
    assert set(slow) == {"count", "total_s", "p50_s", "p95_s", "p99_s", "max_s", "share"}
    assert 0.004 <= slow["p50_s"] <= slow["p95_s"] <= slow["p99_s"] <= slow["max_s"] < 0.1
    assert slow["share"] == pytest.approx(slow["total_s"] / s["wall_s"])
    assert s["stages"]["fast"]["p50_s"] < slow["p50_s"]
    table = tel.profile_table()
    assert "slow" in table and "p95" in table and "health: spans recorded 40" in table
    tel.shutdown()
    err = capfd.readouterr().err
    assert err.count("telemetry profile") >= 2  # periodic + at shutdown


@pytest.mark.parametrize("mode", MODES)
def test_periodic_table_is_not_repeated_while_nothing_new_arrives(tmp_path, mode, make_tel, capfd):
    """After training, an eval can run for minutes with no new stages: the table printed every
    interval would be the same one again (five copies in one demo); it is printed once."""
    tel = make_tel(mode=mode, file_dir=str(tmp_path), console=True, console_interval_s=0.1)
    with tel.stage("only"):
        pass
    tel.flush(timeout_s=5.0)
    deadline = time.monotonic() + 10
    while "telemetry profile" not in (seen := capfd.readouterr().err) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "telemetry profile" in seen, "one periodic table for the stage that arrived"
    time.sleep(0.6)  # six intervals with nothing new
    assert "telemetry profile" not in capfd.readouterr().err
    tel.shutdown()
    assert capfd.readouterr().err.count("telemetry profile") == 1  # the final table, once


def test_forked_child_neither_buffers_nor_holds_the_pipe(tmp_path, make_tel):
    tel = make_tel(mode="process", file_dir=str(tmp_path))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the forked child: stages are dropped silently, the pipe fd is closed
        try:
            with tel.stage("in_fork"):
                pass
            fd_closed = False
            try:
                os.fstat(tel._transport._fd)
            except OSError:
                fd_closed = True
            os.write(w, b"1" if (fd_closed and not tel._registry.get().spans) else b"0")
        finally:
            os._exit(0)
    os.close(w)  # a child that dies before writing gives EOF here, not a hang
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1"
    with tel.stage("in_parent"):
        pass
    tel.flush(timeout_s=10.0)
    import otel
    assert [s["name"] for s in otel.read_spans(str(tmp_path))] == ["in_parent"]


def test_exporter_process_death_is_loud_and_loses_nothing(tmp_path, make_tel, capfd):
    """A killed exporter: the training process says so once and exports the rest itself
    (including what the child had not acknowledged), never blocking a worker."""
    tel = make_tel(mode="process", file_dir=str(tmp_path))
    with tel.stage("before_death"):
        pass
    tel._transport.proc.kill()
    tel._transport.proc.wait()
    # its last status may hold roots of batches still open: the fallback re-sends and counts those
    tel._transport._child = {**tel._transport._child, "roots_queued": 2}
    t0 = time.monotonic()
    for _ in range(50):
        for i in range(200):
            with tel.stage("after_death"):
                pass
        time.sleep(0.01)
    assert time.monotonic() - t0 < 10
    deadline = time.monotonic() + 10
    while not tel.summary().get("notes") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any("exporter process is gone" in n for n in tel.summary()["notes"])
    assert "exporter process is gone" in capfd.readouterr().err
    assert tel.flush(timeout_s=10.0) is True
    tel.shutdown()
    h = tel.summary()["health"]
    assert h["spans_recorded"] == 10001 and h["spans_dropped"] == 0 and h["spans_queued"] == 0, h
    import otel
    names = [s["name"] for s in otel.read_spans(str(tmp_path))]
    assert names.count("after_death") == 10000 and names.count("before_death") == 1


def test_a_shut_down_transport_never_closes_a_reused_fd_in_a_fork(tmp_path, make_tel):
    """After shutdown the pipe's fd number is free and may be reused (here: forced with
    dup2); a later fork must not close it on the new owner's behalf."""
    old = make_tel(mode="process", file_dir=str(tmp_path))
    number = old._transport._fd
    old.shutdown()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, number)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            try:
                os.fstat(number)
                ok = b"1"
            except OSError:
                ok = b"0"
            os.write(w, ok)
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    try:
        assert os.read(r, 1) == b"1", "the fork closed an fd the old transport no longer owns"
    finally:
        for fd in (r, devnull, number):
            os.close(fd)

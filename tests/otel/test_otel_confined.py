"""Nothing from elsewhere (otel/confined.py): a package planted where a child is started never
runs in it; a file written through open_for_write never follows a symbolic link; spans that
no exporter took are never counted as exported; a bad OTEL_* number is one note and a default.
And nothing left behind: a tethered child's tree stops with its parent, and a scratch dir
with its owner."""
import json
import os
import subprocess
import sys
import time

import psutil
import pytest
from otel_test_helpers import MODES

from helpers import live

from otel import confined, read_spans


def _plant(where, name: str, marker) -> None:
    """A package named like a module a child loads; importing it leaves ``marker``."""
    pkg = where / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")


def test_a_child_imports_nothing_from_the_callers_cwd_or_relative_pythonpath(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    _plant(tmp_path, "planted", marker)
    monkeypatch.chdir(tmp_path)
    # an empty entry and "." both mean "the cwd" to Python: a common PYTHONPATH slip
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["", ".", "planted/.."]))
    p = confined.start_python(sys.executable, "planted", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "No module named planted" in err, err
    assert not marker.exists()
    # what it does import still works: the standard library, and the module that is asked for
    p = confined.start_python(sys.executable, "json.tool", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert json.loads(p.communicate('{"a": 1}', timeout=60)[0]) == {"a": 1}


def test_a_childs_own_children_inherit_the_rule(tmp_path, monkeypatch):
    """MLflow's server starts `python -m uvicorn` itself: PYTHONSAFEPATH and the private cwd
    carry over to such a grandchild, so its cwd is on no sys.path either."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "spawner.py").write_text(
        "import subprocess, sys\n"
        "code = 'import os, sys; print(sys.flags.safe_path, os.getcwd(), os.getcwd() in sys.path)'\n"
        "print(subprocess.run([sys.executable, '-c', code], capture_output=True, text=True).stdout, end='')\n")
    monkeypatch.setenv("PYTHONPATH", str(lib))
    p = confined.start_python(sys.executable, "spawner", stdout=subprocess.PIPE, text=True)
    safe, cwd, on_path = p.communicate(timeout=60)[0].split()
    assert (safe, on_path) == ("True", "False") and cwd == confined.private_cwd()
    assert os.listdir(cwd) == []


def test_an_otel_package_in_the_cwd_never_runs_in_the_exporter(tmp_path, monkeypatch, make_tel):
    """The exporter process starts as `python -m otel.exporter.process`: an `otel/` folder in the
    training's cwd must neither run nor break it. Its spans are exported by the child itself."""
    marker = tmp_path / "ran"
    _plant(tmp_path / "work", "otel", marker)
    monkeypatch.chdir(tmp_path / "work")
    tel = make_tel(mode="process", file_dir="telemetry")  # relative: the child runs elsewhere
    for i in range(20):
        with tel.stage("step", trace=("batch", i)):
            pass
    tel.shutdown(timeout_s=10.0)
    h = tel.summary()["health"]
    notes = tel.summary().get("notes") or []
    assert not marker.exists()
    assert not any("exporter process" in n for n in notes), notes  # the child did the work, not a fallback
    assert h["spans_exported"] == h["spans_recorded"] > 0 and h["spans_dropped"] == 0, h
    assert len(read_spans(str(tmp_path / "work" / "telemetry"))) == h["spans_exported"]


@pytest.mark.parametrize("mode", MODES)
def test_spans_no_exporter_took_count_as_dropped(tmp_path, monkeypatch, make_tel, capfd, mode):
    """OTEL_EXPORTER_OTLP_TIMEOUT=abc: one note and the default, never "exported" for spans
    that went nowhere; an exporter that cannot start (the file sink refused) is no exporter."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "abc")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "file")
    (tmp_path / "victim").write_text("keep\n")
    (tmp_path / "telemetry").mkdir()
    os.symlink(tmp_path / "victim", tmp_path / "telemetry" / "traces.jsonl")
    tel = make_tel(mode=mode, file_dir=str(tmp_path / "telemetry"))
    for i in range(10):
        with tel.stage("step", trace=("batch", i)):
            pass
    tel.shutdown(timeout_s=5.0)
    h = tel.summary()["health"]
    assert h["spans_exported"] == 0 and h["dropped"]["no_exporter"] == h["spans_recorded"] > 0, h
    assert (tmp_path / "victim").read_text() == "keep\n"
    err = capfd.readouterr().err
    assert "is a symbolic link" in err, err


def test_a_bad_otlp_timeout_is_one_note_and_the_default(monkeypatch, capfd):
    from otel.exporter.sdk_pipeline import _timeout

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "abc")
    assert _timeout(5.0) == 5.0 and _timeout(5.0) == 5.0
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "OTEL_EXPORTER_OTLP_TIMEOUT" in ln]
    assert len(lines) <= 1  # once per process (an earlier test may have said it already)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2")
    assert _timeout(5.0) == 2.0


def test_open_for_write_refuses_links_at_the_file_and_on_the_way(tmp_path):
    run, victim = tmp_path / "run", tmp_path / "victim"
    run.mkdir()
    victim.mkdir()
    (victim / "thesis.txt").write_text("years of work\n")
    os.symlink(victim, run / "tensorboard")
    os.symlink(victim / "thesis.txt", run / "mlflow_fallback.jsonl")
    for path in (run / "tensorboard" / "new.txt", run / "tensorboard" / "thesis.txt", run / "mlflow_fallback.jsonl"):
        for mode in ("w", "a"):
            with pytest.raises(confined.LinkRefused) as e:
                confined.open_for_write(path, mode, inside=run)
            assert "is a symbolic link" in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in victim.iterdir()) == ["thesis.txt"]
    assert (victim / "thesis.txt").read_text() == "years of work\n"
    confined.write_text(run / "summary.json", "{}", inside=run)  # a plain file is written as ever
    with confined.open_for_write(run / "summary.json", "a", inside=run) as f:
        f.write("\n")
    assert (run / "summary.json").read_text() == "{}\n"
    assert confined.links_on_the_way(run, run / "tensorboard" / "x") == str(run / "tensorboard")


_GRANDPARENT = """
import sys, threading, time
from otel.confined import start_python
started = []
# started from a thread that then ends (once the keeper is up): PR_SET_PDEATHSIG fires on that
# thread's exit, which must not be taken for ours
t = threading.Thread(target=lambda: (started.append(start_python(sys.executable, sys.argv[1], tethered=True)),
                                     time.sleep(1.0)))
t.start()
t.join()
time.sleep(1.0)
print(started[0].pid, started[0].poll(), flush=True)
time.sleep(600)
"""


def test_a_tethered_tree_stops_with_its_parent_not_with_the_thread_that_started_it(tmp_path):
    child = tmp_path / "child.py"  # starts a child of its own (in its group), as an engine does
    child.write_text("import subprocess, sys, time\n"
                     "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                     "time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", _GRANDPARENT, str(child)], stdout=subprocess.PIPE, text=True)
    tree = []
    try:
        keeper, rc = p.stdout.readline().split()
        assert rc == "None", "the keeper ended when the thread that started it did"
        deadline = time.monotonic() + 30
        while len(tree) < 3:  # the keeper, the child, the child's own child
            assert time.monotonic() < deadline, tree
            tree = psutil.Process(p.pid).children(recursive=True)
        assert tree[0].pid == int(keeper) and os.getpgid(tree[-1].pid) == int(keeper)
        p.kill()
        p.wait()
        deadline = time.monotonic() + 30
        while live(tree):
            assert time.monotonic() < deadline, [q.cmdline() for q in live(tree)]
            time.sleep(0.1)
    finally:
        p.kill()
        for q in live(tree):
            q.kill()


_OWNER = """
import time
from otel.confined import keep_scratch, scratch_dir
mine, kept = scratch_dir("mine"), scratch_dir("kept")
keep_scratch(kept)
open(mine + "/work", "w").write("x")
print(mine, kept, flush=True)
time.sleep(600)
"""


def test_a_scratch_dir_is_swept_once_its_owner_is_killed_and_only_then(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    sweep = [sys.executable, "-c", "from otel.confined import sweep_scratch; print(*sweep_scratch())"]
    p = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True, env=env)
    try:
        mine, kept = p.stdout.readline().split()
        assert os.path.dirname(mine) == str(tmp_path / f"dflash-{os.getuid()}")
        assert oct(os.stat(os.path.dirname(mine)).st_mode & 0o777) == "0o700"
        assert subprocess.run(sweep, env=env, capture_output=True, text=True).stdout.split() == []  # its owner lives
        p.kill()
        p.wait()
        assert subprocess.run(sweep, env=env, capture_output=True, text=True).stdout.split() == [mine]
        assert not os.path.exists(mine) and os.path.isdir(kept)  # a kept dir (a failure's log) stays
        assert sorted(os.listdir(tmp_path / f"dflash-{os.getuid()}")) == [os.path.basename(kept)]
    finally:
        p.kill()


def test_a_scratch_root_someone_else_holds_is_not_trusted(tmp_path):
    """The shared name taken by a link (or another's dir): a plain private temp dir instead,
    and nothing under that name is swept."""
    other = tmp_path / "elsewhere"
    other.mkdir()
    (tmp_path / f"dflash-{os.getuid()}").symlink_to(other)
    code = "from otel.confined import scratch_dir, sweep_scratch; print(scratch_dir('x'), sweep_scratch())"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TMPDIR=str(tmp_path)),
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[0].startswith(str(tmp_path / "dflash-x-")) and out[1] == "[]" and os.listdir(other) == []


def test_odd_entries_in_the_scratch_root_are_skipped_without_a_traceback_or_a_hang(tmp_path, monkeypatch):
    """Issue 54: what is not ours in TMP/dflash-UID (a pid past any C long, a FIFO or a
    directory named *.owner) is left alone; today's sweep raised OverflowError, blocked on the
    FIFO's open, or raised IsADirectoryError, and every command that makes a scratch dir with it."""
    import tempfile
    import threading

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = tmp_path / f"dflash-{os.getuid()}"
    root.mkdir(mode=0o700)
    dead = 4194305  # above PID_MAX_LIMIT (2**22): never a live process
    (root / "x-99999999999999999999999-abc").mkdir()
    (root / "x-99999999999999999999999-abc.owner").write_text("")
    (root / f"fifo-{dead}-abc").mkdir()
    os.mkfifo(root / f"fifo-{dead}-abc.owner")
    (root / f"dir-{dead}-abc").mkdir()
    (root / f"dir-{dead}-abc.owner").mkdir()
    (root / f"gone-{dead}-abc").mkdir()  # one of ours whose owner is gone: still swept
    (root / f"gone-{dead}-abc.owner").write_text("")
    done = {}

    def make():
        try:
            done["path"] = confined.scratch_dir("mine")
        except BaseException as e:  # noqa: BLE001 - the test reports it
            done["error"] = e

    t = threading.Thread(target=make, daemon=True)
    t.start()
    t.join(60)
    if t.is_alive():  # blocked on the FIFO: let it go, then fail
        os.close(os.open(root / f"fifo-{dead}-abc.owner", os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
        pytest.fail("scratch_dir hung on a FIFO named *.owner")
    assert "error" not in done, repr(done.get("error"))
    try:
        left = sorted(os.listdir(root))
        mine = os.path.basename(done["path"])
        assert left == sorted([f"dir-{dead}-abc", f"dir-{dead}-abc.owner", f"fifo-{dead}-abc",
                               f"fifo-{dead}-abc.owner", mine, mine + ".owner", "x-99999999999999999999999-abc",
                               "x-99999999999999999999999-abc.owner"]), left
    finally:
        confined.remove_scratch(done["path"])


_LEAVES_THE_GROUP = """
import os, subprocess, sys, time
# a grandchild that calls setsid(): a session and a process group of its own, out of the
# keeper's group (vLLM does not do this today; a library it loads might)
subprocess.Popen([sys.executable, "-c", "import os, sys, time; os.setsid(); print(os.getpid(), flush=True); "
                  "time.sleep(600)"])
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["stop_group", "parent_gone"])
def test_a_grandchild_that_leaves_the_group_is_stopped_with_the_tree(tmp_path, how):
    """Issue 54: stop_group (and the keeper, when we are gone) stopped the process group only:
    a descendant in a session of its own escaped. The keeper is the subreaper of its tree: it
    stops every descendant too once its child has ended."""
    import signal

    child = tmp_path / "child.py"
    child.write_text(_LEAVES_THE_GROUP)
    grand = None
    if how == "stop_group":
        p = confined.start_python(sys.executable, str(child), tethered=True, stdout=subprocess.PIPE, text=True)
        out = p.stdout
    else:  # the tree's starter killed: the keeper stops it alone
        p = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom otel.confined import start_python\n"
                              "start_python(sys.executable, sys.argv[1], tethered=True)\ntime.sleep(600)",
                              str(child)], stdout=subprocess.PIPE, text=True)
        out = p.stdout
    try:
        grand = psutil.Process(int(out.readline()))
        assert os.getsid(grand.pid) == grand.pid and os.getpgid(grand.pid) != os.getpgid(p.pid)
        if how == "stop_group":
            confined.stop_group(p, grace_s=5.0)
        else:
            p.send_signal(signal.SIGKILL)
            p.wait()
        deadline = time.monotonic() + 60
        while live([grand]):
            assert time.monotonic() < deadline, "the grandchild in a session of its own outlived the tree"
            time.sleep(0.1)
    finally:
        p.kill()
        if grand is not None:
            for q in live([grand]):
                q.kill()


def test_kept_scratch_dirs_are_bounded_to_the_last_few_of_each_kind(tmp_path, monkeypatch):
    """Issue 54: every failed `serve` and `eval --engine` kept its scratch dir (its log) for
    good: 11 piled up in one pass. A sweep keeps the newest KEPT_PER_KIND of each kind whose
    owner is gone; a kept dir of a live process, and what is not ours, stay."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = tmp_path / f"dflash-{os.getuid()}"
    root.mkdir(mode=0o700)
    dead, n = 4194305, confined.KEPT_PER_KIND
    serves = [root / f"serve-{dead}-s{i}" for i in range(n + 3)]
    for i, d in enumerate(serves):
        d.mkdir()
        (d / "vllm-serve.log").write_text("failed\n")
        os.utime(d, (1_000_000 + i, 1_000_000 + i))  # oldest first
    engines = [root / f"engine-{dead}-e{i}" for i in range(2)]
    mine = root / f"serve-{os.getpid()}-live"  # kept by a process that still runs
    other = root / "notes"
    for d in (*engines, mine, other):
        d.mkdir()
    assert sorted(confined.sweep_scratch()) == sorted(map(str, serves[:3]))
    assert sorted(p.name for p in root.iterdir()) == sorted(p.name for p in (*serves[3:], *engines, mine, other))

"""Nothing from elsewhere (otel/confined.py): a package planted where a child is started never
runs in it; a file written through open_for_write never follows a symbolic link; spans that
no exporter took are never counted as exported; a bad OTEL_* number is one note and a default."""
import json
import os
import subprocess
import sys

import pytest
from otel_test_helpers import MODES

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

"""Deletion and writes stay inside the run dir: `--overwrite`, checkpoint rotation, the
trackers and `timeline` never follow a symbolic link out of it. A link where dflash writes or
deletes is removed as a link, or refused in one line; the folder and the file it points to
(a victim outside the run dir) keep every byte."""
import json
import os

import pytest

from dflash.errors import ConfigError
from dflash.preflight import checkpoint_files as files
from dflash.preflight import run_dir


def _victim(tmp_path):
    """A folder and a file outside the run dir, as a user's shared storage would be."""
    v = tmp_path / "victim"
    (v / "notes").mkdir(parents=True)
    (v / "top.txt").write_text("top\n")
    (v / "notes" / "thesis.txt").write_text("years of work\n")
    for name in files.WRITTEN:  # names a checkpoint has: deleting by name must not reach them
        (v / name).write_text("theirs\n")
    (v / "rank0").mkdir()  # an empty dir an rmdir-when-empty would take
    return v


def _contents(d):
    return {str(p.relative_to(d)): (p.read_text() if p.is_file() else None) for p in sorted(d.rglob("*"))}


def _used_run(tmp_path):
    out = tmp_path / "run"
    run_dir.claim(str(out), resume=False, overwrite=False)
    (out / "summary.json").write_text("{}")
    return out


LINKED_DIRS = ["mlflow/artifacts", "telemetry", "tensorboard/run", "ranks", "checkpoint", "export", "wandb"]
LINKED_FILES = ["summary.json", "mlflow_fallback.jsonl", "telemetry/traces.jsonl", "mlflow/mlflow.db"]


@pytest.mark.parametrize("where", LINKED_DIRS + LINKED_FILES)
def test_overwrite_removes_a_link_as_a_link_and_the_victim_survives(tmp_path, where):
    v = _victim(tmp_path)
    before = _contents(v)
    out = _used_run(tmp_path)
    link = out / where
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.exists() or link.is_symlink():
        link.unlink()
    os.symlink(v / "top.txt" if where in LINKED_FILES else v, link)
    run_dir.clear_earlier_run(run_dir.check(str(out), resume=False, overwrite=True))
    assert not link.is_symlink()
    assert _contents(v) == before


@pytest.mark.parametrize("where", LINKED_DIRS + LINKED_FILES)
def test_resume_refuses_a_link_where_a_run_writes_in_one_line(tmp_path, where):
    v = _victim(tmp_path)
    out = _used_run(tmp_path)
    (out / where).parent.mkdir(parents=True, exist_ok=True)
    if (out / where).exists():
        (out / where).unlink()
    os.symlink(v / "top.txt" if where in LINKED_FILES else v, out / where)
    with pytest.raises(ConfigError) as e:
        run_dir.check(str(out), resume=True, overwrite=False)
    assert "is a symbolic link" in str(e.value) and where in str(e.value) and "\n" not in str(e.value)


def test_a_linked_lock_file_is_refused_never_truncated(tmp_path):
    v = _victim(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    (out / run_dir.MARKER).write_text("{}")
    os.symlink(v / "top.txt", out / run_dir.LOCK)
    with pytest.raises(ConfigError, match="symbolic link"):
        run_dir.claim(str(out), resume=False, overwrite=True)
    assert (v / "top.txt").read_text() == "top\n"


def test_checkpoint_rotation_never_deletes_through_a_link(tmp_path):
    from dflash.preflight.checkpoint_files import clean_stale_temps, remove_written

    v = _victim(tmp_path)
    before = _contents(v)
    out = tmp_path / "run"
    out.mkdir()
    os.symlink(v, out / "checkpoint.old")
    os.symlink(v, out / ".checkpoint.tmp-planted")
    assert remove_written(out / "checkpoint.old") is None and not (out / "checkpoint.old").is_symlink()
    assert clean_stale_temps(out / "checkpoint") == [out / ".checkpoint.tmp-planted"]
    assert _contents(v) == before and sorted(os.listdir(out)) == []


def test_the_trackers_never_write_through_a_link(tmp_path, capsys):
    """TensorBoard's event dir and MLflow's store are checked before their libraries open
    anything; the fallback file is appended through open_for_write: a link there gets a
    warning, the victim keeps its bytes."""
    from otel.confined import LinkRefused

    from dflash import trackers
    from dflash.trackers import mlflow_sink, tensorboard_sink

    v = _victim(tmp_path)
    before = _contents(v)
    out = _used_run(tmp_path)
    (out / "tensorboard").mkdir()
    os.symlink(v, out / "tensorboard" / "run")
    os.symlink(v, out / "mlflow")
    with pytest.raises(LinkRefused):
        tensorboard_sink.event_dir(out)
    with pytest.raises(LinkRefused):
        mlflow_sink.tracking_uri(out)
    os.symlink(v / "top.txt", out / "tensorboard_fallback.jsonl")
    trackers.log_eval(out, {"acceptance_length": 2.0, "prompts": 1}, ["tensorboard"], timeout_s=60)
    err = capsys.readouterr().err
    assert "is a symbolic link" in err and "cannot write" in err, err
    assert _contents(v) == before


def test_timeline_refuses_an_output_through_a_link_in_the_run_dir(tmp_path):
    from dflash.analysis.timeline import check_output

    v = _victim(tmp_path)
    out = _used_run(tmp_path)
    os.symlink(v, out / "pictures")
    os.symlink(v / "top.txt", out / "old.png")
    for path, needle in ((out / "pictures" / "t.png", "pictures is a symbolic link"),
                         (out / "old.png", "is a symbolic link")):
        with pytest.raises(ConfigError, match=needle):
            check_output(str(path), flag="--png", suffix=".png", run_dir=out)
    check_output(str(out / "t.png"), flag="--png", suffix=".png", run_dir=out)  # a plain new name is fine
    assert json.loads((out / "summary.json").read_text()) == {}

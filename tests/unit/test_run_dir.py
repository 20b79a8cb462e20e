"""`--out` is ours to write, and only ours: new, empty or marked dirs only; one run at a
time (a lock naming its holder); nothing deleted that dflash did not write; a killed
save's temp dir cleaned up. Torch-free unit tests; the CLI's one line for a run dir in use:
tests/cli/test_cli_errors.py."""
import json
import os
import subprocess
import sys

import pytest

from dflash.errors import ConfigError
from dflash.preflight import checkpoint_files as files
from dflash.preflight import run_dir
from helpers import ROOT


def test_new_and_empty_dirs_are_claimed_and_marked(tmp_path):
    for out in (tmp_path / "new" / "run", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        p = run_dir.claim(str(out), resume=False, overwrite=False)
        assert (p / run_dir.MARKER).is_file() and (p / run_dir.LOCK).is_file()


def test_a_dir_with_a_users_files_is_refused_and_untouched(tmp_path):
    (tmp_path / "thesis.tex").write_text("years of work")
    for flags in ({}, {"overwrite": True}, {"resume": True}):
        with pytest.raises(ConfigError, match="not empty and not a dflash run dir"):
            run_dir.claim(str(tmp_path), resume=flags.get("resume", False), overwrite=flags.get("overwrite", False))
    assert sorted(os.listdir(tmp_path)) == ["thesis.tex"]


@pytest.mark.parametrize("out", ["/", os.path.expanduser("~")])
def test_system_dirs_are_refused(out):
    with pytest.raises(ConfigError, match="not empty and not a dflash run dir"):
        run_dir.check(out, resume=False, overwrite=False)


def test_a_used_run_dir_needs_resume_or_overwrite(tmp_path):
    run_dir.claim(str(tmp_path), resume=False, overwrite=False)
    (tmp_path / "summary.json").write_text("{}")
    # killed before its first save finished (a whole one may sit in .checkpoint.tmp-*): --resume
    # would say "no config.json there", so only --overwrite is offered
    with pytest.raises(ConfigError, match="saved no checkpoint \\(nothing to resume\\); pass --overwrite"):
        run_dir.check(str(tmp_path), resume=False, overwrite=False)
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="pass --resume to continue it or --overwrite"):
        run_dir.check(str(tmp_path), resume=False, overwrite=False)
    run_dir.check(str(tmp_path), resume=False, overwrite=True)


def test_other_ranks_never_take_rank_0s_fresh_claim_for_an_earlier_run(tmp_path, monkeypatch):
    # torchrun starts every rank at once: rank 1 may look after rank 0 has marked the dir and
    # written its config; whether an earlier run is there is rank 0's call alone
    out = tmp_path / "run"
    monkeypatch.setenv("RANK", "0")
    run_dir.claim(str(out), resume=False, overwrite=False)
    (out / "config.yaml").write_text("rank 0 got here first\n")
    monkeypatch.setenv("RANK", "1")
    assert run_dir.claim(str(out), resume=False, overwrite=False) == out
    early = tmp_path / "early"  # rank 0 has the lock and is writing its marker under a temp name
    early.mkdir()
    (early / run_dir.LOCK).write_text("{}")
    (early / f"{run_dir.MARKER}.tmp4242").write_text("{}")
    assert run_dir.claim(str(early), resume=False, overwrite=False) == early
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "thesis.tex").write_text("years of work")
    with pytest.raises(ConfigError, match="not empty and not a dflash run dir"):
        run_dir.claim(str(tmp_path / "theirs"), resume=False, overwrite=False)


def test_files_paths_under_files_and_unwritable_places(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        run_dir.check(str(f), resume=False, overwrite=False)
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        run_dir.check(str(f / "run"), resume=False, overwrite=False)
    try:  # a read-only or virtual file system: /sys in containers, /proc otherwise
        os.mkdir("/sys/dflash-probe")
        os.rmdir("/sys/dflash-probe")
        pytest.skip("/sys is writable here")
    except OSError:
        pass
    with pytest.raises(ConfigError, match="cannot write there|not writable"):
        run_dir.claim("/sys/dflash-probe/run", resume=False, overwrite=False)


def test_a_checkpoint_dir_holding_a_users_file_is_refused(tmp_path):
    run_dir.claim(str(tmp_path), resume=False, overwrite=False)
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "thesis.tex").write_text("mine")
    with pytest.raises(ConfigError, match="checkpoint/ holds files dflash did not write"):
        run_dir.check(str(tmp_path), resume=False, overwrite=True)


def test_overwrite_removes_only_what_a_run_wrote(tmp_path):
    run_dir.claim(str(tmp_path), resume=False, overwrite=False)
    for rel in ("summary.json", "config.yaml", "telemetry/traces.jsonl", "telemetry/rank1/metrics.jsonl",
                "checkpoint/config.json", "checkpoint/model.safetensors", "notes.md", "telemetry/mine.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    run_dir.clear_earlier_run(tmp_path)
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert left == sorted([run_dir.MARKER, run_dir.LOCK, "notes.md", "telemetry/mine.txt"])


def test_replacing_a_checkpoint_never_deletes_a_file_dflash_did_not_write(tmp_path):
    d = tmp_path / "checkpoint"
    d.mkdir()
    for name in files.WRITTEN:
        (d / name).write_text("ours")
    (d / "thesis.tex").write_text("theirs")
    kept = files.remove_written(d)
    assert not d.exists() and kept is not None
    assert sorted(os.listdir(kept)) == ["thesis.tex"]
    empty = tmp_path / "c2"
    empty.mkdir()
    (empty / files.CONFIG).write_text("{}")
    assert files.remove_written(empty) is None and not empty.exists()


def test_a_killed_saves_temp_dirs_are_removed_by_the_next_save(tmp_path):
    from dflash.checkpoint import checkpoint as ckpt
    from dflash.model.drafter import DFlashDrafter, DrafterConfig

    dst = tmp_path / "checkpoint"
    stale = tmp_path / ".checkpoint.tmp-killed"
    stale.mkdir()
    (stale / files.WEIGHTS).write_bytes(b"\0" * 1024)   # what a kill -9 mid-save leaves
    foreign = tmp_path / ".checkpoint.tmp-notours"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("theirs")
    cfg = DrafterConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                        intermediate_size=64, vocab_size=100, target_layer_ids=[1], mask_token_id=5)
    ckpt.save(dst, DFlashDrafter(cfg), run_config={}, state={"step": 0}, training_state={"step": 0})
    assert not stale.exists() and (foreign / "thesis.tex").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".checkpoint.tmp-notours", "checkpoint"]
    assert json.loads((dst / files.TRAINER_STATE).read_text()) == {"step": 0}


def test_the_claim_takes_milliseconds_and_no_torch(tmp_path):
    code = ("import sys, time; t=time.perf_counter(); from dflash.preflight import run_dir; "
            f"run_dir.claim({str(tmp_path / 'r')!r}, resume=False, overwrite=False); "
            "print(time.perf_counter()-t, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    took, heavy = out.stdout.split()
    assert heavy == "False", out.stderr
    assert float(took) < 30  # generous on a loaded machine: the point is that torch is not imported


def test_a_run_dir_from_before_the_marker_can_still_be_resumed(tmp_path):
    """Runs written by earlier versions have no marker; their checkpoint says what they are."""
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "config.json").write_text(json.dumps({"dflash_run": {"model": {}}}))
    (tmp_path / "summary.json").write_text("{}")
    p = run_dir.claim(str(tmp_path), resume=True, overwrite=False)
    assert (p / run_dir.MARKER).is_file()


def test_a_capture_and_a_training_run_never_resume_or_overwrite_each_other(tmp_path):
    """`capture --overwrite` into a training run would delete its telemetry and write shards
    beside its checkpoint (and `train --overwrite` the reverse): each command acts on its own
    kind of dir only."""
    run, feats = tmp_path / "run", tmp_path / "feats"
    run_dir.claim(str(run), resume=False, overwrite=False)
    run_dir.claim(str(feats), resume=False, overwrite=False, by="dflash capture")
    for out, by, other in ((run, "dflash capture", "dflash train"), (feats, "dflash train", "dflash capture")):
        (out / "telemetry").mkdir(exist_ok=True)
        (out / "telemetry" / "traces.jsonl").write_text("{}\n")
        for flags in ({"overwrite": True}, {"resume": True}, {}):
            with pytest.raises(ConfigError, match=f"holds the output of `{other}`, not of `{by}`"):
                run_dir.check(str(out), resume=flags.get("resume", False), overwrite=flags.get("overwrite", False),
                              by=by)
        assert (out / "telemetry" / "traces.jsonl").read_text() == "{}\n"
    assert run_dir.check(str(feats), resume=False, overwrite=True, by="dflash capture") == feats


def test_a_marker_temp_left_by_a_killed_claim_is_swept_and_a_live_ones_kept(tmp_path):
    """A SIGKILL between the marker's write and its rename left `.dflash-run.tmpPID` for good."""
    dead, live = tmp_path / f"{run_dir.MARKER}.tmp4194305", tmp_path / f"{run_dir.MARKER}.tmp{os.getppid()}"
    dead.write_text("{}")
    live.write_text("{}")
    run_dir.claim(str(tmp_path), resume=False, overwrite=False)
    assert not dead.exists() and live.exists() and (tmp_path / run_dir.MARKER).is_file()

"""`--out` is ours to write, and only ours.

A run writes only into a directory that is new, empty, or marked as a dflash run dir
(`.dflash-run`), and holds an exclusive lock on it (`.dflash-run.lock`, flock) for as long
as the process lives: a second run on the same dir gets one line naming the holder's pid.
A marked dir that holds an earlier run is entered only with `--resume` or `--overwrite`.
All of it is checked before torch loads, and nothing is written for input that fails.

Under torchrun, global rank 0 claims the dir; the other ranks only check it (they write
nothing before rank 0 has joined the process group, which needs the claim to succeed).
Whether the dir holds an *earlier* run is rank 0's call alone: the other ranks start at the
same moment and may look after rank 0 has marked the dir for this very run, so to them a
marked dir is no evidence of an earlier one.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from ..checkpoint.files import foreign_entries
from ..config import ConfigError
from .inputs import read_json

MARKER = ".dflash-run"
LOCK = ".dflash-run.lock"
_OURS = {MARKER, LOCK}
_held: list = []  # lock descriptors kept open for the life of the process


def _first_existing(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_place(out: str, *, flag: str = "--out", want_dir: bool = True, expected: str = "a directory for the run") -> Path:
    """What every writer of a user-named path checks first, writing nothing: a name at all,
    not a file where a dir is meant (or a dir where a file is), no file on the way to it, a
    place we may write. Returns it as a Path."""
    p = Path(out).expanduser()
    if str(out).strip() == "":
        raise ConfigError(f"{flag} '': expected {expected}")
    if want_dir and p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {out}: is a file (expected {expected})")
    if not want_dir and p.is_dir():
        raise ConfigError(f"{flag} {out}: is a directory (expected {expected})")
    base = _first_existing(p.absolute() if want_dir else p.absolute().parent)
    if not base.is_dir():
        raise ConfigError(f"{flag} {out}: {base} is a file, not a directory")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {out}: {base} is not writable")
    return p


def check(out: str, *, resume: bool, overwrite: bool, judge_earlier_run: bool = True) -> Path:
    """Every check that writes nothing; returns the run dir as a Path.
    `judge_earlier_run=False` (ranks other than 0) skips the one check that rank 0's own
    claim can race: a marked dir without --resume or --overwrite."""
    p = check_place(out)
    if not p.is_dir():
        if resume:
            raise ConfigError(f"--resume: no run in {out!r} (the directory does not exist)")
        return p
    # rank 0's marker is written under a temp name first: another rank may see that, too
    entries = sorted(e.name for e in p.iterdir() if e.name not in _OURS and not e.name.startswith(f"{MARKER}.tmp"))
    if not entries:
        if resume:
            raise ConfigError(f"--resume: no checkpoint in {out!r} (the directory is empty)")
        return p
    if not _is_run_dir(p):
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise ConfigError(f"--out {out}: not empty and not a dflash run dir (holds {shown}); "
                          "choose a new or empty directory")
    if judge_earlier_run and not (resume or overwrite):
        raise ConfigError(f"--out {out}: holds an earlier run; pass --resume to continue it or --overwrite to "
                          "replace it")
    for name in ("checkpoint", "checkpoint.old"):
        foreign = foreign_entries(p / name) if (p / name).is_dir() else []
        if foreign:
            raise ConfigError(f"--out {out}: {name}/ holds files dflash did not write ({', '.join(foreign[:3])}); "
                              "move them out first")
    return p


def _is_run_dir(p: Path) -> bool:
    """Marked, or written by a dflash from before the marker: its checkpoint says so."""
    if (p / MARKER).is_file():
        return True
    for name in ("checkpoint", "checkpoint.old"):
        try:  # someone else's dir: its config.json is bounded in size and depth like any other
            raw = read_json(p / name / "config.json", "", ValueError)
        except ValueError:
            continue
        if isinstance(raw, dict) and "dflash_run" in raw:
            return True
    return False


def claim(out: str, *, resume: bool, overwrite: bool, by: str = "dflash train") -> Path:
    """Check, then create and lock the run dir (global rank 0 only; other ranks check).
    A dir another run holds is reported as that, whatever else is wrong with it."""
    if os.environ.get("RANK", "0") not in ("", "0"):
        return check(out, resume=resume, overwrite=overwrite, judge_earlier_run=False)
    p = Path(out).expanduser()
    fd = _lock(out, p) if (p / LOCK).is_file() else None
    try:
        check(out, resume=resume, overwrite=overwrite)
        if fd is None:
            try:
                p.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"--out {out}: cannot write there ({e.strerror or e})") from None
            fd = _lock(out, p)
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%dT%H:%M:%S")}).encode())
        if not (p / MARKER).is_file():
            tmp = p / f"{MARKER}.tmp{os.getpid()}"
            tmp.write_text(json.dumps({"written_by": by, "version": 1}) + "\n")
            os.replace(tmp, p / MARKER)
    except OSError as e:
        os.close(fd)
        raise ConfigError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    _held.append(fd)
    return p


# what a run writes at the top of its dir; --overwrite removes these and nothing else
_RUN_FILES = ("config.yaml", "summary.json", "learning_curve.png", "error.txt", "error.rank*.txt",
              "wandb_fallback.jsonl", "wandb_run.json", "ranks/rank*.json", "ranks/rank*.pid",
              # dflash/trackers: TensorBoard events, the local MLflow store (its db and artifacts)
              "tensorboard_fallback.jsonl", "mlflow_fallback.jsonl", "mlflow_run.json",
              "tensorboard/*/events.out.tfevents.*", "mlflow/mlflow.db", "mlflow/artifacts/**/*",
              "telemetry/traces.jsonl", "telemetry/metrics.jsonl",
              "telemetry/rank*/traces.jsonl", "telemetry/rank*/metrics.jsonl")


def clear_earlier_run(p: Path) -> None:
    """--overwrite: remove what an earlier run wrote (by name), so its spans, summary and
    checkpoint cannot be mixed with this run's; a file dflash did not write stays."""
    from ..checkpoint.files import remove_written
    from .checkpoint_files import EXPORT_WRITTEN

    for pattern in _RUN_FILES:
        for f in p.glob(pattern):
            if f.is_file():
                f.unlink()
    for name in ("checkpoint", "checkpoint.old", "best/checkpoint", "best/checkpoint.old"):
        remove_written(p / name)
    remove_written(p / "export", EXPORT_WRITTEN)
    remove_written(p / "best" / "export", EXPORT_WRITTEN)
    try:
        (p / "best").rmdir()  # only when empty
    except OSError:
        pass
    store = sorted(p.glob("mlflow/artifacts/**"), key=lambda d: -len(d.parts)) + [p / "mlflow"]
    for d in sorted(p.glob("telemetry/rank*")) + [p / "telemetry", p / "ranks"] + sorted(
            p.glob("tensorboard/*")) + [p / "tensorboard"] + store:
        try:
            d.rmdir()  # only when empty
        except OSError:
            pass


def _lock(out: str, p: Path) -> int:
    try:
        fd = os.open(p / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise ConfigError(f"--out {out}: in use by another dflash run ({holder}); wait for it to end or "
                          "choose another --out") from None
    return fd


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on {info.get('host', '?')} since {info.get('since', '?')}"
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return "pid unknown"

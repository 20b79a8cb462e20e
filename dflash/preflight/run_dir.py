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

import errno
import fcntl
import fnmatch
import json
import os
import socket
import time
from pathlib import Path

from otel.confined import write_text

from ..errors import ConfigError
from .checkpoint_files import foreign_entries
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


def check(out: str, *, resume: bool, overwrite: bool, judge_earlier_run: bool = True,
          by: str = "dflash train") -> Path:
    """Every check that writes nothing; returns the run dir as a Path.
    `judge_earlier_run=False` (ranks other than 0) skips the one check that rank 0's own
    claim can race: a marked dir without --resume or --overwrite. ``by``: the command that
    will write there; a dir another kind of command wrote (a capture's FEATS for `train`, a
    training run for `capture`) is never resumed nor overwritten by it."""
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
    if not is_run_dir(p):
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise ConfigError(f"--out {out}: not empty and not a dflash run dir (holds {shown}); "
                          "choose a new or empty directory")
    earlier = written_by(p)
    if earlier != by:
        raise ConfigError(f"--out {out}: holds the output of `{earlier}`, not of `{by}`; --resume and "
                          f"--overwrite act only on their own command's dirs: choose another directory")
    if judge_earlier_run and not (resume or overwrite):
        if by == "dflash train" and not any((p / d / "config.json").is_file() for d in ("checkpoint", "checkpoint.old")):
            # stopped before its first save finished: nothing --resume could start from
            raise ConfigError(f"--out {out}: holds an earlier run that saved no checkpoint (nothing to resume); "
                              "pass --overwrite to replace it")
        raise ConfigError(f"--out {out}: holds an earlier run; pass --resume to continue it or --overwrite to "
                          "replace it")
    links = [] if overwrite else links_where_a_run_writes(p)  # --overwrite removes them as links
    if links:
        shown = links[0].relative_to(p)
        raise ConfigError(f"--out {out}: {shown} is a symbolic link (to {os.readlink(links[0])}); a run writes only "
                          f"inside its dir and never follows one: remove the link (--overwrite removes it)")
    for name in ("checkpoint", "checkpoint.old"):
        foreign = foreign_entries(p / name) if (p / name).is_dir() and not (p / name).is_symlink() else []
        if foreign:
            raise ConfigError(f"--out {out}: {name}/ holds files dflash did not write ({', '.join(foreign[:3])}); "
                              "move them out first")
    return p


def is_run_dir(p: Path) -> bool:
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


def written_by(p: Path) -> str:
    """The command that made run dir ``p`` (its marker's `written_by`): a dir from before the
    marker, or whose marker cannot be read, is a training run's (`is_run_dir`)."""
    try:
        raw = read_json(p / MARKER, "", ValueError)
    except ValueError:
        return "dflash train"
    got = raw.get("written_by") if isinstance(raw, dict) else None
    return got if isinstance(got, str) and got.startswith("dflash ") else "dflash train"


def claim(out: str, *, resume: bool, overwrite: bool, by: str = "dflash train") -> Path:
    """Check, then create and lock the run dir (global rank 0 only; other ranks check).
    A dir another run holds is reported as that, whatever else is wrong with it."""
    if os.environ.get("RANK", "0") not in ("", "0"):
        return check(out, resume=resume, overwrite=overwrite, judge_earlier_run=False, by=by)
    p = Path(out).expanduser()
    fd = _lock(out, p) if (p / LOCK).is_file() else None
    try:
        check(out, resume=resume, overwrite=overwrite, by=by)
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
        _sweep_dead_markers(p)
        if not (p / MARKER).is_file():
            tmp = p / f"{MARKER}.tmp{os.getpid()}"
            write_text(tmp, json.dumps({"written_by": by, "version": 1}) + "\n", inside=p)
            os.replace(tmp, p / MARKER)
    except OSError as e:
        os.close(fd)
        raise ConfigError(f"--out {out}: cannot write there ({e.strerror or e})") from None
    _held.append(fd)
    return p


def _sweep_dead_markers(p: Path) -> None:
    """A marker's temp file left by a claim killed between its write and its rename
    (`.dflash-run.tmpPID`, PID gone): removed, a plain file only, never another live claim's."""
    for f in p.glob(f"{MARKER}.tmp*"):
        pid = f.name[len(MARKER) + 4:]
        if not pid.isdigit() or int(pid) == os.getpid() or f.is_symlink() or not f.is_file():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or another user's: PermissionError below)
        except PermissionError:
            continue
        except (ProcessLookupError, OverflowError):
            pass
        try:
            f.unlink()
        except OSError:
            pass


# what a run writes at the top of its dir; --overwrite removes these and nothing else
_RUN_FILES = ("config.yaml", "config.before-step*.yaml", "summary.json", "learning_curve.png", "error.txt", "error.rank*.txt",
              "wandb_fallback.jsonl", "wandb_run.json", "ranks/rank*.json", "ranks/rank*.pid",
              # dflash/trackers: TensorBoard events, the local MLflow store (its db and artifacts)
              "tensorboard_fallback.jsonl", "mlflow_fallback.jsonl", "mlflow_run.json",
              "tensorboard/*/events.out.tfevents.*", "mlflow/mlflow.db", "mlflow/artifacts/**/*",
              "telemetry/traces.jsonl", "telemetry/metrics.jsonl",
              "telemetry/rank*/traces.jsonl", "telemetry/rank*/metrics.jsonl",
              "engine/vllm-*.log")  # eval.engine: the engine's own logs
# the dirs a run (or a tracker in it) writes into; a link in their place is never followed
_RUN_DIRS = ("tensorboard", "tensorboard/*", "mlflow", "mlflow/artifacts", "mlflow/artifacts/**", "telemetry",
             "telemetry/rank*", "ranks", "wandb", "checkpoint", "checkpoint.old", ".checkpoint.tmp-*", "best",
             "best/checkpoint", "best/checkpoint.old", "best/.checkpoint.tmp-*", "best/export", "export", "engine")


def _matches(rel: str, pattern: str) -> bool:
    """Path.match-like, segment by segment, where `**` is any number of segments."""
    def match(a: list, b: list) -> bool:
        if not b:
            return not a
        if b[0] == "**":
            return any(match(a[i:], b[1:]) for i in range(len(a) + 1))
        return bool(a) and fnmatch.fnmatchcase(a[0], b[0]) and match(a[1:], b[1:])
    return match(rel.split("/"), pattern.split("/"))


def _entries(p: Path):
    """(path relative to p, Path) of everything under the top-level names a run writes,
    top down, never entering a link (a user's own folder in the run dir is not walked)."""
    firsts = {pat.split("/")[0] for pat in _RUN_FILES + _RUN_DIRS}
    for top, dirs, files in os.walk(p, followlinks=False):
        base = Path(top)
        if base == p:
            dirs[:] = [d for d in dirs if any(fnmatch.fnmatchcase(d, f) for f in firsts)]
        for name in sorted(dirs) + sorted(files):
            q = base / name
            yield q.relative_to(p).as_posix(), q


def links_where_a_run_writes(p: Path) -> list[Path]:
    """Symbolic links at a name a run writes or removes (its files, its dirs, the trackers'
    stores, checkpoints): following one would write or delete outside the run dir."""
    return [q for rel, q in _entries(p) if q.is_symlink() and any(_matches(rel, pat) for pat in _RUN_FILES + _RUN_DIRS)]


def clear_earlier_run(p: Path) -> None:
    """--overwrite: remove what an earlier run wrote (by name), so its spans, summary and
    checkpoint cannot be mixed with this run's; a file dflash did not write stays. A link in
    the place of something a run writes is removed as a link (what it points to is never
    touched), and no link is ever followed."""
    from .checkpoint_files import EXPORT_WRITTEN, remove_written

    for link in links_where_a_run_writes(p):
        link.unlink()
    for rel, f in list(_entries(p)):
        if not f.is_symlink() and f.is_file() and any(_matches(rel, pat) for pat in _RUN_FILES):
            f.unlink()
    for name in ("checkpoint", "checkpoint.old", "best/checkpoint", "best/checkpoint.old"):
        remove_written(p / name)
    remove_written(p / "export", EXPORT_WRITTEN)
    remove_written(p / "best" / "export", EXPORT_WRITTEN)
    try:
        (p / "best").rmdir()  # only when empty
    except OSError:
        pass
    store = sorted((q for rel, q in _entries(p) if _matches(rel, "mlflow/artifacts/**") and q.is_dir()
                    and not q.is_symlink()), key=lambda d: -len(d.parts)) + [p / "mlflow"]
    for d in sorted(p.glob("telemetry/rank*")) + [p / "telemetry", p / "ranks", p / "engine"] + sorted(
            p.glob("tensorboard/*")) + [p / "tensorboard"] + store:
        try:
            d.rmdir()  # only when empty (a link is not a dir: it fails and stays)
        except OSError:
            pass


def _lock(out: str, p: Path) -> int:
    try:
        fd = os.open(p / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # truncated below: never a link
    except OSError as e:
        why = f"{LOCK} is a symbolic link, never followed" if e.errno == errno.ELOOP else e.strerror or e
        raise ConfigError(f"--out {out}: cannot write there ({why})") from None
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

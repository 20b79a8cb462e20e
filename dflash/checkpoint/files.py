"""Checkpoint, export and capture dirs on disk: what dflash writes is readable by others,
and only what dflash wrote is ever removed (a user's file placed in `checkpoint/` is kept).
Torch-free: the CLI tidies a run dir with it before torch loads. The names of what dflash
writes are preflight/checkpoint_files.WRITTEN and EXPORT_WRITTEN."""
from __future__ import annotations

import os
from pathlib import Path

from ..preflight.checkpoint_files import WRITTEN


# -- what we publish is readable by others -------------------------------------------------
def umask() -> int:
    """The process's umask, read without changing it (Linux: /proc/self/status; elsewhere the
    set-and-restore dance, which is only racy against another thread creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def plain_modes(root: Path) -> None:
    """Give what was written under private temp names (mkdtemp: 0700, safetensors: 0600) the
    modes a plain write has under the user's umask (0755 / 0644 under 022), so a serving
    engine or a colleague running as another user can read an export, a checkpoint or a
    capture. Walks ``root`` (a dir or one file); never follows links."""
    mask = umask()
    paths = [root] if root.is_file() else [root, *root.rglob("*")]
    for q in paths:
        if q.is_symlink():
            continue
        os.chmod(q, (0o777 if q.is_dir() else 0o666) & ~mask)


# -- removing only what dflash wrote ---------------------------------------------------------
def foreign_entries(d: Path, written=WRITTEN) -> list[str]:
    """Entries of a checkpoint (or export) dir that dflash did not write there."""
    try:
        return sorted(e.name for e in d.iterdir() if e.name not in written)
    except OSError:
        return []


def remove_written(d: Path, written=WRITTEN) -> Path | None:
    """Delete the files dflash writes into a checkpoint (or export) dir, then the dir if that
    empties it. Anything else is kept: the dir is renamed aside (returned), never deleted.
    A link in the dir's place is removed as a link: what it points to is never touched."""
    if d.is_symlink():
        d.unlink()
        return None
    if not d.is_dir():
        return None
    for name in written:
        try:
            (d / name).unlink()
        except FileNotFoundError:
            pass
    try:
        d.rmdir()
        return None
    except OSError:  # not empty: a file dflash did not write
        kept = d.with_name(f"{d.name}.kept-{os.getpid()}")
        n = 0
        while kept.exists():
            n += 1
            kept = d.with_name(f"{d.name}.kept-{os.getpid()}-{n}")
        os.replace(d, kept)
        return kept


def clean_stale_temps(dst: Path) -> list[Path]:
    """Temp dirs a killed save left beside `dst` (`.checkpoint.tmp-*`, a whole checkpoint
    each). Only called under the run dir's lock, so no other save can be writing them."""
    removed = []
    for t in dst.parent.glob(f".{dst.name}.tmp-*"):
        if t.is_symlink():  # never ours: a save makes a real dir (mkdtemp)
            t.unlink()
            removed.append(t)
        elif t.is_dir() and not foreign_entries(t):
            remove_written(t)
            removed.append(t)
    return removed

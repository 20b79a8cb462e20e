"""Nothing from elsewhere: Python children that import nothing from where they were started,
and files written without following a symbolic link.

- `start_python(python, module, args)`: `python -m module` can import only what its
  interpreter's own paths hold. `-m` (and `-c`) put the current directory first on
  `sys.path`, so a folder named like the module (`otel/`, `tensorboard/`, `uvicorn/`) in
  the caller's cwd or a run dir would run inside the child. The child gets `-P` where the
  interpreter is ours (3.11+), `PYTHONSAFEPATH=1` in its environment (inherited by what it
  starts in turn: MLflow's server starts `python -m uvicorn`), `PYTHONPATH` without empty or
  relative entries (those name "wherever the child is"), and a cwd of its own: an empty
  private directory, so even an interpreter without `-P` imports nothing from it.
  `python` is a parameter: an engine's own venv works the same way.
- `open_for_write(path, mode, inside=...)`: every append and open-for-write of a file in a
  directory someone else may share goes through here. A symbolic link at the file
  (`O_NOFOLLOW`) or, given `inside`, at any directory between `inside` and the file, is
  refused with `LinkRefused`, one line, never followed.

Standard library only; the telemetry layer's own helper (otel never imports dflash), which
dflash uses too.
"""
from __future__ import annotations

import atexit
import errno
import os
import shutil
import subprocess
import sys
import tempfile
import threading

# -------------------------------------------------------------------- Python children

_cwd_lock = threading.Lock()
_private_cwd: str | None = None


def private_cwd() -> str:
    """An empty directory only this user can write (mkdtemp: 0700), one per process,
    removed at exit: the cwd of every child started here."""
    global _private_cwd
    with _cwd_lock:
        if _private_cwd is None or not os.path.isdir(_private_cwd):
            _private_cwd = tempfile.mkdtemp(prefix="python-child-")
            atexit.register(shutil.rmtree, _private_cwd, True)
        return _private_cwd


def child_env(env: dict | None = None) -> dict:
    """``env`` (default: ours) with PYTHONSAFEPATH=1 and only absolute PYTHONPATH entries."""
    out = dict(os.environ if env is None else env)
    out["PYTHONSAFEPATH"] = "1"
    if "PYTHONPATH" in out:
        kept = [p for p in out["PYTHONPATH"].split(os.pathsep) if p and os.path.isabs(p)]
        if kept:
            out["PYTHONPATH"] = os.pathsep.join(kept)
        else:
            del out["PYTHONPATH"]
    return out


def python_argv(python: str, module: str, args=()) -> list[str]:
    """``[python, -P, -m, module, *args]``; -P only where the interpreter is known to take
    it (ours, 3.11+): another one still gets PYTHONSAFEPATH and the private cwd."""
    safe = ["-P"] if os.path.realpath(python) == os.path.realpath(sys.executable) and \
        sys.version_info >= (3, 11) else []
    return [python, *safe, "-m", module, *map(str, args)]


def start_python(python: str, module: str, args=(), *, env: dict | None = None, **popen) -> subprocess.Popen:
    """``python -m module args`` that imports nothing from any cwd (see the module doc);
    ``popen``: the rest of subprocess.Popen's arguments (a ``cwd`` of the caller's wins).
    ``module`` may also be the absolute path of a script: ``python script args``, whose own
    directory is then not put on ``sys.path`` either (-P)."""
    popen.setdefault("cwd", private_cwd())
    argv = python_argv(python, module, args)
    if os.path.isabs(module) and module.endswith(".py"):
        argv.remove("-m")
    return subprocess.Popen(argv, env=child_env(env), **popen)


# -------------------------------------------------------------------- files


class LinkRefused(OSError):
    """A symbolic link where a file is written: refused, never followed (one line)."""

    def __str__(self):
        return self.strerror


_MODES = {"w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND}


def link_refused(path, where) -> LinkRefused:
    return LinkRefused(errno.ELOOP, f"{where} is a symbolic link: never followed when writing {path} "
                                    f"(remove the link)")


def open_for_write(path, mode: str = "w", *, inside=None, encoding: str | None = "utf-8"):
    """``open(path, mode)`` for mode w, a, wb or ab, never through a symbolic link: not at
    ``path`` itself, and, given ``inside`` (a directory ``path`` is under), not at any
    directory from ``inside`` down to the file (each opened without following links, the
    file relative to the last: no window in which a link swapped in is followed). The
    directories must exist. Raises LinkRefused (an OSError) naming the link."""
    flags = _MODES[mode.replace("b", "")] | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    path = os.fspath(path)
    dir_fd = None
    name = path
    if inside is not None:
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(inside))
        parts = rel.split(os.sep)
        if parts[0] in (os.pardir, os.curdir):
            raise ValueError(f"{path} is not inside {inside}")
        dir_fd = os.open(inside, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i, part in enumerate(parts[:-1]):
                try:
                    fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(os.path.join(inside, *parts[:i + 1])):
                        raise link_refused(path, os.path.join(inside, *parts[:i + 1])) from None
                    raise
                os.close(dir_fd)
                dir_fd = fd
        except BaseException:
            os.close(dir_fd)
            raise
        name = parts[-1]
    try:
        fd = os.open(name, flags, 0o666, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise link_refused(path, path) from None
        raise
    finally:
        if dir_fd is not None:
            os.close(dir_fd)
    return os.fdopen(fd, mode, encoding=None if "b" in mode else encoding)


def write_text(path, text: str, *, inside=None) -> None:
    """The whole of ``path`` replaced by ``text``, as open_for_write opens it."""
    with open_for_write(path, "w", inside=inside) as f:
        f.write(text)


def links_on_the_way(inside, path) -> str | None:
    """The first symbolic link from ``inside`` (not itself) down to ``path`` (itself
    included), or None: for writers that open their files themselves (TensorBoard's,
    MLflow's), checked just before they start."""
    inside = os.path.abspath(inside)
    rel = os.path.relpath(os.path.abspath(path), inside)
    if rel == os.curdir:
        return None
    if rel.split(os.sep)[0] == os.pardir:
        raise ValueError(f"{path} is not inside {inside}")
    here = inside
    for part in rel.split(os.sep):
        here = os.path.join(here, part)
        if os.path.islink(here):
            return here
    return None

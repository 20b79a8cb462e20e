"""Every file of dflash/ one steady-state training step runs through is named in the walk of
docs/design.md ("Reading one training step"), so a reader following it misses nothing.

A profile hook on every thread (`sys.setprofile` here, `threading.setprofile` for the
threads the run starts) records the dflash/ files whose functions are called between the
return of the 3rd optimizer step and the return of the 4th, during `dflash train
--reference` on tiny-llama, in this process. It was a count (at most 10 files, issue 30); a
count made the step copy `config.derived_seed` inline rather than call it (issue 48): the
documented walk is what keeps a step readable, so the walk is what this checks."""
from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

from helpers import TINY

import dflash

PKG = Path(dflash.__file__).resolve().parent
DESIGN = PKG.parent / "docs" / "design.md"


def walk_files() -> set[str]:
    """The dflash/ files the walk names (paths relative to dflash/)."""
    text = DESIGN.read_text()
    walk = text[text.index("## Reading one training step"):]
    walk = walk[:walk.index("\n## ", 1)]
    return set(re.findall(r"`dflash/([\w/]+\.py)`", walk))


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


def test_steady_state_step_runs_through_the_documented_walk(tmp_path):
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
    named = walk_files()
    assert all((PKG / f).is_file() for f in named), sorted(f for f in named if not (PKG / f).is_file())
    assert set(files) <= named, f"run by the step, not in docs/design.md's walk: {sorted(set(files) - named)}"

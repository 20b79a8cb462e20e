"""The best checkpoint by the held-out acceptance estimate (`train.estimate_every`): tau per
verify step on the held-out prompts, walked from one drafter pass (run/acceptance_estimate.py),
which equals what decoding them gives up to near-ties.

Every estimate is queued with a device-side copy of the drafter's weights at that step
(`checkpoint.snapshot`, weights only: a best checkpoint is for serving and evaluating,
not for resuming). When the estimate comes back (deferred read-back) and beats the best
so far, the copy is written to ``OUT/best/checkpoint`` on a writer thread, atomically as
every checkpoint is (a kill leaves the previous best or the new one); otherwise it is
dropped. At the end of the run the best one is also exported to ``OUT/best/export``
(the served format, as ``OUT/export`` is for the last step), and the summary says which
step it is.

"Best" is judged on the estimate of the drafter a user serves: without its copy head when
it has one (the export cannot carry the head). Ties keep the earlier step. The best dirs
sit beside ``OUT/checkpoint``, not inside it: each save swaps that whole dir.

A resumed run starts from the best its earlier part kept (its trainer_state.json).
"""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint import checkpoint as ckpt

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from otel import TelemetryAPI

    from ..config import Config
    from .step import TrainStep

BEST = "best"


def best_dirs(out: Path) -> tuple[Path, Path]:
    """(OUT/best/checkpoint, OUT/best/export)."""
    return Path(out) / BEST / "checkpoint", Path(out) / BEST / "export"


class BestKeeper:
    def __init__(self, out: Path, cfg: Config, train_step: TrainStep, target_config: PretrainedConfig,
                 tel: TelemetryAPI | None, *, lead: bool, resume: bool = False):
        self.cfg, self.train_step, self.target_config, self.tel, self.lead = cfg, train_step, target_config, tel, lead
        self.dir, self.export_dir = best_dirs(out)
        self.pending: dict = {}          # step -> weights snapshot, until its estimate is known
        self.best: tuple | None = None   # (step, tau)
        self.writer = None
        if resume:
            try:
                st = json.loads((self.dir / "trainer_state.json").read_text())
                self.best = (int(st["step"]), float(st["acceptance_estimate"]))
            except (OSError, ValueError, KeyError, TypeError):
                pass

    def queued(self, step: int) -> None:
        """An estimate of this step's drafter was queued: keep its weights until it is known."""
        if self.lead:
            self.pending[step] = ckpt.snapshot(self.train_step.drafter, run_config=self.cfg.to_dict(),
                                               state={"step": step})

    def result(self, step: int, tau: float) -> None:
        """Its estimate came back (tau of the served drafter): keep the weights if best."""
        snap = self.pending.pop(step, None)
        if snap is None or (self.best is not None and tau <= self.best[1]):
            return
        self.best = (step, tau)
        # unrounded: a resumed run compares its ties with this very value (rounded, an equal tau
        # rounded down was taken for a better one)
        snap.state |= {"acceptance_estimate": tau, "why": "best held-out acceptance estimate so far"}
        if self.writer is None:
            self.writer = ckpt.CheckpointWriter(self.tel)
        self.writer.submit(self.dir, snap)  # waits only for the previous best's write

    def finish(self) -> dict | None:
        """End of run: the last write on disk, the best exported; what the summary says."""
        self.pending.clear()
        if self.writer is not None:
            self.writer.wait()
        if self.best is None or not self.lead:
            return None
        step, tau = self.best
        out = {"step": step, "tau_estimate": round(tau, 4), "checkpoint": str(self.dir)}
        out["export"] = self._export()
        print(f"best checkpoint by the held-out estimate: step {step} (tau {tau:.3f}) -> {self.dir}", file=sys.stderr)
        return out

    def _export(self) -> str | dict:
        """OUT/best/export from OUT/best/checkpoint (what is on disk: the same as was judged)."""
        try:
            from ..checkpoint.export import write_export
            drafter, _ = ckpt.load_drafter(self.dir)
            write_export(drafter, self.target_config, self.export_dir, target=self.cfg.model.target,
                         note=f"the best step of its run by the held-out acceptance estimate "
                              f"(step {self.best[0]}, tau {self.best[1]:.3f})")
            return str(self.export_dir)
        except Exception as e:  # reported, not fatal: the best checkpoint itself is on disk
            print(f"dflash train: export of the best checkpoint failed: {type(e).__name__}: {e}; export it with: "
                  f"dflash export --checkpoint {shlex.quote(str(self.dir))} --out {shlex.quote(str(self.export_dir))}",
                  file=sys.stderr)
            return {"error": f"{type(e).__name__}: {e}"}

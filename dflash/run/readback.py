"""Reading a step's device scalars back on the host without stalling the loop: `DeferredScalars`,
and `record` / `finish`, which read the training step's loss, accuracy, grad norm and
non-finite flag back into the run's history (`RunState.history`, `.nonfinite`).

The step end (run/workers.py `StepEnd`) records every step; a save (saving.py) and the end
of the run (trainer.py) `finish`, the only waits. The held-out estimate
(run/acceptance_estimate.py) reads its own scalars back through a `DeferredScalars`.
"""
from __future__ import annotations

from collections import deque

import torch


# `state` below is the run's RunState (context.py): it holds a DeferredScalars, so it sits
# above this module, which does not import it.
def record(state, step: int, loss, acc, gnorm, nonfinite) -> None:
    """Called on the drafter thread after each optimizer step: no host read here."""
    # every step: one tiny async copy; gives the exact loss trajectory and non-finite steps
    state.readback.put(step, loss=loss, acc=acc, grad_norm=gnorm, nonfinite=nonfinite)
    for s, v in state.readback.ready():
        _log(state, s, v)


def finish(state) -> None:
    """Wait for what is left (a save, the end of the run): the history then holds every step."""
    for s, v in state.readback.drain_blocking():
        _log(state, s, v)


def _log(state, s: int, v: dict[str, float]) -> None:
    state.history.append((s, v["loss"], v["acc"], v["grad_norm"]))
    if v["nonfinite"]:
        state.nonfinite.append(s)


class DeferredScalars:
    """Read device scalars (loss, accuracy, grad norm) without stalling the loop.

    `put` starts a non-blocking copy into pinned host memory and records a CUDA event;
    `ready` returns, in step order, the values whose copies have finished (event.query(),
    never synchronize). On CPU the values are there at once. The training loop calls `put`
    after every optimizer step (one tiny copy: the exact loss trajectory and the non-finite
    steps) and never waits for the answer; only `drain_blocking`, at a save or the end of
    the run, waits.
    """

    def __init__(self):
        self._pending: deque = deque()

    def put(self, step: int, **tensors: torch.Tensor) -> None:
        names = list(tensors)
        vals = torch.stack([t.detach().float().reshape(()) for t in tensors.values()])
        host, ev = self._start_copy(vals)
        self._pending.append((step, names, host, ev))

    @staticmethod
    def _start_copy(vals: torch.Tensor):
        """(host tensor, event that marks the copy done, or None when it already is)."""
        if not vals.is_cuda:
            return vals, None
        host = torch.empty(vals.shape, dtype=vals.dtype, pin_memory=True)
        host.copy_(vals, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(vals.device))  # the copy's device, not the current one
        return host, ev

    def ready(self) -> list[tuple[int, dict]]:
        out = []
        while self._pending and (self._pending[0][3] is None or self._pending[0][3].query()):
            step, names, host, _ = self._pending.popleft()
            out.append((step, dict(zip(names, host.tolist()))))
        return out

    def drain_blocking(self) -> list[tuple[int, dict]]:
        """End of run only: wait for what is left."""
        for *_, ev in self._pending:
            if ev is not None:
                ev.synchronize()
        return self.ready()

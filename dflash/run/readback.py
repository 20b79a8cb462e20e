"""Reading a step's device scalars back on the host without stalling the loop: `DeferredScalars`.

The training loop (run/workers.py `StepEnd`) and the held-out estimate (run/acceptance_estimate.py)
put their loss / accuracy / grad norm here as device tensors and take the values once the
copies have landed; only a save or the end of the run waits.
"""
from __future__ import annotations

from collections import deque

import torch


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

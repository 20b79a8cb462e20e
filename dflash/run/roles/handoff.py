"""Hidden states from target ranks to drafter ranks over torch.distributed point-to-point,
credit-based: the bounded queue and `min_ready` of the single-process pipeline, now
across processes. No transport of our own: gloo and NCCL carry everything.

Three process groups, so no group is ever used by two threads of one rank at once:
- `credits` (gloo): drafter -> target, one int64 per batch: "send me batch g" (a free
  slot in the drafter's queue), or END when the drafter will take nothing more.
- `headers` (gloo): target -> drafter, per batch [g, stop, tokens, width, dtype]: the
  receiver allocates the exact payload from host ints (no device read), checks that the
  batch is the one it expects, and learns when a target rank was asked to stop.
- `data` (NCCL when every rank is on CUDA, else gloo): target -> drafter, the packed
  hidden states themselves. NCCL: device to device, no host bounce; ordering is by
  streams (the receiver records an event, the drafter's stream waits on it).

Flow control: a drafter grants `queue_size` credits ahead of its current step and one
more each time it takes a batch; a target computes its next batch at once but sends it
only against the credit for it (the wait is its `queue_full` time). Messages between
one pair of ranks keep their order, and a target makes its batches in increasing id,
so credits, headers and payloads always match up without tags.

Ending: every drafter stops at the same step (they vote), then sends END to every
target and receives what it had already been promised; the credited batches of every
drafter form a prefix of each target's sequence, so each target has made them all
before it reads an END where it expected a credit. A target drains every drafter's
messages up to its END before it leaves, so no send is left without its receive.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .layout import Layout

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

END = -1
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class PeerGone(RuntimeError):
    """A peer rank stopped answering (died, or its connection broke); names the rank."""


@dataclass
class Groups:
    credits: ProcessGroup
    headers: ProcessGroup
    data: ProcessGroup
    drafters: ProcessGroup        # DDP among drafter ranks (NCCL on CUDA)
    drafter_votes: ProcessGroup   # gloo among drafter ranks: stop vote, totals
    setup: ProcessGroup           # gloo, all ranks, long timeout: data preparation may take minutes
    transport: str          # what carries the payload: nccl | gloo


def make_groups(layout: Layout, nccl_payload: bool, drafters_cuda: bool, timeout_s: float) -> Groups:
    """Every rank must call this, in the same order (torch.distributed's rule)."""
    t = timedelta(seconds=timeout_s)
    credits = dist.new_group(backend="gloo", timeout=t)
    headers = dist.new_group(backend="gloo", timeout=t)
    data = dist.new_group(backend="nccl" if nccl_payload else "gloo", timeout=t)
    drafters = dist.new_group(layout.drafter_ranks, backend="nccl" if drafters_cuda else "gloo", timeout=t)
    votes = dist.new_group(layout.drafter_ranks, backend="gloo", timeout=t)
    setup = dist.new_group(backend="gloo", timeout=timedelta(hours=6))
    return Groups(credits, headers, data, drafters, votes, setup, "nccl" if nccl_payload else "gloo")


def _gone(e: Exception, peer: int, what: str) -> PeerGone:
    first = str(e).splitlines()[0] if str(e) else ""
    return PeerGone(f"rank {peer} is gone (died, or its connection broke) while this rank {what}: "
                    f"{type(e).__name__}: {first}")


def _wait(work, peer: int, what: str):
    try:
        work.wait()
    except Exception as e:  # gloo: connection closed / timeout; NCCL: watchdog error
        raise _gone(e, peer, f"waited for {what}") from e


def _post(op, tensor, peer: int, group, what: str):
    """isend / irecv; a peer that is already gone fails the call itself: name it."""
    try:
        return op(tensor, peer, group=group)
    except Exception as e:
        raise _gone(e, peer, what) from e


class TargetSide:
    """A target rank's end of the hand-off (one thread)."""

    def __init__(self, layout: Layout, groups: Groups, device: torch.device, max_in_flight: int):
        self.layout, self.g, self.device = layout, groups, device
        # nccl: device to device; host: CUDA target on a gloo wire (one device->host copy)
        self.transport = ("nccl" if groups.transport == "nccl" else
                          "host" if device.type == "cuda" else "gloo")
        self._in_flight: deque = deque()   # (work, tensor): a payload stays alive until sent
        self.max_in_flight = max(1, max_in_flight)
        self._ended: set[int] = set()      # drafter indices whose END was read
        self._cred = torch.zeros(1, dtype=torch.int64)

    def wait_credit(self, g: int) -> bool:
        """Block until the drafter of batch g grants it; False when that drafter said END."""
        d, _ = self.layout.consumer(g)
        src = self.layout.drafter_rank(d)
        _wait(_post(dist.irecv, self._cred, src, self.g.credits, "asked for a credit"), src,
              f"a credit for batch {g}")
        got = int(self._cred[0])
        if got == END:
            self._ended.add(d)
            return False
        if got != g:
            raise RuntimeError(f"hand-off out of step: expected the credit for batch {g} from rank {src}, got {got}")
        return True

    def send(self, g: int, packed: torch.Tensor, stop: bool) -> None:
        d, _ = self.layout.consumer(g)
        dst = self.layout.drafter_rank(d)
        if self.transport == "host":  # CUDA target, gloo wire: the one device->host copy
            packed = packed.to("cpu")
        packed = packed.contiguous()
        header = torch.tensor([g, int(stop), packed.shape[0], packed.shape[1], _DTYPES.index(packed.dtype)],
                              dtype=torch.int64)
        hw = _post(dist.isend, header, dst, self.g.headers, f"sent batch {g}")
        pw = _post(dist.isend, packed, dst, self.g.data, f"sent batch {g}")
        self._in_flight.append((hw, header, dst))
        self._in_flight.append((pw, packed, dst))
        while len(self._in_flight) > 2 * self.max_in_flight:
            w, _, peer = self._in_flight.popleft()
            _wait(w, peer, "a batch to be received")

    def finish(self) -> None:
        """Read every drafter's remaining credits up to its END, then let the sends complete."""
        for d in range(self.layout.drafters):
            src = self.layout.drafter_rank(d)
            while d not in self._ended:
                _wait(_post(dist.irecv, self._cred, src, self.g.credits, "waited for the end of the run"), src,
                      "the end of the run")
                if int(self._cred[0]) == END:
                    self._ended.add(d)
        while self._in_flight:
            w, _, peer = self._in_flight.popleft()
            _wait(w, peer, "a batch to be received")


class DrafterSide:
    """A drafter rank's end: credits go out from the training thread, batches come in on a
    receiver thread that hands them to `deliver(step, header, tensor, ready_event)`."""

    def __init__(self, layout: Layout, groups: Groups, d: int, device: torch.device,
                 start_step: int, end_step: int, queue_size: int):
        self.layout, self.g, self.d, self.device = layout, groups, d, device
        self.end_step, self.q = end_step, queue_size
        self.next_credit = start_step      # first step not yet granted
        self.next_receive = start_step     # first step not yet received
        self._cv = threading.Condition()
        self._ended = False
        self._sends: deque = deque()
        self.recv_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    # -- training thread -----------------------------------------------------------------
    def grant_until(self, step_exclusive: int) -> None:
        """Grant credits for every step below `step_exclusive` (capped at the run's end)."""
        with self._cv:
            upto = min(step_exclusive, self.end_step)
            while self.next_credit < upto:
                g = self.layout.batch_id(self.next_credit, self.d)
                self._send_credit(g, self.layout.target_rank(self.layout.producer(g)))
                self.next_credit += 1
            self._cv.notify_all()

    def end(self) -> None:
        """No more credits: tell every target, then the receiver drains what was promised."""
        with self._cv:
            for t in range(self.layout.targets):
                self._send_credit(END, self.layout.target_rank(t))
            self._ended = True
            self._cv.notify_all()
        while self._sends:
            w, _, peer = self._sends.popleft()
            _wait(w, peer, "its END to be read")

    def _send_credit(self, g: int, dst: int) -> None:
        t = torch.tensor([g], dtype=torch.int64)
        what = "sent its end of the run" if g == END else f"granted a credit for batch {g}"
        self._sends.append((_post(dist.isend, t, dst, self.g.credits, what), t, dst))
        while self._sends and self._sends[0][0].is_completed():
            self._sends.popleft()

    # -- receiver thread -----------------------------------------------------------------
    def receive_loop(self, deliver, stop: threading.Event) -> None:
        """Receive every credited batch in step order, until END was sent and all promised
        batches are in (or `stop`: an error elsewhere ends the run anyway)."""
        header = torch.zeros(5, dtype=torch.int64)
        while not stop.is_set():
            with self._cv:
                while self.next_receive >= self.next_credit and not self._ended and not stop.is_set():
                    self._cv.wait(0.1)
                if self.next_receive >= self.next_credit:
                    return
                step = self.next_receive
            g = self.layout.batch_id(step, self.d)
            src = self.layout.target_rank(self.layout.producer(g))
            t0 = time.perf_counter()
            _wait(_post(dist.irecv, header, src, self.g.headers, f"asked for batch {g}"), src, f"batch {g}")
            hg, stopflag, n, width, code = (int(v) for v in header)
            if hg != g:
                raise RuntimeError(f"hand-off out of step: expected batch {g} from rank {src}, got {hg}")
            dev = self.device if self.g.transport == "nccl" else torch.device("cpu")
            ready = None
            if self.recv_stream is not None and dev.type == "cuda":
                with torch.cuda.stream(self.recv_stream):
                    buf = torch.empty(n, width, dtype=_DTYPES[code], device=dev)
                    _wait(_post(dist.irecv, buf, src, self.g.data, f"asked for batch {g}"), src,
                          f"batch {g}")  # a stream wait on NCCL
                    ready = torch.cuda.Event()
                    ready.record(self.recv_stream)
            else:
                buf = torch.empty(n, width, dtype=_DTYPES[code])
                _wait(_post(dist.irecv, buf, src, self.g.data, f"asked for batch {g}"), src, f"batch {g}")
            with self._cv:
                self.next_receive += 1
            deliver(step, g, buf, ready, bool(stopflag), time.perf_counter() - t0)

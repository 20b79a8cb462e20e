"""The pipelined trainer: prefetcher -> target worker(s) -> hidden queue -> drafter.

    prefetcher thread      data_load                       (tokenized, length-bucketed batches)
    target worker thread   model_forward -> pack_hidden -> cpu_copy_enqueue   (one per target device)
    drafter (this thread)  queue_get -> drafter_forward -> backward -> optimizer_step

Rules kept here (docs/design.md, "The pipeline and its stages"):
- no host waits on device work in the loop: the device->host copy of packed hidden states
  runs on a side stream into pinned, pre-allocated buffers and is announced by a CUDA
  event; the drafter makes *its stream* wait on that event; a buffer goes back to the pool
  only once the drafter's copy out of it has finished (an event, polled with query());
- every stage is a `tel.stage` with the same trace key per batch, so one batch's stages,
  on any thread or device, land in one trace; losses are read back deferred;
- an error in any thread stops all of them promptly and is re-raised here.
"""
from __future__ import annotations

import queue
from collections import deque
import sys
import threading
import time
from dataclasses import dataclass

import torch

from ..errors import WorkerError, naming_stages
from ..model.trainer import pack, target_features, unpack
from .faults import inject
from .hidden_queue import Closed, HiddenQueue
from .step_end import StepEnd


@dataclass
class HiddenItem:
    batch: object
    packed: torch.Tensor        # valid tokens only; host (pinned) or on the drafter's device
    ready: object = None        # CUDA event: the copy into `packed` is complete
    release: object = None      # callable(done_event): give the staging buffer back
    worker: str = ""


class PinnedPool:
    """Pre-allocated pinned staging buffers of one target worker, reused. The drafter hands
    a buffer back with the event that marks the end of its copy out of it; the worker takes
    it again only once that event has completed (query(), no host wait). One producer and
    one consumer on atomic deque operations: no lock."""

    def __init__(self, n: int, numel: int, dtype, pin_memory: bool = True):
        self._free = deque(torch.empty(numel, dtype=dtype, pin_memory=pin_memory) for _ in range(n))
        self._returned: deque = deque()   # (buffer, done event), in hand-back order

    def take(self, stop: threading.Event) -> torch.Tensor:
        while not stop.is_set():
            while self._returned and self._returned[0][1].query():
                self._free.append(self._returned.popleft()[0])
            if self._free:
                return self._free.popleft()
            time.sleep(0.0005)
        raise Closed

    def give_back(self, buf, done_event) -> None:
        self._returned.append((buf, done_event))


class Pipeline:
    def __init__(self, ctx):
        self.ctx, self.cfg, self.tel = ctx, ctx.cfg, ctx.tel
        p = self.cfg.pipeline
        self.hq = HiddenQueue(p.queue_size, p.min_ready)
        self.batches: queue.Queue = queue.Queue(maxsize=p.prefetch)
        self.stop = threading.Event()
        self.errors: list[tuple[str, BaseException]] = []
        self.threads: list[threading.Thread] = []
        self.drafter_device = ctx.step.device
        self.worker = "drafter0"
        self._register_metrics()

    # -- metrics read by the telemetry thread (callbacks never touch a worker) ------------
    def _register_metrics(self):
        tel = self.tel
        rank = {"rank": self.ctx.rank}
        # read self.hq at call time: a drafter rank replaces the queue after this runs
        tel.observable_gauge("dflash.queue.depth", lambda: [(self.hq.depth(), rank)], unit="{batch}",
                             description="hidden-state batches waiting for the drafter")
        tel.observable_gauge("dflash.queue.min_ready_ratio",
                             lambda: [(self.hq.depth() / self.hq.min_ready, rank)],
                             unit="1", description="queue depth / min_ready (>= 1: drafter can start at once)")
        tel.observable_gauge("dflash.queue.producer_blocked", lambda: [(self.hq.blocked_s, rank)], unit="s",
                             description="total time target workers waited on a full queue")
        tel.observable_gauge("dflash.queue.consumer_starved", lambda: [(self.hq.starved_s, rank)], unit="s",
                             description="total time the drafter waited on an empty queue")
        if self.drafter_device.type == "cuda":
            dev = self.drafter_device

            def alloc():
                s = torch.cuda.memory_stats(dev)  # host-side counters: no sync
                a = {"device": str(dev)} | rank
                return [(s.get("allocated_bytes.all.current", 0), a | {"kind": "allocated"}),
                        (s.get("reserved_bytes.all.current", 0), a | {"kind": "reserved"}),
                        (s.get("allocated_bytes.all.peak", 0), a | {"kind": "peak_allocated"})]
            tel.observable_gauge("dflash.cuda.memory", alloc, unit="By", description="CUDA caching allocator")

    def _inject(self, stage, step=None):
        inject(self.cfg.pipeline, stage, step)

    def _guard(self, name, fn, *args):
        def run():
            try:
                fn(*args)
            except Closed:
                pass
            except BaseException as e:  # any failure ends the whole run
                self.errors.append((name, e))
                self.shutdown_workers()
        t = threading.Thread(target=run, name=name, daemon=True)
        self.threads.append(t)
        return t

    def shutdown_workers(self):
        self.stop.set()
        self.hq.close()

    # -- prefetcher ----------------------------------------------------------------------
    def prefetch(self):
        stream = self.ctx.batch_stream()
        idx = self.ctx.start_step
        tel, rank = self.tel, self.ctx.rank
        stage = naming_stages(tel.stage)  # a failure names its stage
        blocked = 0.0  # the previous batch's wait for room in the batch queue
        while not self.stop.is_set() and idx < self.cfg.train.steps:
            with stage("data_load", trace=("batch", idx), worker="prefetch", device="cpu", rank=rank,
                           batch_id=idx, step=idx, blocked_before_s=round(blocked, 6)) as s:
                b = next(stream)
                b.index = idx
                s.set(tokens=b.tokens, sequences=len(b.lengths), padded_len=b.padded_len)
                self._inject("data_load", idx)
            t0 = time.perf_counter()
            self._put_batch(b)
            blocked = time.perf_counter() - t0  # idle cause queue_full: ahead of the targets
            tel.record("dflash.batch.padding_ratio", 1 - b.tokens / (len(b.lengths) * b.padded_len))
            for n in b.lengths:
                tel.record("dflash.batch.sequence_length", n)
            idx += 1
        for _ in range(len(self.cfg.pipeline.target_devices)):  # one end marker per worker
            self._put_batch(None)

    def _put_batch(self, b):
        while not self.stop.is_set():
            try:
                return self.batches.put(b, timeout=0.1)
            except queue.Full:
                continue

    # -- target worker -------------------------------------------------------------------
    def _next_batch(self):
        t0 = time.perf_counter()
        while not self.stop.is_set():
            try:
                return self.batches.get(timeout=0.1), time.perf_counter() - t0
            except queue.Empty:
                continue
        return None, time.perf_counter() - t0

    def target_worker(self, wid: int, done: list):
        ctx, tel = self.ctx, self.tel
        stage = naming_stages(tel.stage)  # a failure names its stage
        tgt = ctx.targets[wid]
        dev = torch.device(tgt.device)
        worker = f"target{wid}"
        cuda = dev.type == "cuda"
        staging = cuda and self.drafter_device != dev
        side = torch.cuda.Stream(dev) if cuda else None
        pool = None
        if staging:
            H = tgt.config.get_text_config().hidden_size * len(ctx.layer_ids)
            numel = self.cfg.train.batch_size * self.cfg.data.max_len * H
            pool = PinnedPool(self.cfg.pipeline.queue_size + 2, numel, tgt.dtype)
        try:
            while not self.stop.is_set():
                b, data_wait = self._next_batch()  # data_wait: idle cause `data_wait` (prefetcher behind)
                if b is None:
                    break
                key = ("batch", b.index)
                a = dict(worker=worker, device=str(dev), rank=ctx.rank, batch_id=b.index, step=b.index,
                         tokens=b.tokens, sequences=len(b.lengths), padded_len=b.padded_len,
                         data_wait_s=round(data_wait, 6))
                cur = torch.cuda.current_stream(dev) if cuda else None
                with stage("model_forward", trace=key, stream=cur, **a):
                    feats = target_features(tgt, b, ctx.layer_ids, dev)
                    self._inject("model_forward", b.index)
                with stage("pack_hidden", trace=key, stream=cur, **a):
                    packed = pack(feats, b.lengths)
                    self._inject("pack_hidden", b.index)
                with stage("cpu_copy_enqueue", trace=key, **a) as s:
                    item = HiddenItem(batch=b, packed=packed, worker=worker)
                    if staging:
                        buf = pool.take(self.stop)
                        host = buf[: packed.numel()].view(packed.shape)
                        side.wait_stream(cur)          # the copy must see the finished pack
                        with torch.cuda.stream(side):
                            host.copy_(packed, non_blocking=True)
                            packed.record_stream(side)  # allocator: don't reuse before the copy ran
                            ev = torch.cuda.Event()
                            ev.record(side)
                        item.packed, item.ready = host, ev
                        item.release = lambda done_ev, buf=buf: pool.give_back(buf, done_ev)
                    elif cuda:  # same device: hand over the tensor, ordered by an event
                        ev = torch.cuda.Event()
                        ev.record(cur)
                        item.ready = ev
                    self._inject("cpu_copy_enqueue", b.index)
                    blocked = self.hq.put(b.index, item)
                    s.set(blocked_s=round(blocked, 6))
                    if blocked > self.cfg.pipeline.stall_threshold_s:
                        s.event("queue_full", wait_s=round(blocked, 6))
                tel.add("dflash.queue.producer_blocked_seconds", blocked, worker=worker)
                tel.add("dflash.worker.batches", 1, worker=worker)
                tel.add("dflash.worker.tokens", b.tokens, worker=worker)
        finally:
            done.append(wid)
            if len(done) == len(self.cfg.pipeline.target_devices):
                self.hq.producers_done()

    # -- drafter (runs on the calling thread) --------------------------------------------
    # hooks a drafter rank of a layout overrides (roles/drafter_rank.py)
    def batch_id(self, step: int) -> int:
        """The global batch trained at `step` (here: one batch per step)."""
        return step

    def taken(self, step: int) -> None:
        """A batch left the queue (a drafter rank grants its target a new credit)."""

    def sync_wait(self) -> float:
        """Seconds the last backward waited on DDP's all-reduce (0 without a measured wait)."""
        return 0.0

    def drafter_loop(self):
        ctx, tel, st = self.ctx, self.tel, self.ctx.step
        stage = naming_stages(tel.stage)  # a failure names its stage
        dev = self.drafter_device
        cuda = dev.type == "cuda"
        worker = self.worker
        end_step = StepEnd(ctx, worker)  # tokens, read-back, progress, save cadence
        thr = self.cfg.pipeline.stall_threshold_s
        try:
            while ctx.more_steps() and not self.stop.is_set():
                step = st.step
                bid = self.batch_id(step)
                key = ("batch", bid)
                a = dict(worker=worker, device=str(dev), rank=ctx.rank, batch_id=bid, step=step)
                with stage("queue_get", trace=key, **a) as s:
                    item, waited = self.hq.get(step)
                    self.taken(step)
                    self._inject("queue_get", step)
                    s.set(wait_s=round(waited, 6), queue_depth=self.hq.depth())
                    if waited > thr:
                        s.event("stall", cause="queue_empty", wait_s=round(waited, 6))
                tel.add("dflash.queue.consumer_starved_seconds", waited, worker=worker)
                b = item.batch
                a |= dict(tokens=b.tokens, sequences=len(b.lengths), padded_len=b.padded_len)
                cur = torch.cuda.current_stream(dev) if cuda else None
                with stage("drafter_forward", trace=key, stream=cur, **a):
                    if item.ready is not None:
                        cur.wait_event(item.ready)     # device-side wait, the host moves on
                    if item.packed.device == dev and cuda:
                        item.packed.record_stream(cur)  # made on another stream (NCCL receive)
                    x = item.packed.to(dev, non_blocking=True)
                    if item.release is not None:
                        done = torch.cuda.Event()
                        done.record(cur)
                        item.release(done)
                    loss, acc = st.forward(unpack(x, b.lengths, b.padded_len), b)
                    self._inject("drafter_forward", step)
                with stage("backward", trace=key, stream=cur, **a) as s:
                    st.backward(loss)
                    self._inject("backward", step)
                    sync = self.sync_wait()
                    if sync:
                        s.set(sync_s=round(sync, 6))
                with stage("optimizer_step", trace=key, links=[key], stream=cur, **a):
                    gnorm, nonfinite = st.optimizer_step(loss)
                    self._inject("optimizer_step", step)
                end_step(step, b.tokens, loss, acc, gnorm, nonfinite)
        finally:
            end_step.close()

    # -- orchestration -------------------------------------------------------------------
    def run(self):
        done: list = []
        self._guard("prefetch", self.prefetch).start()
        for wid in range(len(self.cfg.pipeline.target_devices)):
            self._guard(f"target{wid}", self.target_worker, wid, done).start()
        try:
            self.drafter_loop()
        except Closed:
            pass
        except Exception as e:  # the drafter runs on this thread: reported like any worker
            self.errors.append(("drafter0", e))
        finally:
            self.shutdown_workers()
            self._join_workers()
        self.raise_first_error()

    def raise_first_error(self):
        if self.errors:  # the first failure; the others are usually its consequences
            name, err = self.errors[0]
            raise WorkerError.from_failure(name, err) from err


    def _join_workers(self, patience_s: float = 5.0, limit_s: float = 120.0):
        """Workers notice `stop` between stages, so this returns once a running forward is
        done; nothing is saved or evaluated while a worker may still touch the models."""
        deadline = time.monotonic() + limit_s
        warned = False
        for t in self.threads:
            while t.is_alive() and time.monotonic() < deadline:
                t.join(timeout=patience_s)
                if t.is_alive() and not warned:
                    warned = True
                    print(f"dflash: waiting for worker {t.name} to finish its current stage", file=sys.stderr)
        alive = [t.name for t in self.threads if t.is_alive()]
        if alive:
            raise WorkerError(f"workers {alive} did not stop within {limit_s:.0f}s", worker=",".join(alive))


def run_pipelined(ctx) -> None:
    Pipeline(ctx).run()

"""The two workers, each written once for every placement, and what feeds them:

    batch source   data_load: a prefetch thread ahead of the target workers (pipelined), or
                   the worker's own thread (the reference loop, a layout's target rank);
    TargetWorker   model_forward -> pack_hidden -> cpu_copy_enqueue (hand over)
    DrafterWorker  take (queue_get) -> `step`: drafter_forward -> backward -> optimizer_step -> step end
    StepEnd        tokens, the deferred read-back, metrics, the progress bar, `save_every`

The target worker runs the frozen target (one replica per target device), captures the
selected layers, keeps valid tokens only and hands them to its channel (channels.py): a
queue (threads; on CUDA a copy to pinned host buffers on a side stream, announced by an
event: nobody on this side waits for it), another rank (credit-based, roles/handoff.py),
or nothing at all (the reference loop, run_loop.py, hands what `make` returns to the
drafter worker's `step`).

The drafter worker (pipelined: `run`) takes step `s`'s batch from its channel (in step
order whatever the number of target workers, so training is identical to the reference
loop); its `step` makes its own stream wait on the hand-over's event (never the host),
trains (step.py), and hands the loss, accuracy and grad norm to the step end as device
tensors (read back later, no sync: readback.py).

`--inject-delay` / `--inject-fault` (`inject`, in every stage): reproducible stalls and
failures, documented as tools for testing dashboards, alerts, stall reports and the
failure path.
"""
from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from tqdm import tqdm

from ..model.features import pack, target_features, unpack
from . import readback
from .channels import Channel, HiddenItem
from .context import RunSpec, RunState
from .saving import save

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import PipelineConfig
    from ..data.batch import Batch
    from ..model.feature_cache import FeatureCache
    from .roles.sync_timing import SyncTimer


class InjectedFault(RuntimeError):
    pass


def inject(pcfg: PipelineConfig, stage: str, step: int) -> None:
    if pcfg.inject_delay.get(stage):
        time.sleep(pcfg.inject_delay[stage])
    if stage in pcfg.inject_fault and step == pcfg.inject_fault[stage]:
        raise InjectedFault(f"injected fault in {stage} at step {step}")


# -- batch sources -----------------------------------------------------------------------
class Prefetcher:
    """A thread ahead of the target workers (pipelined): data_load as `prefetch`, a bounded
    queue, one end marker per worker; the worker's wait for it is its `data_wait` idle cause."""

    def __init__(self, spec: RunSpec, state: RunState, stop: threading.Event, n_workers: int):
        self.spec, self.tel, self.stop, self.n_workers = spec, state.tel, stop, n_workers
        self.batches: queue.Queue = queue.Queue(maxsize=spec.cfg.pipeline.prefetch)

    def run(self) -> None:
        spec, tel = self.spec, self.tel
        stream = spec.batch_stream()
        idx = spec.start_step
        blocked = 0.0  # the previous batch's wait for room in the batch queue
        while not self.stop.is_set() and idx < spec.cfg.train.steps:
            with tel.stage("data_load", trace=("batch", idx), worker="prefetch", device="cpu", rank=spec.rank,
                           batch_id=idx, step=idx, blocked_before_s=round(blocked, 6)) as s:
                b = next(stream)
                s.set(tokens=b.tokens, sequences=len(b.lengths), padded_len=b.padded_len)
                inject(spec.cfg.pipeline, "data_load", idx)
            t0 = time.perf_counter()
            self._put(b)
            blocked = time.perf_counter() - t0  # idle cause queue_full: ahead of the targets
            tel.record("dflash.batch.padding_ratio", 1 - b.tokens / (len(b.lengths) * b.padded_len))
            for n in b.lengths:
                tel.record("dflash.batch.sequence_length", n)
            idx += 1
        for _ in range(self.n_workers):  # one end marker per worker
            self._put(None)

    def _put(self, b) -> None:
        while not self.stop.is_set():
            try:
                return self.batches.put(b, timeout=0.1)
            except queue.Full:
                continue

    def batches_for(self, worker: str) -> Iterator[tuple[Batch, dict]]:
        """(batch, attributes) for one target worker until the end marker."""
        while not self.stop.is_set():
            t0 = time.perf_counter()
            b = None
            while not self.stop.is_set():
                try:
                    b = self.batches.get(timeout=0.1)
                    break
                except queue.Empty:
                    continue
            if b is None:
                return
            # data_wait: idle cause `data_wait` (the prefetcher is behind)
            yield b, {"step": b.index, "data_wait_s": round(time.perf_counter() - t0, 6)}


class InlineSource:
    """data_load on the worker's own thread: the reference loop (its step's batch), a
    layout's target rank (its share of the global batches, rebuilt from the drafter shards'
    streams: only hidden states cross the wire). ``plan`` yields (batch id, step,
    attributes, load) where load() returns the batch."""

    def __init__(self, spec: RunSpec, state: RunState, plan: Iterator[tuple[int, int, dict, Callable[[], Batch]]]):
        self.spec, self.tel, self.plan = spec, state.tel, plan

    @classmethod
    def reference(cls, spec: RunSpec, state: RunState) -> InlineSource:
        """The reference loop's: step s loads batch s of this rank's stream."""
        load = spec.batch_stream().__next__
        return cls(spec, state, ((s, s, {}, load) for s in itertools.count(spec.start_step)))

    def batches_for(self, worker: str) -> Iterator[tuple[Batch, dict]]:
        spec, tel, rank = self.spec, self.tel, self.spec.rank
        for bid, step, attrs, load in self.plan:
            with tel.stage("data_load", trace=("batch", bid), worker=worker, rank=rank, batch_id=bid,
                           step=step, device="cpu", **attrs) as s:
                b = load()
                s.set(tokens=b.tokens, sequences=len(b.lengths), padded_len=b.padded_len)
                inject(spec.cfg.pipeline, "data_load", step)
            yield b, {"step": step, **attrs}


# -- the target worker -------------------------------------------------------------------
class TargetWorker:
    """model_forward -> pack_hidden (`make`: a batch's features), then cpu_copy_enqueue
    (`hand_over` to the channel). ``channel`` None: the reference loop, which takes what
    `make` returns straight to the drafter worker."""

    def __init__(self, spec: RunSpec, state: RunState, target: PreTrainedModel, channel: Channel | None, name: str,
                 cache: FeatureCache | None = None, extra_attrs: dict | None = None):
        self.spec, self.state, self.target, self.channel, self.name, self.cache = \
            spec, state, target, channel, name, cache
        self.tel, self.pcfg, self.rank = state.tel, spec.cfg.pipeline, spec.rank
        self.dev = torch.device(target.device)
        self.cuda = self.dev.type == "cuda"
        self.extra = dict(extra_attrs or {})
        if spec.feature_store is not None:  # train --features: model_forward only moves captured rows
            self.extra["source"] = "features"
        self.side = self.pool = None
        if channel is not None:  # a queue or a rank: on CUDA, a side stream and (across devices) pinned staging
            self.side = torch.cuda.Stream(self.dev) if self.cuda else None
            H = target.config.get_text_config().hidden_size * len(spec.feature_ids)
            t = spec.cfg.train
            self.pool = channel.staging(self.dev, t.batch_size * spec.cfg.data.max_len * H, target.dtype)
        self.batches = self.tokens = 0
        self.blocked_s = 0.0

    def attrs(self, b: Batch, extra: dict) -> dict:
        return dict(worker=self.name, device=str(self.dev), rank=self.rank, batch_id=b.index,
                    tokens=b.tokens, sequences=len(b.lengths), padded_len=b.padded_len, **self.extra, **extra)

    def make(self, b: Batch, extra: dict) -> HiddenItem:
        """model_forward -> pack_hidden: the batch's features (the selected layers' hidden
        states, valid tokens only), on the target's device."""
        tel, key, a = self.tel, ("batch", b.index), self.attrs(b, extra)
        step = a["step"]
        cur = torch.cuda.current_stream(self.dev) if self.cuda else None
        with tel.stage("model_forward", trace=key, stream=cur, **a) as span:
            source: dict = {}
            feats = target_features(self.target, b, self.spec.feature_ids, self.dev, cache=self.cache, source=source)
            span.set(**source)  # features: cache | forward | captured
            inject(self.pcfg, "model_forward", step)
        with tel.stage("pack_hidden", trace=key, stream=cur, **a):
            packed = pack(feats, b.lengths)
            inject(self.pcfg, "pack_hidden", step)
        return HiddenItem(batch=b, packed=packed, worker=self.name)

    def hand_over(self, item: HiddenItem, extra: dict) -> bool:
        """cpu_copy_enqueue: False when the channel takes nothing more (the drafters stopped)."""
        state, ch, tel, thr = self.state, self.channel, self.tel, self.pcfg.stall_threshold_s
        a = self.attrs(item.batch, extra)
        cur = torch.cuda.current_stream(self.dev) if self.cuda else None  # the stream `make` ran on
        with tel.stage("cpu_copy_enqueue", trace=("batch", item.batch.index), **a, **ch.span_attrs) as s:
            ch.stage_copy(item, self.pool, self.side, cur, state.workers_stop)  # toward the drafter's device
            inject(self.pcfg, "cpu_copy_enqueue", a["step"])
            blocked = ch.hand_over(item, stop=state.stop.is_set())
            if blocked is None:
                s.set(cancelled=True)
                return False
            s.set(blocked_s=round(blocked, 6))
            if blocked > thr:
                s.event("queue_full", wait_s=round(blocked, 6))
        tel.add("dflash.queue.producer_blocked_seconds", blocked, worker=self.name)
        tel.add("dflash.worker.batches", 1, worker=self.name)
        tel.add("dflash.worker.tokens", item.batch.tokens, worker=self.name)
        self.batches += 1
        self.tokens += item.batch.tokens
        self.blocked_s += blocked
        return True

    def run(self, source: Prefetcher | InlineSource) -> None:
        """The worker's loop over its batch source (a thread, or a target rank's main thread)."""
        for b, extra in source.batches_for(self.name):
            if self.state.workers_stop.is_set():
                break
            if not self.hand_over(self.make(b, extra), extra):
                break

    def counts(self) -> dict:
        return {"batches": self.batches, "tokens": self.tokens, "credit_wait_s": round(self.blocked_s, 3)}


# -- the drafter worker ------------------------------------------------------------------
class DrafterWorker:
    """`step(step_no, item)`: drafter_forward -> backward -> optimizer_step -> the step's end
    (`StepEnd`), on one batch's features. `run()`: the pipelined loop, which takes each
    step's item from its channel (queue_get) and steps on it; the reference loop
    (run_loop.py) calls `step` itself (``channel`` None). `close()` when done."""

    def __init__(self, spec: RunSpec, state: RunState, channel: Channel | None, name: str,
                 sync_timer: SyncTimer | None = None):
        self.spec, self.state, self.channel, self.name, self.sync_timer = spec, state, channel, name, sync_timer
        self.tel, self.pcfg, self.rank = state.tel, spec.cfg.pipeline, spec.rank
        self.dev = state.train_step.device
        self.cuda = self.dev.type == "cuda"
        t = spec.cfg.train
        self.end = min(t.steps, t.stop_after) if t.stop_after else t.steps
        self.end_step = StepEnd(spec, state, name)  # tokens, read-back, progress, save cadence

    def more_steps(self) -> bool:
        """Another step: below the last, no stop asked (ranks vote on it), no worker failed."""
        state = self.state
        stop = state.stop.is_set()
        if state.vote is not None:  # every rank votes every step: same stop step everywhere
            stop = state.vote(stop)
        return state.train_step.step < self.end and not stop and not state.workers_stop.is_set()

    def _attrs(self, step: int) -> tuple[tuple, dict]:
        """The step's trace key and span attributes (its batch id: the channel's, else the step)."""
        bid = self.channel.batch_id(step) if self.channel is not None else step
        return ("batch", bid), dict(worker=self.name, device=str(self.dev), rank=self.rank, batch_id=bid, step=step)

    def run(self) -> None:
        """The pipelined loop: each step's item from the channel, in step order, then `step`."""
        try:
            while self.more_steps():
                step_no = self.state.train_step.step
                self.step(step_no, self._take(step_no))
        finally:
            self.close()

    def _take(self, step: int) -> HiddenItem:
        """queue_get: the item for `step` from the channel, with its wait."""
        ch, tel = self.channel, self.tel
        key, a = self._attrs(step)
        with tel.stage("queue_get", trace=key, **a) as s:
            item, waited = ch.take(step)
            ch.taken(step)
            inject(self.pcfg, "queue_get", step)
            s.set(wait_s=round(waited, 6), queue_depth=ch.depth())
            if waited > self.pcfg.stall_threshold_s:
                s.event("stall", cause="queue_empty", wait_s=round(waited, 6))
        tel.add("dflash.queue.consumer_starved_seconds", waited, worker=self.name)
        return item

    def step(self, step_no: int, item: HiddenItem) -> None:
        """One training step on a batch's features: drafter_forward (the loss: step.py,
        model/losses.py) -> backward -> optimizer_step -> the step's end."""
        st, pcfg, tel = self.state.train_step, self.pcfg, self.tel
        key, a = self._attrs(step_no)
        b = item.batch
        a |= dict(tokens=b.tokens, sequences=len(b.lengths), padded_len=b.padded_len)
        cur = torch.cuda.current_stream(self.dev) if self.cuda else None
        with tel.stage("drafter_forward", trace=key, stream=cur, **a):
            if item.ready is not None:
                cur.wait_event(item.ready)     # device-side wait, the host moves on
            if item.packed.device == self.dev and self.cuda:
                item.packed.record_stream(cur)  # made on another stream (NCCL receive)
            x = item.packed.to(self.dev, non_blocking=True)
            if item.release is not None:
                done = torch.cuda.Event()
                done.record(cur)
                item.release(done)
            loss, acc = st.forward(unpack(x, b.lengths, b.padded_len), b)
            inject(pcfg, "drafter_forward", step_no)
        with tel.stage("backward", trace=key, stream=cur, **a) as s:
            st.backward(loss)
            inject(pcfg, "backward", step_no)
            sync = self.sync_timer.take() if self.sync_timer is not None else 0.0
            if sync:
                s.set(sync_s=round(sync, 6))
        with tel.stage("optimizer_step", trace=key, links=[key], stream=cur, **a):
            gnorm, nonfinite = st.optimizer_step(loss)
            inject(pcfg, "optimizer_step", step_no)
        self.end_step(step_no, b.tokens, loss, acc, gnorm, nonfinite)

    def close(self) -> None:
        self.end_step.close()


class StepEnd:
    """The end of a training step, one path for the reference loop and the pipeline: count
    the tokens, queue the deferred read-back of loss / accuracy / grad norm and turn
    whatever has come back into metrics (a non-finite step gets a `skipped_step` marker in
    its batch's trace), move the progress bar (step, last known loss, tokens/s), queue the
    acceptance estimate when due, and save when `train.save_every` says so. Nothing here
    reads a device tensor on the host."""

    def __init__(self, spec: RunSpec, state: RunState, worker: str):
        self.spec, self.state, self.tel, self.worker = spec, state, state.tel, worker
        self.save_every = spec.cfg.train.save_every
        self.t0 = time.perf_counter()
        self.tokens = 0  # this run's, for the bar's tokens/s
        self.bar = tqdm(total=spec.cfg.train.steps, initial=state.train_step.step, desc="train", unit="step",
                        file=sys.stderr, dynamic_ncols=True, disable=not spec.is_lead, mininterval=0.5)

    def __call__(self, step: int, tokens: int, loss: torch.Tensor, acc: torch.Tensor, gnorm: torch.Tensor,
                 nonfinite: torch.Tensor) -> None:
        state, tel, worker = self.state, self.tel, self.worker
        state.tokens += tokens
        tel.add("dflash.tokens", tokens, worker=worker)
        tel.add("dflash.train.steps", 1, worker=worker)
        self._record(step, loss, acc, gnorm, nonfinite)
        self._progress(tokens)
        est = state.estimate
        if est is not None and est.due(state.train_step.step):
            with tel.stage("acceptance_estimate", trace=("batch", step), worker=worker, step=step):
                est(state.train_step.step)
        if self.save_every and state.train_step.step % self.save_every == 0:
            save(self.spec, state)

    def _record(self, step, loss, acc, gnorm, nonfinite) -> None:
        state, tel = self.state, self.tel
        before, nf_before = len(state.history), len(state.nonfinite)
        readback.record(state, step, loss, acc, gnorm, nonfinite)
        for _, l, _, g in state.history[before:]:
            tel.record("dflash.train.loss", l)
            tel.record("dflash.train.grad_norm", g)
        for s in state.nonfinite[nf_before:]:  # known only now (deferred read): mark the batch
            tel.add("dflash.train.nonfinite_steps", 1)
            with tel.stage("skipped_step", trace=("batch", s), worker=self.worker, step=s) as sp:
                sp.event("nonfinite_loss", step=s, action="update skipped")

    def _progress(self, tokens: int) -> None:
        self.tokens += tokens
        self.bar.update(1)
        h = self.state.history
        rate = self.tokens / max(1e-9, time.perf_counter() - self.t0)
        self.bar.set_postfix_str(f"loss={h[-1][1]:.3f} tok/s={rate:,.0f}" if h else f"tok/s={rate:,.0f}",
                                 refresh=False)

    def close(self) -> None:
        self.bar.close()

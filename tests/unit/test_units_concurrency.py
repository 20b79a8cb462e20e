"""In-process unit tests of the pieces that carry the pipeline's concurrency: the hidden-state
queue, the pinned staging pool and the deferred read-back. CPU only, fake CUDA events.

Positive conditions are waited for (events with a generous timeout); a "still blocked"
check is a short bounded wait that can only pass falsely on a slow machine, never fail.
"""
import threading

import pytest
import torch

from dflash.run.hidden_queue import Closed, HiddenQueue
from dflash.run.channels import PinnedPool
from dflash.run.readback import DeferredScalars

DONE_S = 10.0      # upper bound for something that must happen
BLOCKED_S = 0.05   # how long "still blocked" is watched


class Call:
    """Run fn in a thread; remember its result or exception."""

    def __init__(self, fn, *args):
        self.result = self.error = None
        self.done = threading.Event()
        self._t = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self._t.start()

    def _run(self, fn, args):
        try:
            self.result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.error = e
        finally:
            self.done.set()

    def wait(self):
        assert self.done.wait(DONE_S), "call did not finish"
        return self

    def blocked(self) -> bool:
        return not self.done.wait(BLOCKED_S)


class FakeEvent:
    """Stands in for torch.cuda.Event: query() answers what the test says."""

    def __init__(self, done=False):
        self.is_done = done
        self.synchronized = False

    def query(self):
        return self.is_done

    def synchronize(self):
        self.synchronized = True
        self.is_done = True


# ----------------------------------------------------------------------------- HiddenQueue


def test_queue_delivers_in_id_order_whatever_the_put_order():
    q = HiddenQueue(capacity=4)
    for i in (2, 0, 3, 1):
        q.put(i, f"item{i}")
    assert [q.get(i)[0] for i in range(4)] == ["item0", "item1", "item2", "item3"]
    assert q.depth() == 0


def test_queue_get_waits_for_its_own_id_not_just_any_item():
    q = HiddenQueue(capacity=4)
    q.put(1, "one")
    call = Call(q.get, 0)
    assert call.blocked(), "batch 1 must not be handed out for batch 0"
    q.put(0, "zero")
    assert call.wait().result[0] == "zero"
    assert q.get(1)[0] == "one"


def test_queue_min_ready_holds_the_consumer_until_enough_items_wait():
    q = HiddenQueue(capacity=4, min_ready=3)
    q.put(0, "a")
    q.put(1, "b")
    call = Call(q.get, 0)
    assert call.blocked(), "2 items < min_ready=3"
    q.put(2, "c")
    assert call.wait().result[0] == "a"


def test_queue_min_ready_is_waived_once_producers_are_done():
    q = HiddenQueue(capacity=4, min_ready=3)
    q.put(0, "last")
    call = Call(q.get, 0)
    assert call.blocked()
    q.producers_done()
    assert call.wait().result[0] == "last"
    with pytest.raises(Closed):  # nothing more will come
        q.get(1)


def test_full_queue_blocks_producers_but_admits_the_batch_the_consumer_needs_next():
    q = HiddenQueue(capacity=2)
    q.put(1, "one")
    q.put(2, "two")
    late = Call(q.put, 3, "three")
    assert late.blocked(), "full: batch 3 must wait (back-pressure)"
    needed = Call(q.put, 0, "zero")  # the lowest id: without it the consumer could never proceed
    assert needed.wait().error is None
    assert q.get(0)[0] == "zero"
    assert late.blocked(), "still 2 items waiting"
    assert q.get(1)[0] == "one"
    assert late.wait().error is None and isinstance(late.result, float)  # blocked seconds returned
    assert [q.get(i)[0] for i in (2, 3)] == ["two", "three"]
    assert q.blocked_s > 0


def test_close_wakes_a_blocked_producer_and_a_blocked_consumer():
    q = HiddenQueue(capacity=1)
    q.put(1, "one")
    producer = Call(q.put, 2, "two")     # full, and 2 is not the next needed
    consumer = Call(q.get, 0)            # 0 never arrives
    assert producer.blocked() and consumer.blocked()
    q.close()
    assert isinstance(producer.wait().error, Closed)
    assert isinstance(consumer.wait().error, Closed)
    with pytest.raises(Closed):
        q.put(3, "three")


# ----------------------------------------------------------------------------- PinnedPool


def test_pinned_pool_reuses_a_buffer_only_after_its_done_event():
    pool = PinnedPool(1, 8, torch.float32, pin_memory=False)
    stop = threading.Event()
    buf = pool.take(stop)
    done = FakeEvent(done=False)
    pool.give_back(buf, done)
    call = Call(pool.take, stop)
    assert call.blocked(), "the consumer's copy out of the buffer is not finished"
    done.is_done = True
    assert call.wait().result is buf


def test_pinned_pool_hands_buffers_back_in_return_order():
    pool = PinnedPool(2, 8, torch.float32, pin_memory=False)
    stop = threading.Event()
    a, b = pool.take(stop), pool.take(stop)
    assert a is not b
    ev_a, ev_b = FakeEvent(), FakeEvent(done=True)
    pool.give_back(a, ev_a)
    pool.give_back(b, ev_b)
    call = Call(pool.take, stop)
    assert call.blocked(), "b's event is done, but a was handed back first"
    ev_a.is_done = True
    assert call.wait().result is a
    assert pool.take(stop) is b


def test_pinned_pool_take_ends_with_closed_when_the_run_stops():
    pool = PinnedPool(1, 8, torch.float32, pin_memory=False)
    stop = threading.Event()
    pool.give_back(pool.take(stop), FakeEvent())
    call = Call(pool.take, stop)
    assert call.blocked()
    stop.set()
    assert isinstance(call.wait().error, Closed)


# ----------------------------------------------------------------------------- read-back


class FakeCopies(DeferredScalars):
    """Each put's "device copy" finishes when the test says so."""

    def __init__(self):
        super().__init__()
        self.events = []

    def _start_copy(self, vals):
        ev = FakeEvent()
        self.events.append(ev)
        return vals.clone(), ev


def test_readback_on_cpu_is_ready_at_once_and_keeps_names():
    r = DeferredScalars()
    r.put(0, loss=torch.tensor(2.5), acc=torch.tensor(0.25))
    r.put(1, loss=torch.tensor([1.5]), acc=torch.tensor(0.5))  # any 1-element shape
    assert r.ready() == [(0, {"loss": 2.5, "acc": 0.25}), (1, {"loss": 1.5, "acc": 0.5})]
    assert r.ready() == []


def test_readback_returns_only_finished_copies_in_step_order():
    r = FakeCopies()
    for step in range(3):
        r.put(step, loss=torch.tensor(float(step)))
    assert r.ready() == []
    r.events[1].is_done = True
    assert r.ready() == [], "step 1's copy is done, but step 0 comes first"
    r.events[0].is_done = True
    assert r.ready() == [(0, {"loss": 0.0}), (1, {"loss": 1.0})]
    assert r.drain_blocking() == [(2, {"loss": 2.0})]
    assert r.events[2].synchronized


def test_readback_put_detaches_from_the_graph():
    r = DeferredScalars()
    w = torch.tensor(3.0, requires_grad=True)
    r.put(0, loss=w * 2)
    (step, vals), = r.ready()
    assert vals == {"loss": 6.0}

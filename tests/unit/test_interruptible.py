"""A rank waiting in a blocking collective still takes a signal (errors.interruptible): the
join runs in a helper thread while the main thread waits in slices, so SIGTERM's exception
leaves at once, with the phase it waits in marked, instead of after the C++ call returns (a
rank that never comes: never, and torchrun SIGKILLs the rank 30 s later, its trace unwritten)."""
import os
import signal
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from dflash.errors import Interrupted, interruptible, raise_on_sigterm


def test_a_sigterm_stops_a_main_thread_that_waits_on_a_call_blocked_in_cpp():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=20))
    started, returned = threading.Event(), []

    def wait_for_a_rank_that_never_comes():
        started.set()
        try:
            store.get("never-set")  # blocks in C++ until the store's timeout (20 s), signals or not
        finally:
            returned.append(1)

    prev = signal.getsignal(signal.SIGTERM)
    raise_on_sigterm()
    try:
        threading.Thread(target=lambda: started.wait(10) and os.kill(os.getpid(), signal.SIGTERM)).start()
        with pytest.raises(Interrupted):
            interruptible(wait_for_a_rank_that_never_comes)
        assert not returned  # the signal came through while the call was still blocked (called directly: after it)
    finally:
        signal.signal(signal.SIGTERM, prev)


def test_the_calls_value_and_its_exception_come_back_to_the_caller():
    assert interruptible(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(ValueError, match="bad"):
        interruptible(lambda: (_ for _ in ()).throw(ValueError("bad")))

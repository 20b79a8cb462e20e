"""The threads of one process's workers. The first failure anywhere stops them all
promptly (every worker checks `state.workers_stop` between stages, and the channel's waits
wake up) and is re-raised on the calling thread, naming the worker and its stage."""
from __future__ import annotations

import sys
import threading
import time

from ..errors import WorkerError
from .channels import Channel
from .context import RunState
from .hidden_queue import Closed


class WorkerSet:
    def __init__(self, state: RunState, channel: Channel | None = None):
        self.state, self.channel = state, channel
        self.errors: list[tuple[str, BaseException]] = []
        self.threads: list[threading.Thread] = []

    def start(self, name: str, fn, *args) -> None:
        def run():
            try:
                fn(*args)
            except Closed:
                pass
            except BaseException as e:  # any failure ends the whole run
                self.errors.append((name, e))
                self.shutdown()
        t = threading.Thread(target=run, name=name, daemon=True)
        self.threads.append(t)
        t.start()

    def run_here(self, name: str, fn) -> bool:
        """fn on the calling thread, reported like any worker; True when it ended normally."""
        try:
            fn()
            return True
        except Closed:
            return False
        except Exception as e:
            self.errors.append((name, e))
            return False

    def shutdown(self) -> None:
        self.state.workers_stop.set()
        if self.channel is not None:  # wake its waiters (the reference loop has none)
            self.channel.close()

    def finish(self) -> None:
        self.shutdown()
        self.join()
        if self.errors:  # the first failure; the others are usually its consequences
            name, err = self.errors[0]
            raise WorkerError.from_failure(name, err) from err

    def join(self, patience_s: float = 5.0, limit_s: float = 120.0) -> None:
        """Workers notice the stop between stages, so this returns once a running forward is
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

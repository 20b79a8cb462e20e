"""Live idle attribution: the consumer feeds every shipped stage record to an
IdleAccumulator (otel/idle.py) and turns its growing totals into metrics:

  {ns}.worker.busy            counter, s   (worker)            time inside compute stages
  {ns}.worker.idle            counter, s   (worker, cause)     idle time by cause
  {ns}.worker.busy_fraction   gauge,   1   (worker)            busy / wall so far

All of it runs on the exporter side (otel.exporter.consumer: one feeder, as the accumulator
requires); the workers only ever paid for their stage records.
"""
from __future__ import annotations

from otel.idle import DEFAULT_RULES, IdleAccumulator
from otel.records import ATTRS, EXTRA, NAME, T0, T1


class IdleMetrics:
    def __init__(self, namespace: str, rules=DEFAULT_RULES, worker_attribute: str = "worker"):
        self.acc = IdleAccumulator(rules)
        self.key = worker_attribute
        self.busy_name = f"{namespace}.worker.busy"
        self.idle_name = f"{namespace}.worker.idle"
        self.fraction_name = f"{namespace}.worker.busy_fraction"
        self._sent: dict = {}   # (worker, cause|None) -> seconds already exported

    def feed(self, raw_records) -> None:
        """Stage records (otel/records.py)."""
        key = self.key
        for rec in raw_records:
            attrs, extra = rec[ATTRS], rec[EXTRA]
            worker = (extra or {}).get(key, attrs.get(key))
            if worker is None:
                continue
            self.acc.feed(str(worker), rec[NAME], rec[T0], rec[T1], {**attrs, **extra} if extra else attrs)

    def deltas(self, now_ns: int, final: bool = False) -> list[tuple[str, tuple, float]]:
        """Counter increments since the last call, as (name, sorted attrs, seconds).
        Records older than the accumulator's reorder window are committed; final: all."""
        out = []
        snap = self.acc.snapshot(flush=True) if final else self.acc.snapshot(now_ns=now_ns)
        for worker, t in snap.items():
            for cause, secs in [(None, t["busy_s"])] + list(t["idle_s"].items()):
                prev = self._sent.get((worker, cause), 0.0)
                if secs > prev:
                    self._sent[(worker, cause)] = secs
                    if cause is None:
                        out.append((self.busy_name, (("worker", worker),), secs - prev))
                    else:
                        out.append((self.idle_name, (("cause", cause), ("worker", worker)), secs - prev))
        return out

    def fractions(self) -> list[tuple[float, dict]]:
        return [(t["busy_fraction"], {"worker": w}) for w, t in self.acc.snapshot().items()]

    def summary(self, final: bool = False) -> list[dict]:
        out = []
        for worker, t in sorted(self.acc.snapshot(flush=final).items()):
            idle = {c: round(s, 6) for c, s in t["idle_s"].items()}
            top = max(idle, key=idle.get) if idle and max(idle.values()) > 0 else None
            out.append({"worker": worker, "busy_fraction": round(t["busy_fraction"], 6),
                        "busy_s": round(t["busy_s"], 6), "wall_s": round(t["wall_s"], 6),
                        "idle_s": idle, "top_idle_cause": top})
        return out

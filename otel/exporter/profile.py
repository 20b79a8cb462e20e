"""Per-stage duration statistics for the console table and tel.summary().

A log-bucket sketch keeps memory constant however long the run: 64 buckets per octave
from math.frexp (one C call, no log), so quantiles are within ~1% of the true value;
count, total and max are exact.

Work and wait apart: a stage may record, as span attributes named in `wait_attributes`
(default `blocked_s`, `wait_s`), seconds it spent inside waiting (for queue space, for
an item). From the first such record on, the stage also keeps a work sketch (duration
minus wait; a copy of the duration sketch at that moment, since every earlier record
waited 0) and a wait sketch, and its summary carries `work_*` / `wait_*` figures. Stages
that never wait pay two dict lookups per record and keep their summary as it was.
"""
from __future__ import annotations

from math import frexp, ldexp

from otel.config import WAIT_ATTRIBUTES
from otel.records import ATTRS, EXTRA, NAME, T0, T1
from otel.summary import with_shares

_SUB = 64  # buckets per power of two


_ZERO = -(1 << 30)  # the bucket of 0 s (a stage that only waited has no work)


def _bucket(seconds: float) -> int:
    if seconds <= 0:
        return _ZERO
    m, e = frexp(seconds)          # seconds = m * 2**e, 0.5 <= m < 1
    return e * _SUB + int((m - 0.5) * 2 * _SUB)


def _bucket_mid(idx: int) -> float:
    if idx == _ZERO:
        return 0.0
    e, sub = divmod(idx, _SUB)
    return ldexp(0.5 + (sub + 0.5) / (2 * _SUB), e)


class StageStats:
    __slots__ = ("count", "total_s", "max_s", "buckets", "work", "wait")

    def __init__(self):
        self.count = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self.buckets: dict[int, int] = {}
        self.work: StageStats | None = None   # both set once the stage recorded a wait
        self.wait: StageStats | None = None

    def copy(self) -> "StageStats":
        out = StageStats()
        out.count, out.total_s, out.max_s, out.buckets = self.count, self.total_s, self.max_s, dict(self.buckets)
        return out

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        if seconds > self.max_s:
            self.max_s = seconds
        idx = _bucket(seconds)
        self.buckets[idx] = self.buckets.get(idx, 0) + 1

    def quantile(self, q: float) -> float:
        if not self.count:
            return 0.0
        rank = q * (self.count - 1)
        seen = 0
        for idx in sorted(self.buckets):
            seen += self.buckets[idx]
            if seen > rank:
                return min(_bucket_mid(idx), self.max_s)
        return self.max_s


class Profile:
    def __init__(self, wait_attributes=WAIT_ATTRIBUTES):
        self.stages: dict[str, StageStats] = {}
        self.wait_attributes = tuple(wait_attributes)

    def add(self, name: str, seconds: float, wait_s: float = 0.0) -> None:
        st = self.stages.get(name)
        if st is None:
            st = self.stages[name] = StageStats()
        if wait_s and st.wait is None:
            st.work, st.wait = st.copy(), StageStats()
            st.wait.count = st.count
            st.wait.buckets = {_ZERO: st.count} if st.count else {}
        st.add(seconds)
        if st.wait is not None:
            wait_s = min(max(wait_s, 0.0), seconds)
            st.work.add(seconds - wait_s)
            st.wait.add(wait_s)

    def add_records(self, records) -> None:
        """Host durations of stage records (otel/records.py)."""
        stages, keys = self.stages, self.wait_attributes
        for rec in records:
            name = rec[NAME]
            seconds = (rec[T1] - rec[T0]) * 1e-9
            wait_s = 0.0
            if keys:
                attrs, extra = rec[ATTRS], rec[EXTRA]
                for k in keys:
                    v = extra.get(k) if extra else None
                    if v is None:
                        v = attrs.get(k)
                    if v is not None and isinstance(v, (int, float)):
                        wait_s += v
            st = stages.get(name)
            if wait_s or st is None or st.wait is not None:
                self.add(name, seconds, wait_s)
                continue
            st.count += 1
            st.total_s += seconds
            if seconds > st.max_s:
                st.max_s = seconds
            if seconds > 0:
                m, e = frexp(seconds)
                idx = e * _SUB + int((m - 0.5) * 2 * _SUB)
            else:
                idx = _ZERO
            b = st.buckets
            b[idx] = b.get(idx, 0) + 1

    def summary(self, wall_s: float) -> dict:
        out = {}
        for name, st in self.stages.items():
            out[name] = d = {
                "count": st.count,
                "total_s": st.total_s,
                "p50_s": st.quantile(0.50),
                "p95_s": st.quantile(0.95),
                "p99_s": st.quantile(0.99),
                "max_s": st.max_s,
            }
            if st.wait is not None:
                d.update(work_total_s=st.work.total_s, work_p50_s=st.work.quantile(0.50),
                         work_p95_s=st.work.quantile(0.95), work_max_s=st.work.max_s,
                         wait_total_s=st.wait.total_s, wait_p50_s=st.wait.quantile(0.50),
                         wait_p95_s=st.wait.quantile(0.95), wait_max_s=st.wait.max_s)
            with_shares(d, wall_s)
        return out

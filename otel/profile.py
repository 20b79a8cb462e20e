"""Per-stage duration statistics for the console table and tel.summary().

A log-bucket sketch keeps memory constant however long the run: 64 buckets per octave
from math.frexp (one C call, no log), so quantiles are within ~1% of the true value;
count, total and max are exact.
"""
from __future__ import annotations

from math import frexp, ldexp

from otel.records import NAME, T0, T1

_SUB = 64  # buckets per power of two


def _bucket(seconds: float) -> int:
    m, e = frexp(seconds)          # seconds = m * 2**e, 0.5 <= m < 1
    return e * _SUB + int((m - 0.5) * 2 * _SUB)


def _bucket_mid(idx: int) -> float:
    e, sub = divmod(idx, _SUB)
    return ldexp(0.5 + (sub + 0.5) / (2 * _SUB), e)


class StageStats:
    __slots__ = ("count", "total_s", "max_s", "_buckets")

    def __init__(self):
        self.count = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self._buckets: dict[int, int] = {}

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        if seconds > self.max_s:
            self.max_s = seconds
        idx = _bucket(seconds)
        self._buckets[idx] = self._buckets.get(idx, 0) + 1

    def quantile(self, q: float) -> float:
        if not self.count:
            return 0.0
        rank = q * (self.count - 1)
        seen = 0
        for idx in sorted(self._buckets):
            seen += self._buckets[idx]
            if seen > rank:
                return min(_bucket_mid(idx), self.max_s)
        return self.max_s


class Profile:
    def __init__(self):
        self.stages: dict[str, StageStats] = {}

    def add(self, name: str, seconds: float) -> None:
        st = self.stages.get(name)
        if st is None:
            st = self.stages[name] = StageStats()
        st.add(seconds)

    def add_records(self, records) -> None:
        """Host durations of stage records (otel/records.py)."""
        stages = self.stages
        for rec in records:
            name = rec[NAME]
            seconds = (rec[T1] - rec[T0]) * 1e-9
            st = stages.get(name)
            if st is None:
                st = stages[name] = StageStats()
            st.count += 1
            st.total_s += seconds
            if seconds > st.max_s:
                st.max_s = seconds
            m, e = frexp(seconds)
            idx = e * _SUB + int((m - 0.5) * 2 * _SUB)
            b = st._buckets
            b[idx] = b.get(idx, 0) + 1

    def summary(self, wall_s: float) -> dict:
        out = {}
        for name, st in self.stages.items():
            out[name] = {
                "count": st.count,
                "total_s": st.total_s,
                "p50_s": st.quantile(0.50),
                "p95_s": st.quantile(0.95),
                "p99_s": st.quantile(0.99),
                "max_s": st.max_s,
                "share": st.total_s / wall_s if wall_s > 0 else 0.0,
            }
        return out


def _fmt_s(s: float) -> str:
    if s >= 1:
        return f"{s:8.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:7.2f} ms"
    return f"{s * 1e6:7.1f} us"


def format_table(summary: dict, title: str = "telemetry profile") -> str:
    """Render tel.summary() as the console profile table."""
    stages = summary.get("stages", {})
    width = max([len("stage")] + [len(n) for n in stages])
    lines = [f"== {title}: wall {summary.get('wall_s', 0.0):.2f} s =="]
    lines.append(f"{'stage':<{width}} {'count':>8} {'p50':>10} {'p95':>10} {'max':>10} {'share':>7}")
    for name, st in sorted(stages.items(), key=lambda kv: -kv[1]["total_s"]):
        lines.append(
            f"{name:<{width}} {st['count']:>8} {_fmt_s(st['p50_s']):>10} {_fmt_s(st['p95_s']):>10} "
            f"{_fmt_s(st['max_s']):>10} {st['share'] * 100:6.1f}%"
        )
    h = summary.get("health", {})
    reasons = ", ".join(f"{r} {n}" for r, n in (h.get("dropped") or {}).items() if n)
    lines.append(
        "health: spans recorded {0} exported {1} dropped {2}{3}, queued {4}, export failures {5}".format(
            h.get("spans_recorded", 0), h.get("spans_exported", 0), h.get("spans_dropped", 0),
            f" ({reasons})" if reasons else "", h.get("spans_queued", 0), h.get("export_failures", 0))
    )
    for note in summary.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)

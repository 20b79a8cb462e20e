"""The paired verdict's design and arithmetic: the order engines are asked in, and the 95%
interval of each ratio (no vLLM here: these run on recorded per-request times).

Why paired and interleaved: on a shared machine the speed drifts by tens of percent from
minute to minute (the same engine served ngram at 20.1 tokens/s in one run and 15.5 in the
next). Engines run one after the other put that drift into their ratio; engines kept up at
once and asked the same prompt back to back put it into both sides of the ratio, where it
cancels. Within a second the speed swings too, so the engines are asked at once and run in turns
of tens of ms (engine/paired.py): the swings land on every engine of a prompt alike. The order
(who goes first) is rotated per prompt and per round, so that no engine always goes first
(after a cold start of the prompt). The rotation is cyclic: each engine follows the same
neighbour throughout; the engines are separate processes that share no cache, so what one
request leaves behind (caches warmed in the CPU) is the machine's, which the pairs share.

The interval is a two-stage bootstrap: prompts drawn with replacement, then, within each
drawn prompt, its rounds drawn with replacement; every method's times come from the same
draws (paired), and the ratio is that of the sums (tokens/s over the whole draw, as the
point is). Prompts are the first stage because they differ most (a prompt's acceptance runs
from 1.2 to 3.3); rounds carry the machine's jitter. Percentile interval, a fixed seed: the
same times give the same interval.

Too few requests decide nothing: a bootstrap of one prompt (or of one round, when only the
rounds are drawn) has zero width whatever the machine did, and a percentile interval from
two or three units is far narrower than its level says. An interval from fewer than
MIN_PROMPTS prompts (and MIN_ROUNDS rounds with ``these_prompts``) or MIN_REQUESTS paired requests
is reported, marked ``"enough": false``, and `decided` calls it undecided.

With ``these_prompts`` the first stage is skipped: every prompt is kept once and only its
rounds are drawn, so the interval holds the machine's jitter alone. It answers "on these
prompts, on this machine, which is faster?", which more rounds narrow; the full interval
answers it for prompts like these, which only more prompts narrow (docs/serving.md).

More prompts without more requests (`steps_interval`, two-phase sampling): the verdict times a
few of the eval's held-out prompts, and our decoder has stepped through all of them. A
method's time on a prompt is, to first order, its forward passes there times its cost per
pass, and at T = 0 the passes follow from the greedy output alone (a drafter's from our
decoder, whose accepted drafts agree with vLLM's within one a prompt:
tests/engine/test_engine_agreement.py; ngram's from vLLM's own rule walked over the output;
each verdict compares the counts on its timed prompts, `passes_vs_ours`). So each method's
cost per pass is measured on the timed prompts, and its passes are counted on every held-out
one; the ratio is that of cost times passes. The interval draws the timed prompts and their
rounds (the cost: the machine's jitter, and what the first-order model leaves out, such as a
long prompt's prefill) and, independently, all the held-out prompts (their passes: the
prompts' spread over N prompts instead of P). It is as wide as the full interval when the
machine's jitter dominates, and narrower when the prompts' spread does. Both intervals draw
the prompts' spread from few timed prompts with a percentile bootstrap, which reads a little
narrow at 6: simulated, the plain percentiles held the true ratio 87-95% (`interval`) and
91-98% (`steps_interval`) of the time at a nominal 95% (bench/verdict_coverage.py,
docs/serving.md). So both cut the expanded percentiles (Hesterberg, "What teachers should know
about the bootstrap", The American Statistician 69(4), 2015): for n units drawn, the draws
beyond Phi(-sqrt(n / (n - 1)) t_{n-1, 0.975}) at each end; n is the prompts for `interval`,
and for `steps_interval` the effective prompts behind its two stages (Welch-Satterthwaite over
the spread each stage shows in the draws: P where the timed cost dominates, N where the
passes do). Simulated at the demo's shape, 94-99% and 94-99%. The rounds of these prompts
alone keep the plain percentiles (2 rounds as n would say nothing).
"""
from __future__ import annotations

import math
import random
import statistics

LEVEL = 0.95
RESAMPLES = 2000
MIN_PROMPTS = 3    # prompts an interval over prompts must draw from to decide anything
MIN_ROUNDS = 2     # rounds per prompt an interval over rounds alone (these_prompts) must draw from
MIN_REQUESTS = 6   # paired requests (prompts x rounds) behind any decision


def expanded_tail(units: float, level: float = LEVEL) -> float:
    """The share of bootstrap draws each end of the interval cuts, for `units` prompts drawn:
    Hesterberg's expanded percentile interval (the module doc): the percentiles at
    Phi(-sqrt(n / (n - 1)) t_{n-1}) instead of (1 - level) / 2, which a plain percentile
    bootstrap of a few prompts needs to hold its level (6 prompts: 0.24% instead of 2.5%).
    `units` may be fractional: an effective number (`steps_interval`)."""
    from scipy import stats

    plain = (1 - level) / 2
    if units < 2:
        return plain
    return float(stats.norm.sf(math.sqrt(units / (units - 1)) * stats.t.ppf(1 - plain, units - 1)))


def _effective_units(var_a: float, units_a: int, var_b: float, units_b: int) -> float:
    """Welch-Satterthwaite: the units behind a sum of two independent estimates, each of the
    given variance drawn from its own units (its degrees of freedom units - 1)."""
    if var_a + var_b <= 0:
        return float(max(units_a, units_b))
    parts = sum(v * v / (n - 1) for v, n in ((var_a, units_a), (var_b, units_b)) if n > 1 and v > 0)
    return 1 + (var_a + var_b) ** 2 / parts if parts else float(max(units_a, units_b))


def rotation(labels: list[str], prompts: int, rounds: int) -> list[tuple[int, int, list[str]]]:
    """(round, prompt, the engines in the order asked) for every request of the verdict:
    round by round, prompt by prompt; the order starts at engine (prompt + round) mod n, so
    each prompt meets every engine first once in n rounds, and within a round the first
    place passes from engine to engine as the prompts go."""
    n = len(labels)
    out = []
    for r in range(rounds):
        for i in range(prompts):
            o = (i + r) % n
            out.append((r, i, labels[o:] + labels[:o]))
    return out


def interval(base_s: list[list[float]], other_s: list[list[float]], *, level: float = LEVEL,
             resamples: int = RESAMPLES, seed: int = 0, these_prompts: bool = False) -> dict:
    """The point ratio (other's speed over base's) and its `level` bootstrap interval
    (the module doc): ``{"point", "low", "high", "level", "half_width"}``."""
    prompts = len(base_s)
    _check_times("interval", base_s, other_s)
    rng = random.Random(seed)
    draws = []
    for _ in range(resamples):
        tb = to = 0.0
        for j in range(prompts):
            i = j if these_prompts else rng.randrange(prompts)
            rb, ro, n = base_s[i], other_s[i], len(base_s[i])
            for _ in range(n):
                r = rng.randrange(n)
                tb += rb[r]
                to += ro[r]
        draws.append(tb / to)
    draws.sort()
    lo, hi = _cut(draws, (1 - level) / 2 if these_prompts else expanded_tail(prompts, level))
    point = sum(map(sum, base_s)) / sum(map(sum, other_s))
    rounds = min(len(r) for r in base_s)
    # these prompts alone (their rounds drawn) decide for these prompts only: still not from fewer than
    # MIN_PROMPTS of them (one prompt's rounds say nothing of a verdict)
    enough = prompts * rounds >= MIN_REQUESTS and prompts >= MIN_PROMPTS and (rounds >= MIN_ROUNDS or not these_prompts)
    return {"point": round(point, 4), "low": lo, "high": hi, "level": level,
            "half_width": round((hi - lo) / 2, 4), "prompts": prompts, "rounds": rounds, "enough": enough}


def steps_interval(base_s: list[list[float]], other_s: list[list[float]], base_steps: list[float],
                   other_steps: list[float], *, level: float = LEVEL, resamples: int = RESAMPLES,
                   seed: int = 0) -> dict:
    """The ratio over all the prompts our decoder stepped through, from the timed few (the
    module doc's two-phase estimate): ``base_steps`` / ``other_steps`` are each method's
    verify steps per prompt as our decoder counts them, for every held-out prompt (N); the
    first P of them are the timed ones (``base_s`` / ``other_s``, P prompts x R rounds).

    Point: each method's seconds per step on the timed prompts (their seconds over their
    steps), times its steps over all N prompts; the ratio of those. Interval: the timed
    prompts (and their rounds) drawn as in `interval`, and, independently, the N prompts
    drawn for the step sums. ``{"point", "low", "high", "level", "half_width", "prompts"
    (N), "timed_prompts", "rounds", "effective_prompts", "enough", "cost_share"}``."""
    P, N = len(base_s), len(base_steps)
    _check_times("steps_interval", base_s, other_s)
    if len(other_steps) != N or N < P or min(base_steps + other_steps) <= 0:
        raise ValueError("steps_interval: positive steps for both methods on every prompt, the timed ones first")

    def ratio(tb, to, xb_timed, xo_timed, xb_all, xo_all):
        return (tb / xb_timed * xb_all) / (to / xo_timed * xo_all)

    mb = [sum(r) / len(r) for r in base_s]
    mo = [sum(r) / len(r) for r in other_s]
    point = ratio(sum(mb), sum(mo), sum(base_steps[:P]), sum(other_steps[:P]), sum(base_steps), sum(other_steps))
    rng = random.Random(seed)
    draws, log_cost, log_passes = [], [], []
    for _ in range(resamples):
        tb = to = xb = xo = 0.0
        for _ in range(P):
            i = rng.randrange(P)
            n = len(base_s[i])
            for _ in range(n):
                r = rng.randrange(n)
                tb += base_s[i][r] / n
                to += other_s[i][r] / n
            xb += base_steps[i]
            xo += other_steps[i]
        ab = ao = 0.0
        for _ in range(N):
            j = rng.randrange(N)
            ab += base_steps[j]
            ao += other_steps[j]
        draws.append(ratio(tb, to, xb, xo, ab, ao))
        log_cost.append(math.log((tb / xb) / (to / xo)))
        log_passes.append(math.log(ab / ao))
    draws.sort()
    # the two stages' spreads come from P and from N prompts: the interval widens for the units
    # behind their sum (Welch-Satterthwaite), P's when the cost stage dominates, N's when the passes do
    var_cost, var_passes = statistics.variance(log_cost), statistics.variance(log_passes)
    units = _effective_units(var_cost, P, var_passes, N)
    lo, hi = _cut(draws, expanded_tail(units, level))
    rounds = min(len(r) for r in base_s)
    enough = P >= MIN_PROMPTS and P * rounds >= MIN_REQUESTS
    return {"point": round(point, 4), "low": lo, "high": hi, "level": level,
            "half_width": round((hi - lo) / 2, 4), "prompts": N, "timed_prompts": P, "rounds": rounds,
            "effective_prompts": round(units, 1), "enough": enough,
            # the share of the log ratio's variance the timed prompts' cost per pass carries (the
            # rest: the held-out prompts' passes): which of the two more prompts would narrow
            "cost_share": round(var_cost / (var_cost + var_passes), 3) if var_cost + var_passes > 0 else None}


def _check_times(who: str, base_s: list[list[float]], other_s: list[list[float]]) -> None:
    if not base_s or len(other_s) != len(base_s) or any(len(a) != len(b) or not a for a, b in zip(base_s, other_s)):
        raise ValueError(f"{who}: the same non-empty rounds of the same prompts for both methods")


def _cut(draws: list[float], tail: float) -> tuple[float, float]:
    """The sorted draws' bounds that leave `tail` of them at each end, rounded as printed (the
    half-width is that of the printed bounds)."""
    n = len(draws)
    return round(draws[int(tail * n)], 4), round(draws[min(n - 1, int((1 - tail) * n))], 4)


def decided(iv: dict) -> str:
    """What the interval says at its level: faster, slower, or undecided (it holds 1.0, or it
    was drawn from too few requests to say anything: the module doc)."""
    if iv.get("enough") is False:
        return "undecided"
    return "faster" if iv["low"] > 1 else "slower" if iv["high"] < 1 else "undecided"


def too_few(prompts: int, rounds: int) -> str | None:
    """Why a verdict of ``prompts`` x ``rounds`` requests per engine decides nothing, or None."""
    if prompts >= MIN_PROMPTS and prompts * rounds >= MIN_REQUESTS:
        return None
    return (f"{prompts} prompt(s) x {rounds} round(s) decide nothing: a decision needs >= {MIN_PROMPTS} prompts and "
            f">= {MIN_REQUESTS} paired requests")


def fmt(iv: dict | float | None) -> str:
    """``1.07x [1.03, 1.11]``; a bare ratio (no interval) as ``1.07x``; None as ``-``."""
    if iv is None:
        return "-"
    if isinstance(iv, (int, float)):
        return f"{iv:.2f}x"
    return f"{iv['point']:.2f}x [{iv['low']:.2f}, {iv['high']:.2f}]"

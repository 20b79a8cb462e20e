"""bench/pipeline.py at this checkout and at another commit, side by side: does a change cost
the steps anything? Each side runs the same bench (its own code: a git worktree of the other
commit, imported from there), alternated A B B A so that drift on a shared machine lands on
both; the medians and ratios of each variant are printed, then one JSON line.

    python bench/pipeline_commits.py --against COMMIT [--repeats 2] [--rounds 2] [--steps 40]

Nothing else should run meanwhile (the JSON says the load average before and after)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bad(msg: str) -> None:
    print(f"pipeline_commits: error: {msg}", file=sys.stderr)
    sys.exit(2)


def run_bench(root: Path, rounds: int, steps: int) -> dict:
    p = subprocess.run([sys.executable, str(root / "bench" / "pipeline.py"), "--rounds", str(rounds),
                        "--steps", str(steps)], cwd=root, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONSAFEPATH="1"))
    if p.returncode != 0:
        raise SystemExit(f"bench/pipeline.py in {root} failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", required=True, help="the other commit (e.g. the one before a change)")
    ap.add_argument("--repeats", type=int, default=2, help="A B B A blocks (default 2)")
    ap.add_argument("--rounds", type=int, default=2, help="bench/pipeline.py --rounds for each run")
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    if a.repeats < 1 or a.rounds < 1 or a.steps < 1:
        _bad(f"--repeats {a.repeats}, --rounds {a.rounds}, --steps {a.steps}: expected integers >= 1")
    rev = subprocess.run(["git", "rev-parse", "--verify", f"{a.against}^{{commit}}"], cwd=ROOT,
                         capture_output=True, text=True)
    if rev.returncode != 0:
        _bad(f"--against {a.against!r}: not a commit of this repository")
    here = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        wt = Path(tmp) / "other"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(wt), rev.stdout.strip()], cwd=ROOT,
                       check=True)
        try:
            runs: dict[str, list[dict]] = {"this": [], "other": []}
            for _ in range(a.repeats):
                for side in ("this", "other", "other", "this"):
                    runs[side].append(run_bench(ROOT if side == "this" else wt, a.rounds, a.steps))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=ROOT, check=False)
    variants = list(runs["this"][0]["median_tokens_per_s"])
    med = {side: {v: statistics.median(r["median_tokens_per_s"][v] for r in rs) for v in variants}
           for side, rs in runs.items()}
    print(f"{'variant':34s} {'this tok/s':>11s} {'other tok/s':>12s} {'this/other':>11s}")
    for v in variants:
        print(f"{v:34s} {med['this'][v]:11.1f} {med['other'][v]:12.1f} {med['this'][v] / med['other'][v]:11.3f}")
    print(json.dumps({"bench": "pipeline_commits", "this": here, "other": rev.stdout.strip(),
                      "repeats": a.repeats, "rounds": a.rounds, "steps": a.steps,
                      "median_tokens_per_s": med,
                      "this_over_other": {v: round(med["this"][v] / med["other"][v], 4) for v in variants},
                      "loadavg_before_after": [round(load0[0], 2), round(os.getloadavg()[0], 2)]}))


if __name__ == "__main__":
    main()

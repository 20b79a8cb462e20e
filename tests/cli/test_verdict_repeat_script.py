"""bench/verdict_repeat.py --recorded: a run's own verdict read back, no engine: each drafter
ratio's interval over prompts and rounds and over these prompts' rounds alone, and how many
prompts a half-width of 0.05 would need (issue 55)."""
import json
import math
import subprocess
import sys

from helpers import ROOT

# make demo's verdict, 2026-12-06 (runs/demo/summary.json): seconds per prompt and round
NONE = [[6.2914, 6.1758], [4.9177, 4.8669], [6.1983, 6.1592], [0.9924, 0.9629], [6.108, 6.0137], [6.221, 6.0599]]
NGRAM = [[5.4809, 5.2982], [3.7433, 3.4666], [4.8735, 4.6336], [0.9982, 0.9704], [3.0525, 2.9797], [4.7579, 4.5533]]
DRAFTER = [[5.7525, 5.5612], [3.7463, 3.546], [5.9379, 5.7591], [0.548, 0.5237], [6.2253, 6.0427], [6.0526, 5.6979]]


def run(*args):
    return subprocess.run([sys.executable, str(ROOT / "bench" / "verdict_repeat.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_recorded_intervals_both_ways_and_the_prompts_the_goal_needs(tmp_path):
    methods = {"none": NONE, "ngram": NGRAM, "export": DRAFTER}
    (tmp_path / "summary.json").write_text(json.dumps(
        {"engine": {"methods": {k: {"per_request_s": v} for k, v in methods.items()}}}))
    (tmp_path / "export").mkdir()
    p = run("--run", tmp_path, "--recorded")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert (r["prompts"], r["rounds"], r["engines"]) == (6, 2, 3)
    for base in ("none", "ngram"):
        x = r["ratios"][f"export vs {base}"]
        lo, hi = x["prompts_and_rounds"]
        flo, fhi = x["these_prompts"]
        assert lo < flo <= x["point"] <= fhi < hi, x  # the machine's jitter is inside the prompts' spread
        assert x["half_width_these_prompts"] < 0.05 < x["half_width"], x
        assert x["prompts_for_goal"] == math.ceil(6 * (x["half_width"] / 0.05) ** 2) > 6
    assert "needs ~" in p.stdout


def test_a_run_without_a_verdict_is_one_line(tmp_path):
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "export").mkdir()
    p = run("--run", tmp_path, "--recorded")
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "engine verdict" in p.stderr, p.stderr

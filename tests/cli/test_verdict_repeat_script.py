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
        # the width falls as one over the root of the prompts, the expanded percentiles' widening eases too:
        # fewer than the plain square law says, more than 6
        assert 6 < x["prompts_for_goal"] <= math.ceil(6 * (x["half_width"] / 0.05) ** 2)
    assert "needs ~" in p.stdout


def test_a_run_without_a_verdict_is_one_line(tmp_path):
    (tmp_path / "export").mkdir()
    for summary in ({}, {"engine": None}, {"engine": {"error": "vLLM (none) exited with 1"}}):  # none, or it failed
        (tmp_path / "summary.json").write_text(json.dumps(summary))
        p = run("--run", tmp_path, "--recorded")
        assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "engine verdict" in p.stderr, p.stderr


def test_verdict_design_prices_shorter_replies_from_a_runs_decoded_steps(tmp_path):
    """bench/verdict_design.py: each prompt cut to L tokens and priced per method from its
    decoded steps and the verdict's step costs; more prompts fit at shorter L."""
    steps = [{"prompt_ids": [1, 2, 3, 1, 2], "output_ids": [3, 1, 2, 3, 1, 2, 3, 1], "acceptance_lengths": [2, 2, 2, 2]},
             {"prompt_ids": [5, 6], "output_ids": [7, 8, 9, 10, 11, 12, 13, 14], "acceptance_lengths": [1] * 8},
             {"prompt_ids": [4, 4], "output_ids": [4] * 8, "acceptance_lengths": [4, 4]}]
    costs = {"none": 0.05, "ngram": 0.055, "drafter": 0.06}
    (tmp_path / "summary.json").write_text(json.dumps({
        "eval_after": {"per_prompt_steps": steps, "block_size": 4},
        "engine": {"methods": {k: {"cost_per_step_ms": {"step": v * 1e3}} for k, v in costs.items()}}}))
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "verdict_design.py"), "--run", str(tmp_path),
                        "--lengths", "4,8", "--budget-s", "10"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout.strip().splitlines()[-1])["rows"]
    assert [r["tokens"] for r in rows] == [4, 8] and rows[0]["prompts_in_budget"] > rows[1]["prompts_in_budget"]
    # 8 tokens: none 8 steps each; the drafter 4, 8 and 2 steps: (3 x (0.1 + 0.4)) / (0.1 x 3 + 14 x 0.06)
    assert rows[1]["vs_none"]["ratio"] == round(1.5 / (0.3 + 14 * 0.06), 3), rows[1]
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "verdict_design.py"), "--run", str(tmp_path),
                          "--lengths", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--lengths 0" in bad.stderr, bad.stderr


def test_recorded_over_every_held_out_prompt_when_the_eval_held_out_more(tmp_path):
    """The eval decoded 16 prompts, the verdict timed the first 6: the ratio also comes over all
    16 (time per forward pass on the 6, our count of passes on each), and where the prompts'
    spread sets the width it is narrower than the 6 prompts' own interval."""
    import random

    from dflash.engine.verdict import our_steps

    rng = random.Random(5)
    held = []
    for _ in range(16):
        out = [rng.randrange(50) for _ in range(40)]
        lengths, left = [], 39
        while left > 0:                                     # a drafter that keeps 1-4 tokens a step
            a = min(left, rng.choice([1, 1, 2, 4]))
            lengths.append(a)
            left -= a
        held.append({"prompt_ids": out[:8], "output_ids": out, "acceptance_lengths": lengths})
    cost = {"none": 0.040, "ngram": 0.042, "export": 0.046}  # s per forward pass
    passes = {"none": our_steps(held, "none"), "ngram": our_steps(held, "ngram", 3),
              "export": our_steps(held, "drafter", 3, 4)}
    methods = {k: {"per_request_s": [[passes[k][i] * c * (1 + rng.uniform(-0.01, 0.01)) for _ in range(2)]
                                     for i in range(6)], **({"k": 3} if k != "none" else {})}
               for k, c in cost.items()}
    (tmp_path / "summary.json").write_text(json.dumps(
        {"engine": {"methods": methods, "temperature": 0.0, "ngram": {"num_speculative_tokens": 3}},
         "eval_after": {"block_size": 4, "per_prompt_steps": held}}))
    (tmp_path / "export").mkdir()
    p = run("--run", tmp_path, "--recorded")
    assert p.returncode == 0, p.stderr
    x = json.loads(p.stdout.strip().splitlines()[-1])["ratios"]["export vs none"]
    truth = sum(passes["none"]) * cost["none"] / (sum(passes["export"]) * cost["export"])
    h = x["held_out"]
    assert h["prompts"] == 16 and abs(h["point"] - truth) < 0.01 * truth, (h, truth)
    assert h["interval"][0] <= truth <= h["interval"][1]
    assert h["half_width"] < x["half_width"], x
    assert "over all 16 held-out prompts" in p.stdout


def test_prompts_for_the_goal_from_any_number_of_prompts():
    """One or two timed prompts (a smoke test's verdict) give a guide, not a traceback; more
    prompts than the square-root law says are never asked for, and a width already within the
    goal asks for none more."""
    sys.path.insert(0, str(ROOT / "bench"))
    from verdict_repeat import GOAL, prompts_for

    for prompts in (1, 2, 3, 6, 16):
        need = prompts_for(0.2, prompts)
        assert max(prompts, 2) <= need <= math.ceil(max(prompts, 2) * (0.2 / GOAL) ** 2), (prompts, need)
    assert prompts_for(GOAL / 2, 6) == 6


def test_a_recorded_verdict_that_cannot_be_read_back_is_one_line(tmp_path):
    """Hand-made or damaged summaries: one line naming what is wrong, exit 2, no traceback; one
    timed prompt decides nothing and gives no guide."""
    (tmp_path / "export").mkdir()
    ok = {"none": NONE, "export": DRAFTER}
    bad = [
        "[1]", "{not json",
        json.dumps({"engine": {"methods": {"none": {"per_request_s": []}, "export": {"per_request_s": []}}}}),
        json.dumps({"engine": {"methods": {"none": {"per_request_s": NONE},
                                           "export": {"per_request_s": [[0.0, 1.0]] * 6}}}}),
        json.dumps({"engine": {"methods": {"none": {"per_request_s": NONE},
                                           "export": {"per_request_s": [[float("nan"), 1.0]] * 6}}}}),
        json.dumps({"engine": {"methods": {"none": {"per_request_s": NONE}, "export": {"per_request_s": DRAFTER[:3]}}}}),
        json.dumps({"engine": {"methods": {"export": {"per_request_s": DRAFTER}}}}),
        json.dumps({"engine": {"methods": {k: {"per_request_s": v, "k": 3} for k, v in ok.items()}, "temperature": 0},
                    "eval_after": {"per_prompt_steps": [{}] * 8}}),  # held-out counts without block_size
    ]
    for text in bad:
        (tmp_path / "summary.json").write_text(text)
        p = run("--run", tmp_path, "--recorded")
        assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "Traceback" not in p.stderr, (text, p.stderr)
    one = {"none": [[1.0, 1.1]], "export": [[0.9, 0.95]]}
    (tmp_path / "summary.json").write_text(json.dumps({"engine": {"methods": {k: {"per_request_s": v}
                                                                                  for k, v in one.items()}}}))
    p = run("--run", tmp_path, "--recorded")
    assert p.returncode == 0 and "too few requests" in p.stdout, p.stdout


def test_verdict_design_refuses_what_it_cannot_price_in_one_line(tmp_path):
    good = {"prompt_ids": [1, 2], "output_ids": [3, 4, 5, 6], "acceptance_lengths": [2, 2]}
    costs = {"none": 50.0, "ngram": 55.0, "drafter": 60.0}

    def summary(steps=(good,) * 3, block=4, step_ms=costs):
        return {"eval_after": {"per_prompt_steps": list(steps), "block_size": block},
                "engine": {"methods": {k: {"cost_per_step_ms": {"step": v}} for k, v in step_ms.items()}}}
    for s, lengths in ((summary(block=0), "4"), (summary(step_ms=costs | {"drafter": "x"}), "4"),
                       (summary(step_ms=costs | {"none": -5.0}), "4"),
                       (summary(steps=[good | {"acceptance_lengths": []}] * 3), "4"), (summary(), "100000000"),
                       ({"eval_after": [], "engine": {}}, "4")):
        (tmp_path / "summary.json").write_text(json.dumps(s))
        p = subprocess.run([sys.executable, str(ROOT / "bench" / "verdict_design.py"), "--run", str(tmp_path),
                            "--lengths", lengths], capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, (s, p.stderr)
    (tmp_path / "summary.json").write_text(json.dumps(summary()))
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "verdict_design.py"), "--run", str(tmp_path),
                        "--lengths", "4", "--budget-s", "1e-9"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "too few to decide anything" in p.stdout, p.stdout


def test_turns_arguments_are_one_line_and_exit_2_before_any_engine(tmp_path):
    """bench/verdict_turns.py and verdict_repeat.py --turn-ms: bad turn lengths are refused in
    one line before any engine starts; verdict_turns' arithmetic on recorded seconds."""
    (tmp_path / "summary.json").write_text(json.dumps({"engine": {"methods": {}}}))
    (tmp_path / "export").mkdir()
    turns = ROOT / "bench" / "verdict_turns.py"
    for bad, why in ((["--turn-ms", "0"], "--turn-ms='0'"), (["--turn-ms", "20,20"], "--turn-ms='20,20'"),
                     (["--turn-ms", "abc"], "--turn-ms='abc'"), (["--rounds", "0"], "--rounds=0")):
        p = subprocess.run([sys.executable, str(turns), "--run", str(tmp_path), *bad], capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and why in p.stderr, (bad, p.stderr)
    p = subprocess.run([sys.executable, str(turns), "--run", str(tmp_path / "nowhere")], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "--run=" in p.stderr, p.stderr
    for bad in ("-5", "1,1", "x"):
        p = run("--run", tmp_path, "--turn-ms", bad)
        assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "--turn-ms" in p.stderr, (bad, p.stderr)
    p = run("--run", tmp_path, "--recorded", "--turn-ms", "50")
    assert p.returncode == 2 and "--turn-ms" in p.stderr, p.stderr


def test_turns_analysis_prices_each_way_against_whole_requests():
    sys.path.insert(0, str(ROOT / "bench"))
    from verdict_turns import analyse

    whole = {"none": NONE, "ngram": NGRAM, "drafter": DRAFTER}
    slower = {k: [[x * 1.1 for x in r] for r in v] for k, v in whole.items()}  # 10% a request, every engine
    res = analyse({"0": whole, "50": slower}, [96] * 6)
    assert res["0"]["over_whole"] == {"none": 1.0, "ngram": 1.0, "drafter": 1.0}
    assert all(abs(v - 1.1) < 1e-3 for v in res["50"]["over_whole"].values())
    for name, x in res["50"]["ratios"].items():  # the same slowdown on every engine: the same ratios
        assert abs(x["point"] - res["0"]["ratios"][name]["point"]) < 1e-3, name
        assert x["interval"][0] <= x["point"] <= x["interval"][1]

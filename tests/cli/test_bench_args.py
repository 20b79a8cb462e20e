"""The bench scripts are user-facing too: bad arguments are one line and exit 2, before any
arm trains, any model loads or any command runs (issue 54's fifth pass, and the pass after)."""
import subprocess
import sys

import pytest

from helpers import ROOT


def bench(script, *args):
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script, args, needle", [
    ("architectures.py", ["--seeds", "garbage"], "--seeds 'garbage'"),
    ("architectures.py", ["--arms", ","], "--arms ','"),
    ("architectures.py", ["--decode", "--mt-bench", "-5"], "--mt-bench -5"),
    ("architectures.py", ["--decode", "--mt-bench", "81"], "--mt-bench 81"),
    ("architectures.py", ["--time-steps", "-3"], "--time-steps -3"),
    ("architectures.py", ["--out", "/etc/hostname"], "not a directory"),
    ("architectures.py", ["--arms", "nope"], "--arms nope"),
    ("confidence_gate.py", ["x", "--thresholds", "abc"], "--thresholds 'abc'"),
    ("confidence_gate.py", ["x", "--thresholds", "5,nan"], "--thresholds '5,nan'"),
    ("confidence_gate.py", ["x", "--prompts", "-1"], "--prompts -1"),
    ("confidence_gate.py", ["/nonexistent-dir"], "no config.json there"),
    ("trace_coverage.py", ["--telemetry", "/etc/hostname", "--", "true"], "not a directory"),
    ("trace_coverage.py", ["--telemetry", "/tmp/x", "--", "/nonexistent-program"], "cannot run"),
    ("verdict_design.py", ["--budget-s", "inf"], "a budget > 0"),
    ("verdict_coverage.py", ["--sims", "0"], "--sims=0"),
    ("verdict_coverage.py", ["--regimes", "quiet,nope"], "--regimes='quiet,nope'"),
    ("otel/slow_collector.py", ["--delay", "-1"], "--delay=-1.0"),
    ("otel/slow_collector.py", ["--rate", "nan"], "--rate=nan"),
])
def test_bad_bench_arguments_are_one_line(script, args, needle):
    p = bench(script, *args)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and needle in p.stderr, p.stderr


def test_trace_coverage_counts_none_of_an_earlier_runs_spans(tmp_path):
    """A telemetry dir holding an earlier run's trace: the command timed now left none there."""
    import json

    tel = tmp_path / "telemetry"
    tel.mkdir()
    span = {"traceId": "a" * 32, "spanId": "b" * 16, "name": "train", "startTimeUnixNano": "1",
            "endTimeUnixNano": "2", "attributes": [{"key": "otel.kind", "value": {"stringValue": "run"}}]}
    (tel / "traces.jsonl").write_text(json.dumps({"resourceSpans": [{"resource": {"attributes": []},
                                                  "scopeSpans": [{"spans": [span]}]}]}) + "\n")
    from otel import read_spans
    assert [s["name"] for s in read_spans(str(tel))] == ["train"]  # the earlier run's span is there
    p = bench("trace_coverage.py", "--telemetry", tel, "--", "true")
    assert p.returncode == 1 and "no run span of this command" in p.stderr, p.stderr

"""`dflash stalls` and `dflash timeline` on hand-made telemetry: what a window covers (the
typical step and the balance too), which waits are stalls, a file holding several runs, a
traces.jsonl that is no regular file, numbers that are not numbers, and the JSON they print."""
import json
import math
import os

import pytest

from dflash.analysis.stalls import analyze, format_report, load_run, parse_window, select_run
from dflash.analysis.timeline import write_perfetto
from dflash.errors import ConfigError
from helpers import run_dflash

S = 1_000_000_000


def span(name, sid, t0, t1, *, parent="p", run="r", **attrs):
    return {"name": name, "trace_id": f"{sid:0>32}", "span_id": sid, "parent_span_id": parent,
            "start_ns": int(t0 * S), "end_ns": int(t1 * S), "attributes": attrs, "events": [], "links": [],
            "status": {}, "resource": {"rank": 0, "run.id": run}}


def steps(n=10, slow_from=5):
    """Batches 0..n-1, one a second: a forward then a backward; from ``slow_from`` on the forward
    takes 0.6 s instead of 0.1. A checkpoint writer saves once, at 9.5 s."""
    out = [span("dflash train", "root", 0, n + 1, parent="")]
    for b in range(n):
        f = 0.6 if b >= slow_from else 0.1
        out += [span("model_forward", f"f{b}", b, b + f, worker="target0", batch_id=b),
                span("backward", f"b{b}", b + f, b + f + 0.2, worker="drafter0", batch_id=b)]
    out.append(span("checkpoint_write", "ck", 9.5, 9.6, worker="checkpoint_writer"))
    for s in out:  # a batch's spans share its trace
        if "batch_id" in s["attributes"]:
            s["trace_id"] = f"{s['attributes']['batch_id']:0>32}"
    return out


def test_a_window_covers_the_typical_step_and_the_balance():
    fast, slow = analyze(steps(), window=(0, 4.5)), analyze(steps(), window=(5, math.inf))
    assert fast["critical_path"]["batch_id"] < 5 <= slow["critical_path"]["batch_id"]
    assert fast["critical_path"]["duration_s"] == pytest.approx(0.3)
    assert slow["critical_path"]["duration_s"] == pytest.approx(0.8)
    assert fast["balance"]["target_s_per_batch"] == pytest.approx(0.1)
    assert slow["balance"]["target_s_per_batch"] == pytest.approx(0.6)
    assert analyze(steps())["balance"]["target_s_per_batch"] == pytest.approx(0.35)  # the whole run: both halves
    # a window that starts inside batch 5 (forward 5.0-5.6, backward 5.6-5.8) leaves it out whole
    cut = analyze(steps(), window=(5.3, math.inf))
    assert cut["critical_path"]["batch_id"] > 5 and cut["critical_path"]["duration_s"] == pytest.approx(0.8)


def test_the_checkpoint_writers_wait_is_no_stall_and_long_names_keep_their_gap():
    rep = analyze(steps())
    assert rep["top_stalls"] and all(s["worker"] != "checkpoint_writer" for s in rep["top_stalls"])
    assert any(w["worker"] == "checkpoint_writer" for w in rep["workers"])  # still reported
    line = next(x for x in format_report(rep).splitlines() if "rank0/checkpoint_writer" in x)
    assert "rank0/checkpoint_writer " in line


def test_an_open_window_prints_strict_json():
    rep = analyze(steps(), window=parse_window("1:"))
    assert rep["window_s"] == [1.0, None]
    json.dumps(rep, allow_nan=False)  # what `stalls --json` prints: no Infinity
    assert ", window 1:s" in format_report(rep).splitlines()[0]


@pytest.mark.parametrize("text", ["nan:1", "0:nan", "inf:", "0:inf", "0:1e300", "-inf:2"])
def test_windows_that_are_not_seconds_are_one_line(text):
    with pytest.raises(ConfigError, match="--window"):
        parse_window(text)


def test_several_runs_in_one_source_are_named(capsys):
    export = [span("dflash export", "x", 20, 21, parent="", run="exp")]
    rid, got = select_run(steps() + export)
    err = capsys.readouterr().err
    assert rid == "exp" and "2 runs in this source" in err and "r (dflash train)" in err and "--run-id" in err
    assert select_run(steps(), "r")[0] == "r" and capsys.readouterr().err == ""


def test_a_traces_file_that_is_no_regular_file_is_skipped(tmp_path, capsys):
    (tmp_path / "telemetry" / "traces.jsonl").mkdir(parents=True)
    os.mkfifo(tmp_path / "telemetry" / "rank1_traces")
    (tmp_path / "telemetry" / "rank2").mkdir()
    os.mkfifo(tmp_path / "telemetry" / "rank2" / "traces.jsonl")  # reading it would wait forever
    with pytest.raises(ConfigError, match="no telemetry"):
        load_run(tmp_path)
    assert capsys.readouterr().err.count("not a regular file, skipped") == 2


def test_perfetto_writes_a_bytes_attribute(tmp_path):
    sp = steps(2)
    sp[1]["attributes"]["blob"] = b"\x01\xff"  # bytes from a caller's dicts (the file reader gives a bytesValue as its base64 text)
    write_perfetto(sp, tmp_path / "t.json")
    ev = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert any(e.get("args", {}).get("blob") == "01ff" for e in ev)


def _otlp_line(spans) -> str:
    def kv(d):
        return [{"key": k, "value": {"intValue": str(v)} if isinstance(v, int) else {"stringValue": str(v)}}
                for k, v in d.items()]
    return json.dumps({"resourceSpans": [{"resource": {"attributes": kv(spans[0]["resource"])}, "scopeSpans": [
        {"scope": {"name": "t"}, "spans": [
            {"traceId": s["trace_id"], "spanId": f"{s['span_id']:0>16}", "parentSpanId": s["parent_span_id"],
             "name": s["name"], "startTimeUnixNano": str(s["start_ns"]), "endTimeUnixNano": str(s["end_ns"]),
             "attributes": kv(s["attributes"])} for s in spans]}]}]})


def test_timeline_of_a_run_without_steps_or_past_its_end_and_bad_lookbacks_are_one_line(tmp_path):
    startup_only = tmp_path / "startup"
    (startup_only / "telemetry").mkdir(parents=True)
    (startup_only / "telemetry" / "traces.jsonl").write_text(_otlp_line(
        [span("dflash capture", "root", 0, 5, parent=""), span("load_target", "l", 0, 4, parent="root",
                                                                 **{"otel.kind": "phase"})]) + "\n")
    stepped = tmp_path / "stepped"
    (stepped / "telemetry").mkdir(parents=True)
    (stepped / "telemetry" / "traces.jsonl").write_text(_otlp_line(steps()) + "\n")
    for args, want in (((startup_only, "--png", tmp_path / "a.png"), "no training step in run r"),
                       ((stepped, "--png", tmp_path / "b.png", "--window", "1000:"), "starts after the run's last"),
                       ((stepped, "--perfetto", tmp_path / "c.json", "--window", "1000:"), "starts after")):
        p = run_dflash("timeline", *args, check=False)
        assert p.returncode == 2 and want in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    for bad in ("nan", "inf", "1e300"):
        p = run_dflash("stalls", "--jaeger", "http://127.0.0.1:9", "--lookback", bad, check=False)
        assert p.returncode == 2 and "--lookback" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not list(tmp_path.glob("*.png")) and not list(tmp_path.glob("*.json"))

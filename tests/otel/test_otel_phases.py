"""The run's own trace (otel/producer/phases.py): a root span for the command, its phases
as children, nested by thread, recorded after the fact, marked by errors and signals,
handed to children as a W3C traceparent, live as gauges, and kept apart from the stages
(no stage histogram, no idle attribution)."""
from __future__ import annotations

import threading
import time

import pytest
from otel_test_helpers import MODES

import otel
from otel.producer.phases import KIND_ATTRIBUTE, format_traceparent, parse_traceparent
from otel.trace_ids import root_span_id_for, trace_id_for


@pytest.fixture(autouse=True)
def no_traceparent(monkeypatch):
    monkeypatch.delenv("TRACEPARENT", raising=False)


def _by_name(spans):
    return {s["name"]: s for s in spans}


@pytest.mark.parametrize("mode", MODES)
def test_phases_nest_under_the_run_root_and_worker_threads_land_in_the_open_phase(tmp_path, mode, make_tel):
    tel = make_tel(mode=mode, file_dir=str(tmp_path), run_id="run-P", run_span="dflash train",
                   run_attributes={"dflash.command": "train"})
    t0 = time.perf_counter_ns()
    tel.record_phase("check inputs", t0 - 2_000_000, t0 - 1_000_000, checked=3)
    with tel.phase("prepare data", records=10) as prep:
        with tel.phase("regenerate") as regen:
            regen.progress(1, 4)
            seen = {}

            def worker():  # a thread of its own: its phase lands in the phase open on the main thread
                with tel.phase("regen batch", replies=2) as b:
                    seen["tp"] = b.traceparent
            th = threading.Thread(target=worker)
            th.start()
            th.join()
            regen.progress(4)
        prep.set(kept=8, dropped=2)
    with tel.stage("model_forward", trace=("batch", 0), worker="t0"):
        pass
    tel.end_run()
    tel.shutdown()
    spans = otel.read_spans(str(tmp_path))
    by = _by_name(spans)
    root = by["dflash train"]
    assert root["trace_id"] == f"{trace_id_for('run-P', 'run', 0):032x}"
    assert root["span_id"] == f"{root_span_id_for('run-P', 'run', 0):016x}" and root["parent_span_id"] == ""
    assert root["attributes"][KIND_ATTRIBUTE] == "run" and root["attributes"]["dflash.command"] == "train"
    for name, parent in (("check inputs", "dflash train"), ("prepare data", "dflash train"),
                         ("regenerate", "prepare data"), ("regen batch", "regenerate")):
        assert by[name]["trace_id"] == root["trace_id"], name
        assert by[name]["parent_span_id"] == by[parent]["span_id"], name
        assert by[name]["attributes"][KIND_ATTRIBUTE] == "phase"
        assert root["start_ns"] <= by[name]["start_ns"] <= by[name]["end_ns"] <= root["end_ns"], name
    assert by["prepare data"]["attributes"]["kept"] == 8
    assert by["regenerate"]["attributes"]["progress.done"] == 4
    assert by["regenerate"]["attributes"]["progress.total"] == 4
    assert seen["tp"] == format_traceparent(int(root["trace_id"], 16), int(by["regen batch"]["span_id"], 16))
    # the batch trace is untouched: its own trace, its own root
    assert by["model_forward"]["trace_id"] != root["trace_id"]
    # phases are no stages: not in the stage histogram, not in the profile
    points = otel.read_metrics(str(tmp_path))
    stages = {p["attributes"].get("stage") for p in points if p["name"] == "dflash.stage.duration"}
    assert stages == {"model_forward"}
    assert set(tel.summary()["stages"]) == {"model_forward"}
    rows = {r["phase"]: r for r in tel.summary()["run"]["phases"]}
    assert rows["regenerate"]["depth"] == 2 and rows["check inputs"]["depth"] == 1
    assert "prepare data" in tel.phase_table()


def test_a_handed_down_traceparent_parents_the_root_and_a_rank_hangs_its_process_span_under_it(
        tmp_path, monkeypatch, make_tel):
    parent_trace, parent_span = 0xABC << 64 | 0x123, 0xDEF
    monkeypatch.setenv("TRACEPARENT", format_traceparent(parent_trace, parent_span))
    lead = make_tel(mode="thread", file_dir=str(tmp_path / "r0"), run_id="run-T", run_span="dflash train",
                    process_span="dflash train rank 0")
    other = make_tel(mode="thread", file_dir=str(tmp_path / "r1"), run_id="run-T", run_span="dflash train",
                     run_root=False, process_span="dflash train rank 1")
    for tel in (lead, other):
        with tel.phase("join ranks"):
            pass
        tel.shutdown()
    s0, s1 = _by_name(otel.read_spans(str(tmp_path / "r0"))), _by_name(otel.read_spans(str(tmp_path / "r1")))
    root = s0["dflash train"]
    assert root["trace_id"] == f"{parent_trace:032x}" and root["parent_span_id"] == f"{parent_span:016x}"
    assert "dflash train" not in s1  # one root per run
    for s, rank in ((s0, 0), (s1, 1)):
        proc = s[f"dflash train rank {rank}"]
        assert proc["parent_span_id"] == root["span_id"] and proc["trace_id"] == root["trace_id"]
        assert s["join ranks"]["parent_span_id"] == proc["span_id"]


def test_a_failing_phase_and_an_unfinished_one_are_marked_and_kept(tmp_path, make_tel):
    tel = make_tel(mode="process", file_dir=str(tmp_path), run_id="run-E", run_span="dflash capture")
    with pytest.raises(ValueError):
        with tel.phase("load target"):
            raise ValueError("no such model")
    outer = tel.phase("regenerate")
    outer.__enter__()  # a signal arrives: the run ends with the phase open
    tel.end_run(KeyboardInterrupt("SIGTERM"))
    tel.shutdown()
    by = _by_name(otel.read_spans(str(tmp_path)))
    assert by["load target"]["status"].get("code") == 2
    ev = by["load target"]["events"][0]
    assert ev["name"] == "exception" and ev["attributes"]["exception.message"] == "no such model"
    assert by["regenerate"]["status"].get("code") == 2
    assert by["regenerate"]["events"][0]["attributes"]["exception.message"] == "SIGTERM"
    assert by["dflash capture"]["status"].get("code") == 2
    assert by["regenerate"]["end_ns"] <= by["dflash capture"]["end_ns"]


def test_open_phases_are_live_gauges(tmp_path, make_tel):
    tel = make_tel(mode="process", file_dir=str(tmp_path), run_id="run-G", run_span="dflash train")
    with tel.phase("regenerate") as ph:
        ph.progress(3, 12)
        deadline = time.monotonic() + 60
        while True:  # until an export carries both gauges (condition, not a sleep)
            tel.flush(timeout_s=5.0)
            pts = [p for p in otel.read_metrics(str(tmp_path)) if p["name"].startswith("dflash.run.phase.")]
            names = {p["name"] for p in pts}
            if {"dflash.run.phase.elapsed", "dflash.run.phase.progress"} <= names:
                break
            assert time.monotonic() < deadline, names
            time.sleep(0.1)
    tel.shutdown()
    prog = [p for p in pts if p["name"] == "dflash.run.phase.progress"]
    assert prog[-1]["value"] == pytest.approx(0.25) and prog[-1]["attributes"] == {"phase": "regenerate"}
    el = [p for p in pts if p["name"] == "dflash.run.phase.elapsed"]
    assert el[-1]["unit"] == "s" and el[-1]["value"] >= 0


def test_a_pipeline_that_never_uses_phases_gets_no_run_span(tmp_path, make_tel):
    tel = make_tel(mode="thread", file_dir=str(tmp_path), run_id="run-N")
    with tel.stage("model_forward", worker="t0"):
        pass
    tel.shutdown()
    assert [s["name"] for s in otel.read_spans(str(tmp_path))] == ["model_forward"]


def test_traceparent_parsing():
    assert parse_traceparent("00-" + "a" * 32 + "-" + "b" * 16 + "-01") == (int("a" * 32, 16), int("b" * 16, 16))
    # a later version: its first four fields (W3C), whatever follows
    assert parse_traceparent("01-" + "a" * 32 + "-" + "b" * 16 + "-01-what-comes") == (int("a" * 32, 16),
                                                                                       int("b" * 16, 16))
    assert parse_traceparent("ff-" + "a" * 32 + "-" + "b" * 16 + "-01") is None
    assert parse_traceparent("00-" + "a" * 32 + "-" + "b" * 16 + "-01-extra") is None
    for bad in (None, "", "00-" + "0" * 32 + "-" + "b" * 16 + "-01", "zz-1-2-3", "00-abc-def-01"):
        assert parse_traceparent(bad) is None


def test_disabled_phases_name_exceptions_and_pass_the_context_through(monkeypatch):
    tel = otel.Telemetry.disabled()
    monkeypatch.setenv("TRACEPARENT", "00-" + "a" * 32 + "-" + "b" * 16 + "-01")
    with pytest.raises(RuntimeError) as e:
        with tel.phase("load target") as ph:
            ph.progress(1, 2)
            raise RuntimeError("x")
    assert e.value.otel_stage == "load target"
    assert tel.traceparent() == ph.traceparent == "00-" + "a" * 32 + "-" + "b" * 16 + "-01"


def test_overlapping_repeats_of_a_phase_count_their_wall_once():
    """Engines started side by side: three 1 s starts over the same second are 1 s of the wall,
    not 3 (a share above 100%); one after another they add up."""
    from otel.producer.phases import RunTrace

    t = RunTrace("r", "dflash eval", start_ns=0)
    s = 1_000_000_000
    for i in range(3):
        t.record("engine_start", 0, s)
    for i in range(2):
        t.record("regen_batch", (2 + i) * s, (3 + i) * s)
    rows = {r["phase"]: r for r in t.rows()}
    assert (rows["engine_start"]["count"], rows["engine_start"]["seconds"]) == (3, 1.0)
    assert (rows["regen_batch"]["count"], rows["regen_batch"]["seconds"]) == (2, 2.0)


def test_phases_of_one_name_open_at_once_are_one_gauge_point_the_oldest():
    """Worker threads' batches open side by side: points with the same attributes would
    overwrite each other, so the gauge reports the one open longest (and its progress)."""
    from otel.producer.phases import RunTrace

    t = RunTrace("r", "dflash train", start_ns=time.perf_counter_ns())
    old = t.phase("regen_batch", batch=0)
    old.__enter__()
    old.progress(1, 4)
    time.sleep(0.05)
    new = t.phase("regen_batch", batch=1)
    new.__enter__()
    new.progress(3, 4)
    elapsed, progress = t.observations()
    batches = [(v, a) for v, a in elapsed if a == {"phase": "regen_batch"}]
    assert len(batches) == 1 and batches[0][0] >= 0.05
    assert [v for v, a in progress if a == {"phase": "regen_batch"}] == [0.25]

"""`dflash stalls`' start-up section (dflash/analysis/startup.py) on spans made by hand: the
time before each rank's first step by phase, the longest phase, the rank the others waited
for at the first collective, and a run stopped before its first step."""
from dflash.analysis.startup import format_startup, startup
from dflash.analysis.stalls import analyze, format_report

S = 1_000_000_000


def span(name, kind, sid, parent, t0, t1, rank, **attrs):
    a = {"otel.kind": kind, **attrs} if kind else dict(attrs)
    return {"name": name, "trace_id": "t" * 32, "span_id": sid, "parent_span_id": parent, "start_ns": int(t0 * S),
            "end_ns": int(t1 * S), "attributes": a, "events": [], "links": [], "status": {},
            "resource": {"rank": rank, "run.id": "r"}}


def two_ranks(stage=True):
    out = [span("dflash train", "run", "root", "", 0, 20, 0),
           span("dflash train rank 0", "process", "p0", "root", 0, 20, 0),
           span("dflash train rank 1", "process", "p1", "root", 0.5, 20, 1),
           span("read_data", "phase", "a0", "p0", 0.1, 0.3, 0),
           span("read_data", "phase", "a1", "p1", 0.6, 3.8, 1),
           span("join_ranks", "phase", "j0", "p0", 0.4, 4.0, 0, collective=True),
           span("join_ranks", "phase", "j1", "p1", 3.9, 4.0, 1, collective=True),
           span("load_target", "phase", "l0", "p0", 4.0, 9.0, 0),
           span("load_target", "phase", "l1", "p1", 4.0, 8.0, 1),
           span("regen_batch", "phase", "x0", "l0", 5.0, 8.5, 0)]
    if stage:
        out += [span("model_forward", None, "s0", "b", 10.0, 10.5, 0, worker="target0", batch_id=0),
                span("model_forward", None, "s1", "b", 11.0, 11.5, 1, worker="target0", batch_id=0)]
    return out


def test_startup_by_rank_longest_phase_and_first_collective():
    rep = startup(two_ranks())
    r0, r1 = rep["ranks"]
    assert r0["first_step_s"] == 10.0 and r1["start_s"] == 0.5 and r1["first_step_s"] == 10.5
    assert list(r0["phases"]) == ["load_target", "join_ranks", "read_data"]  # the longest first
    assert abs(r0["phases"]["join_ranks"] - 3.6) < 1e-9 and abs(r0["phases"]["load_target"] - 5.0) < 1e-9
    assert abs(r1["phases"]["read_data"] - 3.2) < 1e-9
    assert rep["longest_phase"]["phase"] == "load_target" and rep["longest_phase"]["rank"] == 0
    fc = rep["first_collective"]
    assert fc["phase"] == "join_ranks" and fc["last_rank"] == 1 and abs(fc["waits_s"][0] - 3.5) < 1e-9
    text = "\n".join(format_startup(rep))
    assert "the ranks waited for rank 1 (the last to arrive): rank 0 3.50s" in text


def test_a_run_stopped_before_its_first_step_reports_its_start_up():
    spans = two_ranks(stage=False)
    spans[-1]["status"] = {"code": 2}
    spans[-1]["events"] = [{"name": "exception", "time_ns": 0,
                            "attributes": {"exception.type": "Interrupted", "exception.message": "SIGTERM"}}]
    rep = analyze(spans, run_id="r", source="test")
    assert rep["workers"] == [] and rep["startup"]["ranks"][0]["first_step_s"] is None
    assert rep["startup"]["failed"] == [{"phase": "regen_batch", "rank": 0, "error": "Interrupted: SIGTERM"}]
    text = format_report(rep)
    assert "failed: regen_batch on rank 0: Interrupted: SIGTERM" in text
    assert "its start-up alone" in text and "idle time by cause" not in text and "top stalls" not in text


def test_spans_without_a_run_trace_have_no_start_up_section():
    assert startup([s for s in two_ranks() if s["attributes"].get("otel.kind") is None]) is None


def test_coverage_is_the_union_of_the_roots_phases_over_the_wall_and_names_the_longest_gap():
    spans = [span("dflash train", "run", "root", "", 0.2, 9.5, 0),
             span("load_target", "phase", "a", "root", 0.2, 3.0, 0),
             span("regen_batch", "phase", "n", "a", 1.0, 2.0, 0),   # nested: not counted twice
             span("prepare_data", "phase", "b", "root", 2.5, 5.0, 0),  # overlaps the one before
             span("train", "phase", "c", "root", 7.0, 9.5, 0)]       # 2 s dark before it
    from dflash.analysis.startup import coverage

    c = coverage(spans, 0, 10 * S)
    assert abs(c["share"] - 0.73) < 1e-9  # 0.2-5.0 and 7.0-9.5 of 0-10
    assert abs(c["longest_gap_s"] - 2.0) < 1e-9 and abs(c["longest_gap_at_s"] - 5.0) < 1e-9
    assert abs(c["root_starts_after_s"] - 0.2) < 1e-9 and abs(c["root_ends_before_s"] - 0.5) < 1e-9
    assert c["phases"] == 3


def test_stalls_reads_a_telemetry_dir_itself(tmp_path):
    """`dflash stalls DIR` where DIR is a --telemetry-dir (eval, serve, export write there): its
    files are found (here empty: "no spans"), not refused as "no telemetry"."""
    import pytest

    from dflash.analysis.stalls import load_run
    from dflash.errors import ConfigError

    tel = tmp_path / "tel"
    (tel / "rank1").mkdir(parents=True)
    (tel / "traces.jsonl").write_text("")
    (tel / "rank1" / "traces.jsonl").write_text("")
    with pytest.raises(ConfigError, match="no spans"):
        load_run(tel)


def test_a_killed_run_without_its_root_and_process_spans_still_has_its_start_up():
    """SIGKILL (the out-of-memory killer): the root and process spans, open till the end, are
    never written; the phases the ranks finished are, and they are the start-up."""
    spans = [s for s in two_ranks() if s["attributes"].get("otel.kind") not in ("run", "process")]
    rep = startup(spans)
    assert rep["root_missing"] and list(rep["ranks"][0]["phases"]) == ["load_target", "join_ranks", "read_data"]
    text = "\n".join(format_startup(rep))
    assert "the run's root span is not in the trace" in text and "load_target 5.00s" in text


def test_a_checkpoint_is_no_first_step():
    """`--steps 0` saves a checkpoint and trains nothing: its save's spans are no step."""
    spans = two_ranks(stage=False) + [span("checkpoint", None, "c0", "b", 9.5, 9.6, 0, worker="drafter0", step=0)]
    assert startup(spans)["ranks"][0]["first_step_s"] is None

"""The profile shows a stage's work (duration minus the wait it recorded) apart from the
wait, so a producer blocked on a full queue does not look like the bottleneck."""
import io
import time

import pytest

import otel
from otel.exporter.profile import Profile
from otel.records import ATTRS, EXTRA, NAME, STAGE_FIELDS, T0, T1
from otel.summary import format_table
from otel.transport import frame, read_frames

MS = 1_000_000


def _rec(name, dur_ms, attrs=None, extra=None, t0=0):
    rec = [None] * STAGE_FIELDS
    rec[NAME], rec[T0], rec[T1] = name, t0, t0 + int(dur_ms * MS)
    rec[ATTRS], rec[EXTRA] = attrs or {}, extra
    return tuple(rec)


def test_work_and_wait_apart():
    p = Profile()
    p.add_records([_rec("enqueue", 10)])                                     # waited 0 before the first wait
    p.add_records([_rec("enqueue", 100, extra={"blocked_s": 0.099}) for _ in range(8)])
    p.add_records([_rec("get", 50, attrs={"wait_s": 0.05}), _rec("forward", 30)])
    s = p.summary(wall_s=1.0)
    enq = s["enqueue"]
    assert enq["count"] == 9 and enq["total_s"] == pytest.approx(0.81)
    assert enq["wait_total_s"] == pytest.approx(0.792) and enq["work_total_s"] == pytest.approx(0.018)
    assert enq["work_p50_s"] == pytest.approx(0.001, rel=0.02) and enq["work_max_s"] == pytest.approx(0.010)
    assert enq["wait_p50_s"] == pytest.approx(0.099, rel=0.02) and enq["wait_max_s"] == pytest.approx(0.099)
    assert enq["work_share"] + enq["wait_share"] == pytest.approx(enq["share"])
    assert s["get"]["work_p50_s"] == 0.0 and s["get"]["wait_share"] == pytest.approx(0.05)
    # a stage that never waited keeps exactly the keys it always had
    assert set(s["forward"]) == {"count", "total_s", "p50_s", "p95_s", "p99_s", "max_s", "share"}

    table = format_table({"wall_s": 1.0, "stages": s}, "t", ("blocked_s", "wait_s"))
    row = next(line for line in table.splitlines() if line.startswith("enqueue")).split()
    # count, work p50 / p95 / max, work share, wait p50, wait share
    assert row[1:] == ["9", "999.5", "us", "999.5", "us", "10.00", "ms", "1.8%", "99.00", "ms", "79.2%"]
    assert "blocked_s, wait_s" in table
    assert "blocked_s, wait_s" in table


def test_wait_attributes_are_configurable(make_tel, tmp_path):
    tel = make_tel(mode="thread", file_dir=str(tmp_path), wait_attributes=("stalled_s",))
    for _ in range(3):
        with tel.stage("put") as st:
            time.sleep(0.004)
            st.set(stalled_s=0.003)
        with tel.stage("get", wait_s=1.0):   # not a wait attribute here
            pass
    tel.flush(timeout_s=5.0)
    st = tel.summary()["stages"]
    assert st["put"]["wait_total_s"] == pytest.approx(0.009)
    assert st["put"]["wait_share"] == pytest.approx(0.009 / tel.summary()["wall_s"], rel=0.05)
    assert "wait_total_s" not in st["get"]
    assert "stalled_s" in tel.profile_table()


def test_the_typed_config_crosses_the_pipe():
    cfg = otel.ExportConfig(service_name="s", run_id="r", epoch_offset_ns=5, start_epoch_s=1.0,
                            idle_rules=otel.IdleRules(stage_causes={"queue_get": "queue_empty"}),
                            gpu_devices=[{"index": 0, "uuid": None, "nvml_index": 0}])
    stream = io.BytesIO(frame({"config": cfg}) + frame({"seq": 1, "spans": []}))
    first, second = list(read_frames(stream))
    assert first["config"] == cfg and first["config"].stage_metric == "s.stage.duration"
    assert second == {"seq": 1, "spans": []}


def test_end_profile_prints_the_table_once_with_the_measured_works_wall(make_tel, tmp_path, capsys):
    """Training, then an eval: the table prints when training ends, its shares of the training's
    wall; shutdown after the eval exports the rest and does not print it again."""
    tel = make_tel(mode="thread", file_dir=str(tmp_path), console=True)
    for _ in range(3):
        with tel.stage("backward"):
            time.sleep(0.01)
    tel.end_profile()
    first = capsys.readouterr().err
    assert first.count("telemetry profile") == 1 and "backward" in first
    wall = tel.summary()["wall_s"]
    time.sleep(0.3)                      # the eval: not the profile's wall
    tel.end_profile()                    # once
    tel.shutdown()
    assert "telemetry profile" not in capsys.readouterr().err
    assert tel.summary()["wall_s"] == wall
    assert tel.summary()["stages"]["backward"]["count"] == 3


def test_end_profile_never_waits_for_the_export(make_tel, tmp_path):
    """A slow or dead collector must not hold the run between training and what follows (time no
    phase covers): end_profile folds the records into the profile and leaves the export to run."""
    for mode in ("thread", "process"):
        tel = make_tel(mode=mode, file_dir=str(tmp_path / mode), console=False)
        real, asked = tel._transport.flush, []
        tel._transport.flush = lambda timeout_s, network=True: asked.append(network) or real(timeout_s, network)
        with tel.stage("backward"):
            pass
        tel.end_profile()
        assert asked == [False], mode  # consumed (the table counts it), not exported
        assert tel.summary()["stages"]["backward"]["count"] == 1, mode
        tel.shutdown()

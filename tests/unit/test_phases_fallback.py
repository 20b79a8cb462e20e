"""A command stopped before its telemetry starts (`train` and `capture` start it after torch's
import): the phases until then are written where the telemetry would have gone, the open one
and the root marked, rather than lost (dflash/phases.py `fallback`)."""
from helpers import NO_OTEL_ENV


def test_phases_before_the_telemetry_reach_the_fallback_dir(tmp_path, monkeypatch):
    import pytest

    from dflash import phases
    from otel import read_spans

    for k, v in NO_OTEL_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    phases.reset()
    try:
        with phases.phase("check_inputs"):
            pass
        phases.fallback("train", str(tmp_path / "telemetry"))
        with pytest.raises(KeyboardInterrupt):
            with phases.phase("import_torch"):
                raise KeyboardInterrupt("SIGTERM")
        phases.finish(KeyboardInterrupt("SIGTERM"))
        spans = {s["name"]: s for s in read_spans(str(tmp_path / "telemetry"))}
        assert {"check_inputs", "import_torch", "dflash train"} <= set(spans), spans.keys()
        assert spans["import_torch"]["status"].get("code") == 2 and spans["dflash train"]["status"].get("code") == 2
        assert spans["check_inputs"]["status"].get("code") != 2
    finally:
        phases.reset()



def test_a_stop_in_the_data_read_before_the_run_dir_is_ours_prints_the_phases(monkeypatch, capsys):
    """No dir yet (the data read comes before OUT is claimed, so bad data never touches an
    earlier run): the phases go to the collector the OTEL_* variables name, else the table on
    stderr, the open phase marked; bad input stays its one line."""
    import pytest

    from dflash import phases
    from dflash.errors import ConfigError

    for k, v in NO_OTEL_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for error, table in ((KeyboardInterrupt("SIGTERM"), True), (ConfigError("bad"), False)):
        phases.reset()
        try:
            phases.fallback("train", None)
            with pytest.raises(type(error)):
                with phases.phase("read_data"):
                    raise error
            phases.finish(error)
            err = capsys.readouterr().err
            assert ("read_data" in err and "(failed)" in err) == table, err
        finally:
            phases.reset()


def test_the_phase_a_signal_ended_is_the_one_named():
    """"interrupted during set-up" was printed for a signal in the final checkpoint or the export:
    the message now names the main thread's innermost phase, open or just ended by the signal."""
    from dflash import phases

    phases.reset()
    assert phases.innermost() is None
    with phases.phase("train"):
        with phases.phase("checkpoint"):
            assert phases.innermost() == "checkpoint"
        assert phases.innermost() == "train"
    try:
        with phases.phase("export"):
            with phases.phase("write_weights"):
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert phases.innermost() == "write_weights"
    with phases.phase("engine_verdict"):  # an error caught inside (eval's engine job): not where a later signal lands
        try:
            with phases.phase("engine_job"):
                raise RuntimeError
        except RuntimeError:
            pass
    assert phases.innermost() is None
    phases.reset()
    assert phases.innermost() is None

"""An exception leaving `with tel.stage(name)` carries the stage's name as `exc.otel_stage`
(the innermost stage wins; a name already set is kept; exception types that refuse
attributes are left alone), with the real layer and the disabled one alike, and the
success path never calls the naming code."""
import pytest

import otel
import otel.api
import otel.producer.hot_path as hot_path


class Slotted(Exception):
    __slots__ = ()


class _Refuses(Exception):
    def __setattr__(self, name, value):
        raise AttributeError(name)


@pytest.fixture(params=["thread", "disabled", "sdk_disabled"])
def tel(request, make_tel, monkeypatch, tmp_path):
    if request.param == "thread":
        return make_tel(mode="thread", file_dir=str(tmp_path))
    if request.param == "disabled":
        return otel.Telemetry.disabled()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    t = otel.Telemetry.from_env("dflash")
    assert isinstance(t, otel.DisabledTelemetry)
    return t


def test_the_innermost_stage_names_the_exception(tel):
    with pytest.raises(ValueError) as info:
        with tel.stage("outer", worker="w"):
            with tel.stage("inner", trace=("batch", 1)):
                pass
            with tel.stage("middle"):
                with tel.stage("innermost"):
                    raise ValueError("boom")
    assert info.value.otel_stage == "innermost"
    assert otel.STAGE_ATTRIBUTE == "otel_stage"


def test_a_name_set_before_is_kept_and_outside_any_stage_there_is_none(tel):
    err = KeyError("k")
    err.otel_stage = "earlier"
    with pytest.raises(KeyError) as info:
        with tel.stage("later"):
            raise err
    assert info.value.otel_stage == "earlier"
    with pytest.raises(ValueError) as info:
        with tel.stage("done"):
            pass
        raise ValueError("after the stage")
    assert not hasattr(info.value, "otel_stage")


def test_the_decorator_names_it_too(tel):
    @tel.staged("decorated")
    def f():
        raise RuntimeError("x")

    with pytest.raises(RuntimeError) as info:
        f()
    # the disabled layer's staged() returns the function itself: nothing to name it
    assert getattr(info.value, "otel_stage", "decorated") == "decorated"


@pytest.mark.parametrize("exc_type", [Slotted, _Refuses])
def test_exceptions_that_refuse_attributes_pass_unchanged(tel, exc_type):
    with pytest.raises(exc_type):
        with tel.stage("s"):
            raise exc_type("no attributes")


def test_the_success_path_never_names(tel, monkeypatch):
    def fail(*a):
        raise AssertionError("name_exception ran on the success path")

    monkeypatch.setattr(hot_path, "name_exception", fail)   # the real layer's Stage
    monkeypatch.setattr(otel.api, "name_exception", fail)   # the disabled layer's NullStage
    for i in range(3):
        with tel.stage("ok", trace=("batch", i)) as st:
            st.set(tokens=1)
    with pytest.raises(AssertionError, match="success path"):
        with tel.stage("failing"):
            raise ValueError("the error path does name")


def test_the_stage_still_records_the_error(make_tel, tmp_path):
    t = make_tel(mode="thread", file_dir=str(tmp_path))
    with pytest.raises(ZeroDivisionError):
        with t.stage("div"):
            1 / 0
    t.shutdown()
    (span,) = [s for s in otel.read_spans(str(tmp_path)) if s["name"] == "div"]
    assert span["status"].get("code") == 2 and span["events"][0]["name"] == "exception"

"""Neither the hot path nor the export thread may synchronise with the device: the
forbidden calls raise here, and fake CUDA events (fault injection on a CPU machine)
report "not finished" a few times, so the background thread must poll with query()."""
import threading
import time

import pytest
from otel_test_helpers import MODES

import otel

torch = pytest.importorskip("torch")


class FakeEvent:
    """Looks like torch.cuda.Event(enable_timing=True) to the layer."""

    instances = []

    def __init__(self):
        self.recorded_at = None
        self.queries = 0
        FakeEvent.instances.append(self)

    def record(self, stream=None):
        self.recorded_at = time.perf_counter()
        self.queries = 0

    def query(self):
        self.queries += 1
        return self.queries > 3  # "still running" for the first three polls

    def elapsed_time(self, end):
        assert end.queries > 3, "elapsed_time on an unfinished event would block"
        return 2.5  # ms

    def synchronize(self):
        raise AssertionError("Event.synchronize called")

    def wait(self, stream=None):
        raise AssertionError("Event.wait called")


class FakeStream:
    pass


def _forbid(*args, **kwargs):
    raise AssertionError(f"forbidden device sync from {threading.current_thread().name}")


@pytest.mark.parametrize("mode", MODES)
def test_no_device_sync_on_hot_path_or_export_thread(tmp_path, mode, make_tel, monkeypatch):
    for target, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                         (torch.cuda.Event, "elapsed_time"), (torch.Tensor, "item"),
                         (torch.Tensor, "cpu"), (torch.cuda.Stream, "synchronize")):
        monkeypatch.setattr(target, name, _forbid)
    tel = make_tel(mode=mode, file_dir=str(tmp_path), export_interval_s=0.02)
    FakeEvent.instances = []
    tel.prepare_cuda(pool_size=8, factory=FakeEvent)
    stream = FakeStream()
    t = torch.ones(3)
    for i in range(10):  # more stages than the pool holds pairs: some fall back to host timing
        with tel.stage("model_forward", trace=("batch", i), stream=stream, worker="target0", device="cuda:0"):
            t = t * 2
    deadline = time.monotonic() + 10
    spans = []
    while len(spans) < 10 and time.monotonic() < deadline:  # events resolve over a few cycles
        assert tel.flush(timeout_s=10.0)
        spans = [s for s in otel.read_spans(str(tmp_path)) if s["name"] == "model_forward"]
    assert len(spans) == 10
    with_device = [s for s in spans if "device.duration_s" in s["attributes"]]
    assert 4 <= len(with_device) <= 10
    assert all(s["attributes"]["device.duration_s"] == pytest.approx(0.0025) for s in with_device)
    # each resolved pair's end event was polled until it reported completion
    assert sum(e.queries for e in FakeEvent.instances) >= 4 * len(with_device)
    tel.flush(timeout_s=10.0)
    device_points = [p for p in otel.read_metrics(str(tmp_path))
                     if p["name"] == "dflash.stage.duration" and p["attributes"].get("clock") == "device"]
    assert device_points and device_points[-1]["attributes"]["stage"] == "model_forward"
    assert device_points[-1]["count"] == len(with_device)


class DeviceBoundEvent(FakeEvent):
    """Like a real CUDA event: bound to the device of its first record; recording it on a
    stream of another device raises (c10's 'Event device does not match')."""

    def __init__(self, device=None):
        super().__init__()
        self.device = None

    def record(self, stream=None):
        dev = getattr(stream, "device_index", None)
        if self.device is not None and dev != self.device:
            raise RuntimeError(f"Event device {self.device} does not match recording stream's device {dev}")
        self.device = dev
        super().record(stream)


class DeviceStream:
    def __init__(self, index):
        self.device_index = index


def test_events_are_never_shared_across_devices(tmp_path, make_tel):
    """A target on cuda:0 and a drafter on cuda:1 both time stages; recycled events must
    go back to the device they were first recorded on."""
    tel = make_tel(mode="thread", file_dir=str(tmp_path), export_interval_s=0.01)
    tel.prepare_cuda(pool_size=4, factory=DeviceBoundEvent)
    streams = [DeviceStream(0), DeviceStream(1)]
    for i in range(40):  # far more stages than events: pairs are recycled many times
        s = streams[i % 2]
        with tel.stage("model_forward" if s.device_index == 0 else "backward", trace=("batch", i),
                       stream=s, worker=f"w{s.device_index}"):
            pass
        if i % 4 == 3:
            tel.flush(timeout_s=5.0)  # lets the background thread resolve and recycle pairs
    deadline, spans = time.monotonic() + 10, []
    while len(spans) < 40 and time.monotonic() < deadline:  # fake events finish after a few polls
        tel.flush(timeout_s=5.0)
        spans = [s for s in otel.read_spans(str(tmp_path)) if s["name"] in ("model_forward", "backward")]
    assert len(spans) == 40
    assert not tel.summary().get("notes") or all("failed" not in n for n in tel.summary()["notes"])


class SlowEvent(FakeEvent):
    """Reports "still running" for many polls: long enough to be given up on."""

    def query(self):
        self.queries += 1
        return self.queries > 12


def test_given_up_events_return_to_the_pool_once_complete(tmp_path, make_tel, monkeypatch):
    import otel.producer.background as bg

    monkeypatch.setattr(bg, "CUDA_GIVE_UP_S", 0.0)  # give up at once: host timing only
    tel = make_tel(mode="thread", file_dir=str(tmp_path), export_interval_s=0.01)
    tel.prepare_cuda(pool_size=4, factory=SlowEvent)
    pool = tel._cuda_pool_or_create()
    for i in range(2):  # both pairs of the pool in flight
        with tel.stage("model_forward", trace=("batch", i), stream=FakeStream(), worker="t"):
            pass
    assert len(pool._free[None]) == 0
    deadline = time.monotonic() + 10
    while len(pool._free[None]) < 4 and time.monotonic() < deadline:
        tel.flush(timeout_s=5.0)
    assert len(pool._free[None]) == 4, "a long stall must not shrink the event pool for good"
    spans = [s for s in otel.read_spans(str(tmp_path)) if s["name"] == "model_forward"]
    assert len(spans) == 2 and all("device.duration_s" not in s["attributes"] for s in spans)

"""Neither the hot path nor the export thread may synchronise with the device: the
forbidden calls raise here, and fake CUDA events (fault injection on a CPU machine)
report "not finished" a few times, so the background thread must poll with query()."""
import threading
import time

import pytest
from otel_test_helpers import MODES

from otel import filesink

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
        spans = [s for s in filesink.read_spans(str(tmp_path)) if s["name"] == "model_forward"]
    assert len(spans) == 10
    with_device = [s for s in spans if "device.duration_s" in s["attributes"]]
    assert 4 <= len(with_device) <= 10
    assert all(s["attributes"]["device.duration_s"] == pytest.approx(0.0025) for s in with_device)
    # each resolved pair's end event was polled until it reported completion
    assert sum(e.queries for e in FakeEvent.instances) >= 4 * len(with_device)
    tel.flush(timeout_s=10.0)
    device_points = [p for p in filesink.read_metrics(str(tmp_path))
                     if p["name"] == "dflash.stage.duration" and p["attributes"].get("clock") == "device"]
    assert device_points and device_points[-1]["attributes"]["stage"] == "model_forward"
    assert device_points[-1]["count"] == len(with_device)

"""GPU telemetry: loud when NVML is missing; last/min/max windows when it is there."""
import sys
import types

import pytest
from otel_test_helpers import MODES

import otel
from otel.exporter.nvml import AVAILABLE_GAUGE, GpuSampler
from otel.producer.devices import resolve_devices


@pytest.mark.parametrize("mode", MODES)
def test_nvml_unavailable_warns_once_and_exports_a_gauge(tmp_path, mode, make_tel, capfd):
    pytest.importorskip("pynvml")
    tel = make_tel(mode=mode, file_dir=str(tmp_path), gpu_indices=[0])
    with tel.stage("step"):
        pass
    assert tel.flush(timeout_s=10.0)
    tel.flush(timeout_s=10.0)
    points = [p for p in otel.read_metrics(str(tmp_path)) if p["name"] == AVAILABLE_GAUGE]
    if not points:
        pytest.fail("no hw.gpu.telemetry.available gauge exported")
    if points[-1]["value"] == 1:
        pytest.skip("this machine has working NVML")
    assert points[-1]["value"] == 0
    assert "NVML" in points[-1]["attributes"]["reason"]
    assert any("GPU telemetry unavailable" in n for n in tel.summary().get("notes", []))
    assert "GPU telemetry unavailable" in tel.profile_table()
    err = capfd.readouterr().err
    assert err.count("otel: GPU telemetry unavailable") == 1, err


class _FakeNvml(types.ModuleType):
    """A stand-in NVML library (not the OpenTelemetry SDK) with scripted readings."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    class NVMLError(Exception):
        pass

    def __init__(self):
        super().__init__("pynvml")
        self.util = iter([10, 90, 50, 20] + [20] * 100)
        self.mask = iter([0x0, 0x4] + [0] * 100)

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return ("h", uuid)

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("h", f"GPU-idx{i}")

    def nvmlDeviceGetName(self, h):
        return "Fake H200"

    def nvmlDeviceGetUUID(self, h):
        return h[1]

    def nvmlDeviceGetUtilizationRates(self, h):
        return types.SimpleNamespace(gpu=next(self.util), memory=5)

    def nvmlDeviceGetPowerUsage(self, h):
        return 250_000

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 61

    def nvmlDeviceGetClockInfo(self, h, clock):
        return 1980

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(used=40 << 30, total=141 << 30)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return next(self.mask)


def test_sampler_keeps_min_max_between_exports(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml())
    sampler = GpuSampler([{"index": 0, "uuid": "GPU-abc", "nvml_index": None}], interval_s=3600).start()
    try:
        for _ in range(3):
            sampler._sample_once()  # 4 samples in total: 10, 90, 50, 20 %
        obs = sampler.observations()
        (util, attrs), = obs["hw.gpu.utilization"]
        assert util == pytest.approx(0.2) and attrs["hw.id"] == "GPU-abc" and attrs["hw.gpu.task"] == "general"
        assert obs["hw.gpu.utilization.max"][0][0] == pytest.approx(0.9)
        assert obs["hw.gpu.utilization.min"][0][0] == pytest.approx(0.1)
        assert obs["hw.power"][0][0] == 250.0 and obs["hw.temperature"][0][0] == 61.0
        assert obs["hw.power"][0][1]["hw.type"] == "gpu"
        assert obs["hw.gpu.memory.limit"][0][0] == float(141 << 30)
        assert obs["hw.gpu.clock.sm"][0][0] == 1980e6
        active = {a["reason"] for v, a in obs["hw.gpu.clock.events"] if v == 1}
        assert active == {"sw_power_cap"}  # seen in one sample of the window: not missed
        assert obs[AVAILABLE_GAUGE] == [(1, {})]
        sampler._snapshot = None  # next export window
        obs2 = sampler.observations()
        assert obs2["hw.gpu.utilization.max"][0][0] == pytest.approx(0.2)  # window restarted
    finally:
        sampler.stop()


def test_devices_map_through_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-1234")
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert resolve_devices([0, 1]) == [
        {"index": 0, "uuid": None, "nvml_index": 3},
        {"index": 1, "uuid": "GPU-1234", "nvml_index": None}]

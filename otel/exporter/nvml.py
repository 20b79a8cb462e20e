"""NVML sampler: one thread samples the GPUs actually in use about once a second and
keeps last/min/max per window, so a metric export every N seconds still sees bursts.

Only cheap NVML queries (utilisation, memory, power, temperature, SM clock, clock event
reasons); never the process list. Devices are addressed by UUID where we know it, so the
gauge describes the GPUs the workers use, not NVML's index 0 (the training process maps
its torch indices: otel.producer.devices).
"""
from __future__ import annotations

import sys
import threading
import time

# name -> (unit, description); `hw.*` names follow the OpenTelemetry hardware semantic
# conventions; hw.gpu.clock.sm and hw.gpu.clock.events have no convention yet.
GAUGES = {
    "hw.gpu.utilization": ("1", "Fraction of time the GPU was busy (hw.gpu.task=general)."),
    "hw.gpu.memory.utilization": ("1", "Fraction of GPU memory used."),
    "hw.gpu.memory.usage": ("By", "GPU memory used."),
    "hw.gpu.memory.limit": ("By", "Size of the GPU memory."),
    "hw.power": ("W", "Instantaneous power consumed by the GPU (hw.type=gpu)."),
    "hw.temperature": ("Cel", "GPU temperature (hw.type=gpu)."),
    "hw.gpu.clock.sm": ("Hz", "SM clock frequency."),
}
# window extremes are exported as separate gauges: <name>.min / <name>.max
WINDOWED = ("hw.gpu.utilization", "hw.gpu.memory.usage", "hw.power", "hw.temperature", "hw.gpu.clock.sm")
THROTTLE_GAUGE = "hw.gpu.clock.events"   # 1 per active clock-event (throttle) reason in the window
AVAILABLE_GAUGE = "hw.gpu.telemetry.available"
_REUSE_S = 0.25  # one metric collection calls all gauge callbacks within this

_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
    0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting",
}


class _Window:
    __slots__ = ("last", "min", "max")

    def __init__(self):
        self.last = self.min = self.max = None

    def add(self, v):
        self.last = v
        self.min = v if self.min is None or v < self.min else self.min
        self.max = v if self.max is None or v > self.max else self.max


class GpuSampler:
    def __init__(self, devices: list[dict], interval_s: float = 1.0, warn=None):
        self.devices = devices
        self.interval_s = interval_s
        self.available = False
        self.reason = ""
        self._warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._lock = threading.Lock()
        self._handles = []   # (attrs, handle)
        self._windows: dict = {}
        self._reasons: dict = {}
        self._stop = threading.Event()
        self._thread = None
        self._snapshot = None
        self._snapshot_at = 0.0
        self.samples = 0

    def start(self) -> "GpuSampler":
        try:
            import pynvml
            pynvml.nvmlInit()
            for dev in self.devices:
                if dev.get("uuid"):
                    h = pynvml.nvmlDeviceGetHandleByUUID(dev["uuid"])
                else:
                    h = pynvml.nvmlDeviceGetHandleByIndex(dev["nvml_index"])
                name = pynvml.nvmlDeviceGetName(h)
                uuid = pynvml.nvmlDeviceGetUUID(h)
                attrs = {"hw.id": uuid if isinstance(uuid, str) else uuid.decode(),
                         "hw.name": name if isinstance(name, str) else name.decode(),
                         "hw.vendor": "NVIDIA", "gpu.index": dev["index"]}
                self._handles.append((attrs, h))
            self.available = True
        except Exception as e:  # NVMLError_LibraryNotFound here; a missing device elsewhere
            self.reason = f"{type(e).__name__}: {e}"
            self._warn(f"otel: GPU telemetry unavailable ({self.reason}); "
                       f"exporting {AVAILABLE_GAUGE}=0 instead of NVML gauges")
            return self
        self._sample_once()
        self._thread = threading.Thread(target=self._run, name="otel-nvml", daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.interval_s):
            self._sample_once()

    def _sample_once(self):
        import pynvml
        for attrs, h in self._handles:
            key = attrs["hw.id"]
            vals = {}
            for name, read in (
                ("hw.gpu.utilization", lambda: pynvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0),
                ("hw.power", lambda: pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0),
                ("hw.temperature", lambda: float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))),
                ("hw.gpu.clock.sm", lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) * 1e6),
            ):
                try:
                    vals[name] = read()
                except Exception:
                    pass  # not supported on this board: that gauge is simply absent
            try:
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                vals["hw.gpu.memory.usage"] = float(mem.used)
                vals["hw.gpu.memory.limit"] = float(mem.total)
                vals["hw.gpu.memory.utilization"] = mem.used / mem.total if mem.total else 0.0
            except Exception:
                pass
            try:
                mask = pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)
            except Exception:
                mask = None
            with self._lock:
                for name, v in vals.items():
                    self._windows.setdefault((key, name), _Window()).add(v)
                if mask is not None:
                    acc = self._reasons.get(key, 0)
                    self._reasons[key] = acc | mask
        self.samples += 1

    def observations(self) -> dict[str, list]:
        """{gauge name: [(value, attrs)]} for this export window; the window restarts.
        Several gauge callbacks ask within one collection, so a snapshot younger than
        _REUSE_S is reused instead of restarting the window each time."""
        now = time.monotonic()
        with self._lock:
            if self._snapshot is not None and now - self._snapshot_at < _REUSE_S:
                return self._snapshot
            obs: dict[str, list] = {AVAILABLE_GAUGE: [(1 if self.available else 0,
                                                      {"reason": self.reason} if not self.available else {})]}
            by_id = {a["hw.id"]: a for a, _ in self._handles}
            for (key, name), w in self._windows.items():
                attrs = dict(by_id[key])
                if name in ("hw.power", "hw.temperature"):
                    attrs["hw.type"] = "gpu"
                if name == "hw.gpu.utilization":
                    attrs["hw.gpu.task"] = "general"
                if w.last is None:
                    continue
                obs.setdefault(name, []).append((w.last, attrs))
                if name in WINDOWED:
                    # no sample since the last export: the extremes are the last value
                    obs.setdefault(name + ".min", []).append((w.last if w.min is None else w.min, attrs))
                    obs.setdefault(name + ".max", []).append((w.last if w.max is None else w.max, attrs))
                w.min = w.max = None
            for key, mask in self._reasons.items():
                for bit, reason in _REASONS.items():
                    obs.setdefault(THROTTLE_GAUGE, []).append(
                        (1 if mask & bit else 0, {**by_id[key], "reason": reason}))
                self._reasons[key] = 0
            self._snapshot, self._snapshot_at = obs, now
            return obs

    def gauge_specs(self) -> dict[str, tuple[str, str]]:
        specs = {AVAILABLE_GAUGE: ("1", "1 when NVML GPU telemetry works, else 0 with the reason.")}
        if self.available:
            specs.update(GAUGES)
            for name in WINDOWED:
                unit, desc = GAUGES[name]
                specs[name + ".min"] = (unit, "Minimum over the export window: " + desc)
                specs[name + ".max"] = (unit, "Maximum over the export window: " + desc)
            specs[THROTTLE_GAUGE] = ("1", "1 if the clock-event (throttle) reason was active in the window.")
        return specs

    def stop(self):
        self._stop.set()

"""Telemetry files stay readable after a failed write, the accounting stays true, and a
malformed OTEL_EXPORTER_OTLP_*HEADERS never puts its value in any output."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from otel_test_helpers import MODES

import otel
from otel.exporter import filesink

ROOT = Path(__file__).resolve().parents[2]

# A full disk, made real: RLIMIT_FSIZE caps every file this process (and its exporter
# child) writes, so a write past it fails part-way exactly like ENOSPC does.
_FULL_DISK = """
import json, resource, signal, sys
import otel
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death, as ENOSPC would be
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), resource.RLIM_INFINITY))
tel = otel.Telemetry.from_env("dflash", file_dir=sys.argv[1], mode=sys.argv[2], console=False, export_interval_s=0.02,
                              metric_export_interval_s=3600)
for i in range(400):
    with tel.stage("model_forward", trace=("batch", i), worker="t0", padding="x" * 200):
        pass
    if i % 20 == 19:
        tel.flush(timeout_s=10)
tel.shutdown(timeout_s=10)
print(json.dumps(tel.summary()["health"]))
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_full_disk_leaves_whole_lines_and_true_counts(tmp_path, mode):
    p = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path), mode, "60000"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    health = json.loads(p.stdout.strip().splitlines()[-1])
    skipped: list = []
    spans = otel.read_spans(str(tmp_path / filesink.TRACES_FILE), skipped)
    assert not skipped, f"unreadable lines {skipped} in traces.jsonl after a failed write"
    assert (tmp_path / filesink.TRACES_FILE).read_bytes().endswith(b"\n")
    assert health["dropped"]["write_failed"] > 0, health
    assert len(spans) == health["spans_exported"], (len(spans), health)
    assert health["spans_recorded"] == health["spans_exported"] + health["spans_dropped"] + health["spans_queued"]


def test_a_torn_last_line_is_cut_before_appending(tmp_path):
    f = tmp_path / filesink.TRACES_FILE
    f.write_bytes(b'{"resourceSpans": []}\n{"resourceSp')  # a process killed mid-write
    exp = filesink.FileSpanExporter(str(tmp_path))
    exp.shutdown()
    assert f.read_bytes() == b'{"resourceSpans": []}\n'
    f.write_bytes(b'{"no newline at all')
    filesink.FileSpanExporter(str(tmp_path)).shutdown()
    assert f.read_bytes() == b""


def test_readers_count_what_they_skip(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_bytes(b'{"a": 1}\nnot json\n{"b": 2}\n{"torn')
    skipped: list = []
    assert list(otel.read_lines(str(f), skipped)) == [{"a": 1}, {"b": 2}]
    assert skipped == [2, 4]


_SECRET_RUN = """
import otel
tel = otel.Telemetry.from_env("dflash", console=False, mode=__import__("sys").argv[1], export_interval_s=0.05)
with tel.stage("model_forward", trace=("batch", 1), worker="t0"):
    pass
tel.shutdown(timeout_s=3)
print(tel.summary().get("notes"))
"""


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("var", ["OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
                                 "OTEL_EXPORTER_OTLP_METRICS_HEADERS"])
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_malformed_header_variable_never_prints_its_value(mode, var, protocol):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({var: "x-team=ml,authorization Bearer SUPERSECRET-TOKEN-42", "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_METRICS_EXPORTER": "otlp"})
    p = subprocess.run([sys.executable, "-c", _SECRET_RUN, mode], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    both = p.stdout + p.stderr
    assert "SUPERSECRET" not in both and "Bearer" not in both, both[-3000:]
    assert f"{var}: entry 2 of 2 not key=value; dropped (values not shown)" in both, both[-3000:]

"""Send a run's traces, written to local files, to an OTLP/HTTP endpoint afterwards.

`make demo` and every run without an endpoint write their spans to OUT/telemetry/**/traces.jsonl
(one OTLP/JSON ExportTraceServiceRequest per line, otel/exporter/filesink.py). Each line is
already the body OTLP/HTTP takes, so it is POSTed as is to `/v1/traces` of the Collector
(`make backends`: 127.0.0.1:4318), and the run opens in Jaeger like a live one:

    python3 deploy/send_traces.py runs/demo                      # then http://127.0.0.1:16686
    python3 deploy/send_traces.py runs/demo --endpoint http://collector:4318

Standard library only. Prints how many requests and spans went, and the run's trace ids.
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a run dir (its telemetry/ is read) or a telemetry dir")
    ap.add_argument("--endpoint", default="http://127.0.0.1:4318", help="OTLP/HTTP base URL (default: %(default)s)")
    a = ap.parse_args()
    tdir = a.run / "telemetry" if (a.run / "telemetry").is_dir() else a.run
    files = sorted(tdir.rglob("traces.jsonl")) if tdir.is_dir() else []
    if not files:
        print(f"send_traces: {a.run}: no traces.jsonl under it: expected a run dir or its telemetry dir",
              file=sys.stderr)
        return 2
    requests = spans = 0
    runs: set[str] = set()
    for f in files:
        for line in f.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            body = json.loads(line)
            for rs in body.get("resourceSpans", []):
                for ss in rs.get("scopeSpans", []):
                    for s in ss.get("spans", []):
                        spans += 1
                        if not s.get("parentSpanId") and any(
                                kv["key"] == "otel.kind" and kv["value"].get("stringValue") == "run"
                                for kv in s.get("attributes", [])):
                            runs.add(s["traceId"])
            req = urllib.request.Request(f"{a.endpoint.rstrip('/')}/v1/traces", data=line.encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(req, timeout=30).read()
            except (urllib.error.URLError, OSError) as e:
                print(f"send_traces: {a.endpoint}: {e}: is the Collector up (make backends)?", file=sys.stderr)
                return 1
            requests += 1
    print(f"send_traces: {requests} requests, {spans} spans from {len(files)} file(s); "
          f"run trace(s): {', '.join(sorted(runs)) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

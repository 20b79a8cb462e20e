"""A run's trace in Jaeger's UI, screenshotted in headless Chromium (docs/otel.md's picture).

    make backends                                    # Collector + Jaeger on 127.0.0.1
    python3 deploy/send_traces.py runs/demo          # a run traced to files -> the Collector
    .venv/bin/python deploy/jaeger_screenshot.py runs/demo docs/jaeger-demo-run.png

Reads the run's trace id from its files (the root span, `otel.kind` = run), opens
JAEGER/trace/ID once Jaeger's query API has it, waits for the root span's name and the
timeline's bars, and writes the PNG: every span expanded (the UI's default), as many rows as
the viewport holds (the default 1600x1400 shows `dflash train`'s phases down to
engine_verdict's first engine_start/engine_request children). Needs the real UI (`make
backends` builds it: deploy/build.sh jaeger-ui), playwright (the `test` extra) and a
Chromium on PATH.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run_trace(run: Path) -> tuple[str, str]:
    from otel import read_spans

    for f in sorted((run / "telemetry").rglob("traces.jsonl")):
        for s in read_spans(str(f)):
            if (s.get("attributes") or {}).get("otel.kind") == "run":
                return s["trace_id"], s["name"]
    raise SystemExit(f"jaeger_screenshot: {run}: no run span under telemetry/: expected a run dir")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("png", type=Path)
    ap.add_argument("--jaeger", default="http://127.0.0.1:16686")
    ap.add_argument("--width", type=int, default=1600)
    ap.add_argument("--height", type=int, default=1400)
    a = ap.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        print("jaeger_screenshot: no chromium on PATH (apt-get install chromium)", file=sys.stderr)
        return 2
    trace_id, name = run_trace(a.run)
    deadline = time.monotonic() + 60
    while True:  # the Collector batches: wait until Jaeger's query API has the trace
        try:
            got = json.loads(urllib.request.urlopen(f"{a.jaeger}/api/traces/{trace_id}", timeout=10).read())
            if got.get("data"):
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            print(f"jaeger_screenshot: trace {trace_id} not in {a.jaeger} after 60 s", file=sys.stderr)
            return 1
        time.sleep(1)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": a.width, "height": a.height})
            page.goto(f"{a.jaeger}/trace/{trace_id}")
            page.wait_for_selector(f"text={name}", timeout=60_000)
            page.wait_for_selector(".SpanBar--bar", timeout=60_000)  # the timeline's rows (not the placeholder page)
            page.wait_for_load_state("networkidle")
            page.wait_for_timeout(1000)  # the rows below the first draw in a second pass
            page.screenshot(path=str(a.png))
        finally:
            browser.close()
    print(f"jaeger_screenshot: {a.png} (trace {trace_id}, {name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

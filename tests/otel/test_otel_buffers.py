"""Many threads lose nothing while the queue has room; a full queue drops and counts."""
import threading
import time

import pytest
from otel_test_helpers import MODES

import otel


@pytest.mark.parametrize("mode", MODES)
def test_many_threads_lose_nothing(tmp_path, mode, make_tel):
    tel = make_tel(mode=mode, file_dir=str(tmp_path))
    n_threads, per_thread = 8, 2000
    start = threading.Barrier(n_threads)

    def worker(w):
        start.wait()
        for i in range(per_thread):
            with tel.stage("step", worker=f"w{w}", i=i):
                pass

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tel.flush(timeout_s=20.0)
    s = tel.summary()
    assert s["stages"]["step"]["count"] == n_threads * per_thread
    assert s["health"]["spans_recorded"] == n_threads * per_thread
    assert s["health"]["spans_dropped"] == 0
    assert s["health"]["spans_exported"] == n_threads * per_thread
    spans = otel.read_spans(str(tmp_path))
    seen = {(sp["attributes"]["worker"], sp["attributes"]["i"]) for sp in spans}
    assert len(spans) == len(seen) == n_threads * per_thread


@pytest.mark.parametrize("mode", MODES)
def test_full_queue_drops_and_counts(tmp_path, mode, make_tel):
    # the background thread never runs on its own here, so the buffer fills up
    tel = make_tel(mode=mode, file_dir=str(tmp_path), max_queue=100, export_interval_s=3600)
    for i in range(150):
        with tel.stage("step", i=i):
            pass
    assert tel.flush(timeout_s=10.0)
    deadline = time.monotonic() + 5
    while tel.summary()["health"]["spans_exported"] < 100 and time.monotonic() < deadline:
        time.sleep(0.05)
    h = tel.summary()["health"]
    # every record counts as recorded, whether it was kept or dropped at a full buffer
    assert h["spans_recorded"] == 150
    assert h["spans_dropped"] == 50 and h["dropped"]["buffer_full"] == 50
    assert h["spans_exported"] == 100 and h["spans_queued"] == 0
    assert len(otel.read_spans(str(tmp_path))) == 100
    for i in range(102):  # counter values have their own (drained, cap 100) per-thread list
        tel.add("dflash.tokens", 1)
    assert any("counter/histogram values dropped" in n for n in tel.summary().get("notes", []))
    # the drop count reaches the exported self-health metric too
    tel.flush(timeout_s=10.0)
    dropped = [p["value"] for p in otel.read_metrics(str(tmp_path)) if p["name"] == "otel.spans.dropped"]
    assert dropped and dropped[-1] == 50

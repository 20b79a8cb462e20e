"""Stall analysis: idle attribution (otel.idle), `dflash stalls`, `dflash timeline`.

Three short tiny-llama runs (module fixtures) stand in for a slowed target, a slowed
drafter and an unperturbed pipeline; every number the report prints is recomputed here
from the raw file sink."""
import http.server
import json
import random
import struct
import threading
from collections import defaultdict

import pytest

from helpers import NO_OTEL_ENV, TINY, last_json, run_dflash
from otel import read_spans
from dflash.analysis.idle_rules import DFLASH_RULES
from otel import IdleAccumulator, IdleRules, attribute_idle
from dflash.analysis.stalls import jaeger_to_spans, worker_of

STEPS = 6


def _train(tmp_path_factory, name, *extra):
    run = tmp_path_factory.mktemp(name) / "run"
    run_dflash("train", "--out", run, "--target", "tiny-llama", "--steps", STEPS, *TINY, *extra, env=NO_OTEL_ENV)
    return run


@pytest.fixture(scope="module")
def slow_target(tmp_path_factory):
    return _train(tmp_path_factory, "slow_target", "--inject-delay", "model_forward=0.3")


@pytest.fixture(scope="module")
def slow_drafter(tmp_path_factory):
    return _train(tmp_path_factory, "slow_drafter", "--inject-delay", "backward=0.3", "--set", "pipeline.queue_size=1")


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _train(tmp_path_factory, "plain")


def _spans(run):
    return [s for f in sorted((run / "telemetry").rglob("traces.jsonl")) for s in read_spans(str(f))]


def _report(run, *extra):
    p = run_dflash("stalls", run, "--json", *extra)
    return p.stdout, last_json(p.stdout)


def _worker(rep, name):
    return next(w for w in rep["workers"] if w["worker"] == name)


def _top(w):
    return max(w["idle_s"], key=w["idle_s"].get)


# ------------------------------------------------------------------ scenarios

def test_slow_target_starves_the_drafter(slow_target):
    text, rep = _report(slow_target)
    d = _worker(rep, "drafter0")
    assert _top(d) == "queue_empty" == d["top_idle_cause"], d
    assert d["idle_s"]["queue_empty"] > 0.5 * (STEPS - 1) * 0.3 * 0.5
    assert _worker(rep, "target0")["busy_fraction"] > 0.9
    assert rep["top_stalls"][0]["cause"] == "queue_empty" and rep["top_stalls"][0]["worker"] == "drafter0"
    assert "queue_empty" in text and "typical step" in text


def test_slow_drafter_blocks_the_target(slow_drafter):
    _, rep = _report(slow_drafter)
    t = _worker(rep, "target0")
    assert _top(t) == "queue_full" == t["top_idle_cause"], t
    assert t["idle_s"]["queue_full"] > 0.5
    assert any(s["cause"] == "queue_full" and s["worker"] == "target0" for s in rep["top_stalls"])


def test_unperturbed_busy_plus_idle_is_wall(plain):
    _, rep = _report(plain)
    assert {w["worker"] for w in rep["workers"]} >= {"prefetch", "target0", "drafter0"}
    for w in rep["workers"]:
        total = w["busy_s"] + sum(w["idle_s"].values())
        assert abs(total - w["wall_s"]) <= 0.02 * w["wall_s"] + 1e-9, w
    for key, d in attribute_idle(_spans(plain), DFLASH_RULES, worker_of=worker_of).items():
        assert d["busy_ns"] + sum(d["idle_ns"].values()) == d["wall_ns"], key   # exact, in ns


# ------------------------------------------------------------------ report == spans

def test_report_numbers_match_the_spans(slow_target):
    _, rep = _report(slow_target, "--top", "3")
    by = defaultdict(list)
    for s in _spans(slow_target):
        if "worker" in s["attributes"] and s["name"] != "skipped_step":
            by[s["attributes"]["worker"]].append(s)
    dur = lambda s: (s["end_ns"] - s["start_ns"]) / 1e9  # noqa: E731
    for name, ss in by.items():
        ss.sort(key=lambda s: s["start_ns"])
        w = _worker(rep, name)
        # the first model_forward's data wait opens the worker's wall time
        lead = ss[0]["attributes"].get("data_wait_s", 0) if ss[0]["name"] == "model_forward" else 0
        wall = (max(s["end_ns"] for s in ss) - ss[0]["start_ns"]) / 1e9 + lead
        assert w["wall_s"] == pytest.approx(wall, abs=2e-6)
        # no stage overlaps another on its worker, so every gap between stages is idle time
        gaps = sum(max(0, b["start_ns"] - a["end_ns"]) for a, b in zip(ss, ss[1:])) / 1e9
        # (the prefetcher's waits for room in its queue are carved out of the gaps as queue_full)
        carved = w["idle_s"]["queue_full"] if name == "prefetch" else 0.0
        assert w["idle_s"]["data_wait"] + w["idle_s"]["host"] + carved == pytest.approx(gaps + lead, abs=2e-6)
        if name == "prefetch":
            assert carved <= sum(s["attributes"].get("blocked_before_s", 0) for s in ss) + 1e-6
        waits = sum(s["attributes"].get("data_wait_s", 0) for s in ss if s["name"] == "model_forward")
        assert w["idle_s"]["data_wait"] <= waits + 1e-6
    d = _worker(rep, "drafter0")
    qget = [s for s in by["drafter0"] if s["name"] == "queue_get"]
    assert d["idle_s"]["queue_empty"] == pytest.approx(sum(map(dur, qget)), abs=1e-6)
    assert d["idle_s"]["checkpoint"] == pytest.approx(sum(dur(s) for s in by["drafter0"] if s["name"] == "checkpoint"), abs=1e-6)
    busy = {"drafter_forward", "backward", "optimizer_step"}
    assert d["busy_s"] == pytest.approx(sum(dur(s) for s in by["drafter0"] if s["name"] in busy), abs=1e-6)
    t = _worker(rep, "target0")
    enq = [s for s in by["target0"] if s["name"] == "cpu_copy_enqueue"]
    assert t["idle_s"]["queue_full"] == pytest.approx(sum(min(s["attributes"]["blocked_s"], dur(s)) for s in enq), abs=1e-5)
    # the longest stall is the longest queue_get, with its trace id
    longest = max(qget, key=dur)
    top = rep["top_stalls"][0]
    assert len(rep["top_stalls"]) == 3
    assert (top["trace_id"], top["cause"]) == (longest["trace_id"], "queue_empty")
    assert top["duration_s"] == pytest.approx(dur(longest), abs=1e-6)
    # the typical step is the median batch trace, stages in time order
    cp = rep["critical_path"]
    offsets = [s["offset_s"] for s in cp["stages"]]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert {s["stage"] for s in cp["stages"]} >= {"model_forward", "queue_get", "optimizer_step"}


def test_a_window_after_the_run_is_one_line(plain):
    p = run_dflash("stalls", plain, "--window", "100000:", check=False)
    assert p.returncode == 2 and "starts after the run's last span" in p.stderr, p.stderr


def test_bad_run_dir_is_one_line_exit_2(tmp_path):
    for bad in (tmp_path / "missing", tmp_path):
        p = run_dflash("stalls", bad, check=False)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    p = run_dflash("timeline", tmp_path, check=False)
    assert p.returncode == 2 and "--png" in p.stderr


# ------------------------------------------------------------------ pictures

def test_timeline_png_and_perfetto(slow_target, tmp_path):
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    run_dflash("timeline", slow_target, "--png", png, "--perfetto", trace)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    w, h = struct.unpack(">II", data[16:24])
    assert 1000 <= w <= 3000 and 250 <= h <= 2000, (w, h)

    doc = json.loads(trace.read_text())
    ev = doc["traceEvents"]
    xs = [e for e in ev if e["ph"] == "X"]
    assert xs and all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 for e in xs)
    tracks = {(e["pid"], e["tid"]) for e in xs}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    workers = {s["attributes"]["worker"] for s in _spans(slow_target) if "worker" in s["attributes"]}
    assert set(names) == tracks and sorted(names.values()) == sorted(workers)
    assert any(e["cat"] == "stall" and e["args"]["cause"] == "queue_empty" for e in xs)
    assert min(e["ts"] for e in xs) == 0

    # a window: stages clipped to it, workers idle throughout it left out
    run_dflash("timeline", slow_target, "--perfetto", trace, "--window", "0.2:1.0")
    xs = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert xs and all(0.2e6 - 1 <= e["ts"] and e["ts"] + e["dur"] <= 1.0e6 + 1 for e in xs)


# ------------------------------------------------------------------ online == offline

def test_online_accumulator_matches_offline(plain):
    spans = [s for s in _spans(plain) if worker_of(s)]
    offline = attribute_idle(spans, DFLASH_RULES, worker_of=worker_of)
    # a telemetry thread sees records once stages *end*, drained every 100 ms from several
    # per-thread buffers: order within one drain cycle is arbitrary
    rng = random.Random(0)
    t0 = min(s["end_ns"] for s in spans)
    cycles = defaultdict(list)
    for s in spans:
        cycles[(s["end_ns"] - t0) // 100_000_000].append(s)
    stream = []
    for c in sorted(cycles):
        rng.shuffle(cycles[c])
        stream += cycles[c]
    acc = IdleAccumulator(DFLASH_RULES, reorder_ns=250_000_000)
    prev = {}
    for n, s in enumerate(stream):
        acc.feed(worker_of(s), s["name"], s["start_ns"], s["end_ns"], s["attributes"])
        if n % 7 == 0:  # live snapshots only grow: fit for monotonic counters
            for k, d in acc.snapshot().items():
                for c, v in d["idle_ns"].items():
                    assert v >= prev.get((k, c), 0)
                    prev[(k, c)] = v
    assert acc.snapshot(flush=True) == offline
    assert acc.late_records == 0


def test_rules_carving_overlap_and_window():
    s = 1_000_000_000
    recs = [("w", "model_forward", 0, 2 * s, {"data_wait_s": 0.5}),      # wait 0.5 s before, as the first stage
            ("w", "cpu_copy_enqueue", 3 * s, 5 * s, {"blocked_s": 1.5}),  # 1 s host gap, then 1.5 s blocked
            ("w", "inner", 4 * s, 4 * s + 10, {}),                         # nested: already counted
            ("w", "ddp_allreduce", 5 * s, 6 * s, {}),
            ("w", "mystery", 6 * s, 7 * s, {}),
            ("w", "skipped_step", 7 * s, 9 * s, {})]
    acc = IdleAccumulator(DFLASH_RULES, reorder_ns=0)
    for r in recs:
        acc.feed(*r)
    d = acc.snapshot(flush=True)["w"]
    assert d["wall_ns"] == 7.5 * s and d["busy_ns"] == 2.5 * s
    assert {c: v for c, v in d["idle_ns"].items() if v} == {
        "data_wait": 0.5 * s, "host": 1 * s, "queue_full": 1.5 * s, "sync": 1 * s, "other": 1 * s}
    assert acc.late_records == 1
    spans = [{"name": n, "start_ns": a, "end_ns": b, "attributes": {"worker": w, **at}} for w, n, a, b, at in recs]
    win = attribute_idle(spans, DFLASH_RULES, window=(int(1.5 * s), 4 * s))["w"]
    assert win["wall_ns"] == 2.5 * s and win["busy_ns"] == 0.5 * s + 0.5 * s
    custom = attribute_idle(spans, IdleRules(busy=None, stage_causes={"mystery": "checkpoint"}))["w"]
    assert custom["idle_ns"]["checkpoint"] == 1 * s and custom["idle_ns"]["other"] == 0


# ------------------------------------------------------------------ Jaeger

def _to_jaeger(spans) -> dict:
    """What Jaeger's query API returns for these spans (the protocol peer's side)."""
    def tag(k, v):
        t = {bool: "bool", int: "int64", float: "float64"}.get(type(v), "string")
        return {"key": k, "type": t, "value": v if t != "string" else str(v)}
    traces = defaultdict(list)
    for s in spans:
        traces[s["trace_id"]].append(s)
    data = []
    for tid, ss in traces.items():
        procs, out = {}, []
        for s in ss:
            pid = "p%d" % (list(procs).index(s["resource"]["service.instance.id"]) + 1
                           if s["resource"]["service.instance.id"] in procs else len(procs) + 1)
            procs.setdefault(s["resource"]["service.instance.id"], (pid, s["resource"]))
            refs = [{"refType": "CHILD_OF", "traceID": tid, "spanID": s["parent_span_id"]}] if s["parent_span_id"] else []
            refs += [{"refType": "FOLLOWS_FROM", "traceID": l["trace_id"], "spanID": l["span_id"]} for l in s["links"]]
            out.append({"traceID": tid, "spanID": s["span_id"], "operationName": s["name"], "references": refs,
                        "startTime": s["start_ns"] // 1000, "duration": s["end_ns"] // 1000 - s["start_ns"] // 1000,
                        "tags": [tag(k, v) for k, v in s["attributes"].items()] + [tag("span.kind", "internal")],
                        "logs": [{"timestamp": e["time_ns"] // 1000,
                                  "fields": [tag("event", e["name"])] + [tag(k, v) for k, v in e["attributes"].items()]}
                                 for e in s["events"]],
                        "processID": procs[s["resource"]["service.instance.id"]][0], "warnings": None})
        data.append({"traceID": tid, "spans": out, "warnings": None,
                     "processes": {p: {"serviceName": r["service.name"],
                                       "tags": [tag(k, v) for k, v in r.items() if k != "service.name"]}
                                   for p, r in procs.values()}})
    return {"data": data, "total": 0, "limit": 0, "offset": 0, "errors": None}


def test_jaeger_conversion_round_trip(slow_target):
    spans = _spans(slow_target)
    doc = json.loads(json.dumps(_to_jaeger(spans)))
    back = {s["span_id"]: s for s in jaeger_to_spans(doc)}
    assert len(back) == len(spans)
    for s in spans:
        b = back[s["span_id"]]
        assert (b["name"], b["trace_id"], b["parent_span_id"]) == (s["name"], s["trace_id"], s["parent_span_id"])
        assert b["start_ns"] == s["start_ns"] // 1000 * 1000 and abs(b["end_ns"] - s["end_ns"]) < 2000
        assert b["attributes"] == s["attributes"] and b["resource"] == s["resource"]
        assert [(e["name"], e["attributes"]) for e in b["events"]] == [(e["name"], e["attributes"]) for e in s["events"]]
        assert [l["span_id"] for l in b["links"]] == [l["span_id"] for l in s["links"]]

    bad = json.loads(json.dumps(doc))  # one span Jaeger's format never holds: the rest is read, it is counted
    bad["data"][0]["spans"][0]["tags"].append({"key": "batch_id", "type": "int64", "value": "12.5"})
    skipped: list = []
    assert len(jaeger_to_spans(bad, skipped)) == len(spans) - 1 and skipped == [bad["data"][0]["spans"][0]["spanID"]]

    body = json.dumps(doc).encode()
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        _, via_jaeger = _report_jaeger(f"http://127.0.0.1:{srv.server_port}")
    finally:
        srv.shutdown()
    assert seen and seen[0].startswith("/api/traces?") and "service=dflash" in seen[0] and "start=" in seen[0]
    _, via_file = _report(slow_target)
    assert via_jaeger["run_id"] == via_file["run_id"]
    for wf in via_file["workers"]:
        wj = _worker(via_jaeger, wf["worker"])
        # Jaeger keeps microseconds: each stage's edges move by < 1 us
        assert wj["busy_s"] == pytest.approx(wf["busy_s"], abs=2e-4)
        assert wj["wall_s"] == pytest.approx(wf["wall_s"], abs=2e-4)
        for c, v in wf["idle_s"].items():
            assert wj["idle_s"][c] == pytest.approx(v, abs=2e-4), c
    assert via_jaeger["top_stalls"][0]["trace_id"] == via_file["top_stalls"][0]["trace_id"]


def _report_jaeger(url):
    p = run_dflash("stalls", "--jaeger", url, "--json")
    return p.stdout, last_json(p.stdout)

"""In-process OTLP receivers (gRPC and HTTP/protobuf) for tests: real protocol peers on
loopback built from grpcio, http.server and the official opentelemetry-proto messages.

    with OtlpGrpcReceiver() as rx:      # rx.endpoint == "http://127.0.0.1:<port>"
        ... export ...
        rx.wait_for_spans(lambda spans: len(spans) >= 10)
"""
from __future__ import annotations

import gzip
import threading
import time
import zlib
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def _any_value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def attrs(kvs) -> dict:
    return {kv.key: _any_value(kv.value) for kv in kvs}


class _Store:
    """What a receiver got: raw requests plus flattened spans / metric points."""

    def __init__(self):
        self.lock = threading.Condition()
        self.trace_requests: list = []
        self.metric_requests: list = []
        self.headers: list[dict] = []

    def add_traces(self, req, headers):
        with self.lock:
            self.trace_requests.append(req)
            self.headers.append(headers)
            self.lock.notify_all()

    def add_metrics(self, req, headers):
        with self.lock:
            self.metric_requests.append(req)
            self.headers.append(headers)
            self.lock.notify_all()

    def _received(self, requests, kind: str):
        """``(resource attributes, item)`` for every span (kind "spans") or metric ("metrics")
        in the requests received so far: OTLP nests both as resource -> scope -> items."""
        with self.lock:
            reqs = list(requests)
        for req in reqs:
            for r in getattr(req, f"resource_{kind}"):
                resource = attrs(r.resource.attributes)
                for scope in getattr(r, f"scope_{kind}"):
                    for item in getattr(scope, kind):
                        yield resource, item

    @property
    def spans(self) -> list[dict]:
        return [{"name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                 "parent_span_id": s.parent_span_id.hex(),
                 "start_ns": s.start_time_unix_nano, "end_ns": s.end_time_unix_nano,
                 "attributes": attrs(s.attributes), "resource": resource,
                 "events": [{"name": e.name, "time_ns": e.time_unix_nano, "attributes": attrs(e.attributes)}
                            for e in s.events],
                 "links": [{"trace_id": l.trace_id.hex(), "span_id": l.span_id.hex()} for l in s.links],
                 "status_code": s.status.code}
                for resource, s in self._received(self.trace_requests, "spans")]

    @property
    def metric_points(self) -> list[dict]:
        out = []
        for resource, m in self._received(self.metric_requests, "metrics"):
            kind = m.WhichOneof("data")
            for p in getattr(m, kind).data_points:
                point = {"name": m.name, "unit": m.unit, "type": kind,
                         "attributes": attrs(p.attributes), "resource": resource}
                if kind == "histogram":
                    point.update(count=p.count, sum=p.sum, bucket_counts=list(p.bucket_counts),
                                 explicit_bounds=list(p.explicit_bounds))
                else:
                    point["value"] = p.as_double if p.WhichOneof("value") == "as_double" else p.as_int
                out.append(point)
        return out

    def wait_for(self, predicate, timeout_s: float = 10.0, what: str = "spans"):
        """Wait until predicate(self.spans or self.metric_points) is truthy; return the list."""
        deadline = time.monotonic() + timeout_s
        while True:
            items = self.spans if what == "spans" else self.metric_points
            if predicate(items):
                return items
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"receiver: condition on {what} not met in {timeout_s} s "
                                     f"({len(items)} {what} received)")
            with self.lock:
                self.lock.wait(min(left, 0.1))

    def wait_for_spans(self, predicate, timeout_s: float = 10.0):
        return self.wait_for(predicate, timeout_s, "spans")

    def wait_for_metrics(self, predicate, timeout_s: float = 10.0):
        return self.wait_for(predicate, timeout_s, "metrics")


class _Receiver(_Store):
    """A store that listens on 127.0.0.1 (``port`` 0: any free port); a context manager."""

    def __init__(self, port: int = 0):
        super().__init__()
        self._requested_port = port
        self.port = None
        self._server = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class OtlpGrpcReceiver(_Receiver):
    protocol = "grpc"

    def start(self) -> "OtlpGrpcReceiver":
        store = self

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                store.add_traces(request, dict(context.invocation_metadata()))
                return trace_service_pb2.ExportTraceServiceResponse()

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):
                store.add_metrics(request, dict(context.invocation_metadata()))
                return metrics_service_pb2.ExportMetricsServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{self.port or self._requested_port}")
        self._server.start()
        return self

    def stop(self):
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None


class OtlpHttpReceiver(_Receiver):
    protocol = "http/protobuf"

    def start(self) -> "OtlpHttpReceiver":
        store = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                enc = self.headers.get("Content-Encoding", "")
                if enc == "gzip":
                    body = gzip.decompress(body)
                elif enc == "deflate":
                    body = zlib.decompress(body)
                headers = {k.lower(): v for k, v in self.headers.items()}
                if self.path == "/v1/traces":
                    req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                    store.add_traces(req, headers)
                    resp = trace_service_pb2.ExportTraceServiceResponse()
                elif self.path == "/v1/metrics":
                    req = metrics_service_pb2.ExportMetricsServiceRequest.FromString(body)
                    store.add_metrics(req, headers)
                    resp = metrics_service_pb2.ExportMetricsServiceResponse()
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                data = resp.SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port or self._requested_port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self):
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

"""A stand-in for the engine's python (DFLASH_VLLM_PYTHON), for tests of what dflash hands
the engine and prints around it, where a real vLLM (minutes, ~4 GB) adds nothing.

Started as `python -m vllm.entrypoints.openai.api_server ARGS` (or a worker script), it
writes its argv and the OTEL_* part of its environment to $STANDIN_RECORD (JSON). With
STANDIN_SERVE=1 and `--port P` it then answers GET /health with 200 on 127.0.0.1:P until
SIGTERM, as vLLM's server does once it is ready; else it exits 3 at once (an engine that
failed: a test that expects no engine fails fast, and leaves no server behind, when one starts).
STANDIN_BIND_AFTER=PATH: the port is bound only once PATH exists (vLLM binds after its imports,
about a minute after dflash checked the port); a port taken by then fails as vLLM's does."""
from __future__ import annotations

import json
import os
import signal
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

argv = sys.argv[1:]
with open(os.environ["STANDIN_RECORD"], "w") as f:
    json.dump({"argv": argv, "env": {k: v for k, v in os.environ.items() if k.startswith("OTEL_") or k == "TRACEPARENT"}},
              f)
if "--port" not in argv or os.environ.get("STANDIN_SERVE") != "1":
    sys.exit(3)


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
if os.environ.get("STANDIN_BIND_AFTER"):
    import time
    while not os.path.exists(os.environ["STANDIN_BIND_AFTER"]):
        time.sleep(0.05)
HTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Health).serve_forever()

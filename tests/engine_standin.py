"""A stand-in for engine/vllm_worker.py's "paired" job, for tests of engine/paired.py where
no vLLM runs: the same socket protocol, and, like vLLM's engine, the work done in a second
process below the one that talks to the parent (a "burner" that spends the CPU seconds the job
asks per request and says how many it spent, by its own process clock). With "die_on": i in the
job it dies on request i, mid-request, leaving its burner running.

    python -P engine_standin.py JOB.json RESULT.json
"""
import json
import os
import socket
import subprocess
import sys
import time

BURNER = """
import sys, time
for line in sys.stdin:
    want, t0 = float(line), time.process_time()
    while time.process_time() - t0 < want:
        sum(i * i for i in range(2000))
    print(time.process_time() - t0, flush=True)
"""


def main(job_path: str) -> int:
    job = json.load(open(job_path, encoding="utf-8"))
    burner = subprocess.Popen([sys.executable, "-c", BURNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, bufsize=1)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(job["socket"])
    rfile, wfile = sock.makefile("rb"), sock.makefile("wb")

    def send(obj):
        wfile.write(json.dumps(obj).encode() + b"\n")
        wfile.flush()

    send({"ready": True, "vllm_version": "stand-in", "load_s": 0.0, "pid": os.getpid(), "machine": {},
          "ready_epoch_ns": time.time_ns()})
    for line in rfile:
        msg = json.loads(line)
        if msg.get("op") == "generate":
            t = time.perf_counter()
            burner.stdin.write(f"{job['work_s']}\n")
            burner.stdin.flush()
            if int(msg["i"]) == job.get("die_on", -1):  # an engine that dies mid-request, its worker left behind
                time.sleep(0.05)
                os._exit(3)
            spent = float(burner.stdout.readline())
            send({"wall_s": time.perf_counter() - t, "cpu_s": spent, "tokens": 1, "output": [int(msg["i"])],
                  "spec": None})
        elif msg.get("op") == "quit":
            break
    burner.stdin.close()
    burner.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

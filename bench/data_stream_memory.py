"""Peak memory of reading a whole data set, by file size: a full pass over every record
(parse + classify + count by drop reason, what `dflash data inspect` and the reader do)
of a generated 10 MB file and a 1 GB one, each in a fresh process, side by side.

    .venv/bin/python bench/data_stream_memory.py [--big-mb 1024] [--dir /tmp]

Records mix ShareGPT `conversations` and chat `messages`, with a few malformed lines, so
the drop counters run too. Both JSON Lines and a JSON array are measured.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
from pathlib import Path
from dflash.data.conversations import _iter_records, drop_counts
from dflash.preflight.memory import process_memory  # VmHWM: ru_maxrss would count our parent (bench/peak_rss.py)
t0 = time.perf_counter()
n = 0
def counted(it):
    global n
    for r in it:
        n += 1
        yield r
drops = drop_counts(counted(_iter_records(Path(sys.argv[1]))))
print(json.dumps({"records": n, "dropped": sum(drops.values()), "s": time.perf_counter() - t0,
                  "peak_rss_mb": process_memory()[1] / 2**20}))
"""


def _record(rng: random.Random, i: int):
    words = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "reply", "question")) for _ in range(60))
    if i % 97 == 0:
        return {"conversations": [{"from": "gpt", "value": "an assistant first"}]}  # roles_out_of_order
    if i % 2:
        return {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i} {words}"},
                             {"role": "assistant", "content": f"a{i} {words}"}]}
    return {"conversations": [{"from": "human", "value": f"q{i} {words}"}, {"from": "gpt", "value": f"a{i} {words}"}]}


def write(path: Path, mb: int, array: bool) -> None:
    rng, target, i = random.Random(0), mb * 2**20, 0
    with open(path, "w") as f:
        f.write("[\n" if array else "")
        size = 0
        while size < target:
            line = json.dumps(_record(rng, i))
            if not array and i % 101 == 0:
                line = line[:-7]  # a cut line: not_json
            text = (",\n" if array and i else "") + line + ("" if array else "\n")
            f.write(text)
            size += len(text)
            i += 1
        f.write("\n]\n" if array else "")


def measure(path: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    p = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, env=env, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--big-mb", type=int, default=1024)
    ap.add_argument("--small-mb", type=int, default=10)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        print(f"{'file':<22} {'size':>9} {'records':>10} {'dropped':>8} {'seconds':>8} {'peak RSS':>9}")
        for array in (False, True):
            rows = []
            for mb in (a.small_mb, a.big_mb):
                path = Path(d) / f"data-{mb}mb.{'json' if array else 'jsonl'}"
                write(path, mb, array)
                r = measure(path)
                rows.append(r)
                print(f"{path.name:<22} {path.stat().st_size / 2**20:>7.0f}MB {r['records']:>10,} {r['dropped']:>8,} "
                      f"{r['s']:>8.1f} {r['peak_rss_mb']:>7.1f}MB")
                path.unlink()
            kind = "JSON array" if array else "JSON Lines"
            print(f"{kind}: peak RSS {a.big_mb} MB / {a.small_mb} MB file = "
                  f"{rows[1]['peak_rss_mb'] / rows[0]['peak_rss_mb']:.3f}")


if __name__ == "__main__":
    main()

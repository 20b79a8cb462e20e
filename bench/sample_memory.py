"""Host memory of the prepared training samples: Python lists (how a sample was held before
`dflash.data.sample`) vs the compact arrays, side by side, each in a fresh process.

    .venv/bin/python bench/sample_memory.py [--samples 20000] [--mean-len 1024] [--vocab 151936]

Every rank holds every sample (rank 0 prepares them and broadcasts them pickled), so the
figures are per process: the resident memory the samples add, bytes per token, the size and
time of the broadcast's pickle round trip, and one epoch of batches (`collate`, batch 8).
Token ids are drawn at random below the vocabulary size, each a fresh int as a tokenizer
returns it; lengths are uniform over [mean/4, 7*mean/4].
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import gc, json, pickle, random, sys, time
import torch
from dflash.data.dataset import collate
from dflash.data.sample import Sample

mode, n, mean, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

class ListSample:  # the representation this bench measures against: a list per field
    __slots__ = ("input_ids", "loss_mask")
    def __init__(self, ids, mask):
        self.input_ids, self.loss_mask = ids, mask

def list_collate(group, pad_id):  # the collate that went with it
    width = max(len(s.input_ids) for s in group)
    ids = torch.full((len(group), width), pad_id, dtype=torch.long)
    lm = torch.zeros((len(group), width), dtype=torch.long)
    for r, s in enumerate(group):
        ids[r, :len(s.input_ids)] = torch.tensor(s.input_ids)
        lm[r, :len(s.input_ids)] = torch.tensor(s.loss_mask)
    return ids, lm

rng = random.Random(0)
gc.collect()
before = rss_mb()
samples, tokens = [], 0
t0 = time.perf_counter()
for _ in range(n):
    L = rng.randint(mean // 4, 7 * mean // 4)
    ids = [rng.randrange(1000, vocab) for _ in range(L)]
    mask = [0] * (L // 4) + [1] * (L - L // 4)
    samples.append(ListSample(ids, mask) if mode == "lists" else Sample(ids, mask))
    tokens += L
build_s = time.perf_counter() - t0
gc.collect()
held = rss_mb() - before
t0 = time.perf_counter()
blob = pickle.dumps(samples, protocol=pickle.HIGHEST_PROTOCOL)
back = pickle.loads(blob)
pickle_s = time.perf_counter() - t0
del back
t0 = time.perf_counter()
for b in range(0, n - n % 8, 8):
    group = samples[b:b + 8]
    list_collate(group, 0) if mode == "lists" else collate(group, 0, b)
collate_s = time.perf_counter() - t0
print(json.dumps({"tokens": tokens, "held_mb": held, "bytes_per_token": held * 2**20 / tokens,
                  "pickle_mb": len(blob) / 2**20, "pickle_roundtrip_s": pickle_s, "epoch_collate_s": collate_s,
                  "build_s": build_s}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--mean-len", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151936, help="default: Qwen3's")
    a = ap.parse_args()
    res = {}
    for mode in ("lists", "arrays"):
        p = subprocess.run([sys.executable, "-c", CHILD, mode, str(a.samples), str(a.mean_len), str(a.vocab)],
                           cwd=ROOT, capture_output=True, text=True, check=True)
        res[mode] = json.loads(p.stdout.strip().splitlines()[-1])
    tok = res["lists"]["tokens"]
    print(f"{a.samples} samples, {tok / 1e6:.1f} M tokens (mean length {tok / a.samples:.0f}), vocab {a.vocab}")
    print(f"{'':22}{'lists':>12}{'arrays':>12}{'ratio':>9}")
    for key, unit in (("held_mb", "MB"), ("bytes_per_token", "B"), ("pickle_mb", "MB"),
                      ("pickle_roundtrip_s", "s"), ("epoch_collate_s", "s")):
        x, y = res["lists"][key], res["arrays"][key]
        print(f"{key + ' (' + unit + ')':22}{x:12.2f}{y:12.2f}{x / y:8.1f}x")
    per_tok = {m: res[m]["bytes_per_token"] for m in res}
    print(f"0.5 M samples x 1,024 tokens per rank: {per_tok['lists'] * 512e6 / 1e9:.1f} GB as lists, "
          f"{per_tok['arrays'] * 512e6 / 1e9:.1f} GB as arrays")
    return 0


if __name__ == "__main__":
    sys.exit(main())

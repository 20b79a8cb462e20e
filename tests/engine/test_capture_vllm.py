"""`dflash capture --engine vllm` (issue 39): vLLM's `extract_hidden_states` (through our CPU
connector, dflash/engine/vllm_ext/) writes the features `dflash capture` writes, in the same
shards and index, equal within float32 tolerance. One engine start: tiny-qwen3 at float32,
given as the model dir the engine reads (engine/targets.py), so the vLLM capture loads no
weights on our side (a meta-device skeleton: what a 70B target needs); no regeneration (a
model dir's default), so both captures prepare the same data-set replies."""
from __future__ import annotations

import json
import time

import torch
from safetensors.torch import load_file

from helpers import run_dflash

SMALL = ["--set", "data.num_conversations=10", "--set", "data.regenerate=off", "--set", "data.max_len=96", "--set", "data.regen_max_new_tokens=40",
         "--set", "data.regen_max_prompt_len=48", "--set", "train.batch_size=2", "--set", "model.block_size=8"]


def _by_sample(feats):
    idx = json.loads((feats / "index.json").read_text())
    out = {}
    for s in idx["shards"]:
        t = load_file(str(feats / s["file"]))
        offs, pos = t["offsets"].tolist(), t["sample"].tolist()
        for j, p in enumerate(pos):
            a, b = offs[j], offs[j + 1]
            out[p] = (t["input_ids"][a:b].tolist(), t["features"][a:b])
    return idx, out


def test_vllm_capture_equals_ours(tmp_path):
    from dflash.engine.targets import engine_target

    target = engine_target("tiny-qwen3")
    hf, vl = tmp_path / "hf", tmp_path / "vllm"
    run_dflash("capture", "--target", target, "--out", hf, *SMALL)
    t0 = time.perf_counter()
    p = run_dflash("capture", "--target", target, "--out", vl, "--engine", "vllm", *SMALL)
    print(f"\n--engine vllm: {time.perf_counter() - t0:.1f} s\n{p.stderr.strip().splitlines()[-3:]}")
    (ia, a), (ib, b) = _by_sample(hf), _by_sample(vl)
    assert ib["key"]["engine"] == "vllm" and "engine" not in ia["key"]
    assert {k: ia[k] for k in ("samples", "tokens", "feature_dim")} == {k: ib[k] for k in ("samples", "tokens",
                                                                                          "feature_dim")}
    assert sorted(a) == sorted(b) and len(a) >= 3
    worst = 0.0
    for pos in a:
        assert a[pos][0] == b[pos][0]  # the same token ids
        worst = max(worst, (a[pos][1] - b[pos][1]).abs().max().item())
        assert torch.allclose(a[pos][1], b[pos][1], rtol=1e-4, atol=1e-5), pos
    print(f"{len(a)} samples, {ia['tokens']} tokens, feature_dim {ia['feature_dim']}: max |HF - vLLM| = {worst:.3g}")

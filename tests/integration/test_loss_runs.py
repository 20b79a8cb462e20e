"""train.loss and train.loss_weights in real runs (tests/unit/test_losses.py has the
arithmetic): KL and D-PACE train with loss histories that differ from CE with the decay, and
a capture's top-k log-probs train as the online target's do."""
from __future__ import annotations

import json
import math

import pytest

from helpers import TINY, cli_before_torch, run_dflash


def _history(run):
    return [h[1] for h in json.loads((run / "checkpoint" / "trainer_state.json").read_text())["history"]]


def test_kl_and_dpace_train_and_differ_from_ce(tmp_path):
    common = ["--target", "tiny-qwen3", "--steps", 3, "--no-telemetry", *TINY]
    hist = {}
    for name, sets in (("ce", ["--set", "train.loss_weights=decay"]),
                       ("kl", ["--set", "train.loss=kl", "--set", "train.loss_weights=decay"]),
                       ("dpace", ["--set", "train.loss_weights=dpace"])):
        run_dflash("train", "--out", tmp_path / name, *common, *sets)
        hist[name] = _history(tmp_path / name)
        assert len(hist[name]) == 3 and all(math.isfinite(v) for v in hist[name])
    assert hist["kl"] != hist["ce"] and hist["dpace"] != hist["ce"]


def test_a_capture_keeps_the_top_k_and_trains_as_online(tmp_path):
    """`dflash capture --set train.loss=kl` keeps each token's top-k next-token log-probs (fp16 +
    int32 ids: 6 bytes each), and a KL run from it follows the online KL run (same top-k)."""
    feats, kl = tmp_path / "feats", ["--set", "train.loss=kl", "--set", "train.kl_topk=8"]
    run_dflash("capture", "--target", "tiny-qwen3", "--out", feats, *TINY, *kl)
    idx = json.loads((feats / "index.json").read_text())
    assert idx["kl_topk"] == 8 and idx["kl_bytes_per_token"] == 48 and idx["key"]["kl_topk"] == 8
    common = ["--steps", 3, "--no-telemetry", *TINY, *kl]
    run_dflash("train", "--features", feats, "--out", tmp_path / "offline", *common)
    run_dflash("train", "--target", "tiny-qwen3", "--out", tmp_path / "online", *common)
    a, b = _history(tmp_path / "online"), _history(tmp_path / "offline")
    assert a == pytest.approx(b, rel=1e-2), (a, b)  # the capture's log-probs are fp16 (2e-3 seen)
    # asking for more of the distribution than the capture kept: one line, before torch
    out, lines = cli_before_torch("train", "--features", feats, "--out", tmp_path / "x", *common,
                                  "--set", "train.kl_topk=16")
    assert out == {"rc": 2, "torch": False} and "kept the top 8" in lines[0], lines

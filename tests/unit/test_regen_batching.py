"""Regeneration goes in length-sorted batches of a configurable size (wide on CUDA)."""
from types import SimpleNamespace

import pytest
import torch

from dflash.prep import prepare as prep
from dflash.prep import regenerate as regen_mod
from dflash.config import load_config
from dflash.errors import ConfigError


@pytest.mark.parametrize("setting,device,expected", [(5, "cpu", 5), (0, "cpu", 16), (0, "cuda:0", 64)])
def test_regen_batch_size_reaches_regenerate(tmp_path, monkeypatch, setting, device, expected):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    seen = {}

    def fake_regenerate(model, tok, convs, **kw):
        seen.update(kw)
        return convs

    monkeypatch.setattr(prep, "regenerate", fake_regenerate)
    cfg = load_config(None, [f"data.regen_batch_size={setting}"])
    target = SimpleNamespace(config=SimpleNamespace(to_json_string=lambda: "{}"))
    prep._regen_cached(cfg, target, None, [[{"role": "user", "content": "hi"}]], device)
    assert seen["batch_size"] == expected
    # data.regen_workers auto: one per compute thread on a CPU (up to 8), one on CUDA
    assert seen["workers"] == (min(8, torch.get_num_threads()) if device == "cpu" else 1)


def test_regen_workers_reach_regenerate(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    seen = {}
    monkeypatch.setattr(prep, "regenerate", lambda model, tok, convs, **kw: seen.update(kw) or convs)
    cfg = load_config(None, ["data.regen_workers=3"])
    target = SimpleNamespace(config=SimpleNamespace(to_json_string=lambda: "{}"))
    prep._regen_cached(cfg, target, None, [[{"role": "user", "content": "hi"}]], "cpu")
    assert seen["workers"] == 3
    with pytest.raises(ConfigError, match="data.regen_workers=-1"):
        load_config(None, ["data.regen_workers=-1"])


def test_regenerate_batches_are_sorted_by_length(monkeypatch, tiny):
    """The real regeneration on tiny-qwen3, with a spy that records each batch's prompt
    lengths on the way to the real batched generate."""
    model, tok = tiny
    widths, real = [], regen_mod._generate_left_padded

    def spy(model, prompts, *a, **kw):
        widths.append([len(p) for p in prompts])
        return real(model, prompts, *a, **kw)

    monkeypatch.setattr(regen_mod, "_generate_left_padded", spy)
    convs = [[{"role": "user", "content": "word " * n}] for n in (30, 2, 17, 9, 25, 4, 11)]
    out = regen_mod.regenerate(model, tok, convs, max_new_tokens=1, batch_size=3)
    assert len(out) == len(convs) and all(c[-1]["role"] == "assistant" for c in out)
    assert [len(w) for w in widths] == [3, 3, 1]
    flat = [x for w in widths for x in w]
    assert flat == sorted(flat), "batches must go shortest to longest (little left padding)"


def test_negative_regen_batch_size_is_refused():
    with pytest.raises(ConfigError, match="data.regen_batch_size=-1"):
        load_config(None, ["data.regen_batch_size=-1"])


def test_warm_up_is_a_no_op_on_cpu_and_runs_when_forced(capsys, tiny):
    from dflash.model.warmup import warm_up

    model, _ = tiny
    assert warm_up(model, batch_size=2, seq_len=8) is None  # nothing to compile on the CPU
    secs = warm_up(model, batch_size=2, seq_len=8, force=True)  # the CUDA code path, on the CPU
    assert secs is not None and secs >= 0
    assert "outside every timed region" in capsys.readouterr().err

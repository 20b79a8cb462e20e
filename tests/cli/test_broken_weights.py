"""Broken weights and values never reach a decoder, a trainer or an engine (issue 46): a drafter
dir whose weights hold NaN or Inf, whose `d2t` points past the vocabulary, whose weights or
config are a FIFO or a device, whose DFlash2 floats are not finite or whose sliding window is
10^12 is one line and exit 2 from `eval`, `serve` and `train --init-from`, before torch loads
(the target's rows, which a d2t must also fit, are known once the target is: one line then).
Each test damages a real drafter dir the way it arrives broken: a copy of a written export."""
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from helpers import TINY, cli_before_torch, free_port, run_dflash, served_drafter


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return served_drafter(tmp_path_factory.mktemp("broken") / "drafter")


def _commands(d: Path, tmp: Path) -> dict:
    """Every command that reads a drafter dir, as a user runs it on this one."""
    return {"eval": ["eval", "--checkpoint", d, "--target", "tiny-qwen3", "--temperature", "1"],
            "serve": ["serve", d, "--target", "tiny-qwen3", "--port", free_port()],
            "init-from": ["train", "--out", tmp / "run", "--target", "tiny-qwen3", "--init-from", d, *TINY,
                          "--set", "data.regenerate=off", "--steps", 1, "--no-telemetry"]}


# serve checks that an engine venv exists before it reads the drafter; any python stands in
# (the drafter is refused before it would be started)
_ENV = {"DFLASH_VLLM_PYTHON": sys.executable}


def _refused_before_torch(d: Path, tmp: Path, needle: str, commands=("eval", "serve", "init-from"), timeout=120):
    for name in commands:
        out, lines = cli_before_torch(*_commands(d, tmp)[name], env=_ENV, timeout=timeout)
        assert out == {"rc": 2, "torch": False} and len(lines) == 1, (name, lines)
        assert needle in lines[0], (name, lines)
    assert not (tmp / "run").exists()


def _rewrite(d: Path, change) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    t = load_file(str(d / "model.safetensors"))
    change(t, torch)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})


# ------------------------------------------------------------------------- finite weights
@pytest.mark.parametrize("dtype,bad", [("float32", "nan"), ("bfloat16", "inf")])
def test_weights_that_hold_nan_or_inf_are_one_line_naming_the_tensor(tmp_path, served, dtype, bad):
    """On main: eval at T > 0 ended in a "probability tensor" traceback, --init-from trained
    nan -> nan and exported a NaN drafter, serve served it."""
    d = Path(shutil.copytree(served, tmp_path / "d"))

    def poison(t, torch):
        for k in t:
            t[k] = t[k].to(getattr(torch, dtype))
        w = t["layers.0.mlp.up_proj.weight"]
        w.view(-1)[[3, 70]] = float(bad)

    _rewrite(d, poison)
    nan, inf = (2, 0) if bad == "nan" else (0, 2)
    _refused_before_torch(d, tmp_path, f"model.safetensors: tensor 'layers.0.mlp.up_proj.weight' holds {nan} NaN "
                                       f"and {inf} Inf of its 131072 values")


def test_a_nan_training_checkpoint_is_refused_by_eval_export_and_resume(tmp_path):
    """Our own checkpoint format too (a run that diverged): nothing reads its NaN weights."""
    import torch

    from dflash.checkpoint import checkpoint as ckpt
    from dflash.model.drafter import DFlashDrafter, DrafterConfig
    from dflash.model.target import _tiny_config, load_tokenizer

    tc = _tiny_config("tiny-qwen3", load_tokenizer("tiny-qwen3"))
    drafter = DFlashDrafter(DrafterConfig.from_target(tc, target_layer_ids=[1, 3], vocab_size=tc.vocab_size,
                                                      mask_token_id=16, block_size=4))
    with torch.no_grad():
        drafter.fc.weight[0, 0] = float("nan")
    from dflash.preflight import run_dir
    run_dir.claim(str(tmp_path / "run"), resume=False, overwrite=False)
    ck = ckpt.save(tmp_path / "run" / "checkpoint", drafter, run_config={"model": {"target": "tiny-qwen3"}},
                   state={"step": 1})
    for cmd in (["eval", "--checkpoint", ck], ["export", "--checkpoint", ck, "--out", tmp_path / "exp"],
                ["train", "--out", tmp_path / "run", "--resume", "--target", "tiny-qwen3"]):
        out, lines = cli_before_torch(*cmd)
        assert out == {"rc": 2, "torch": False} and len(lines) == 1, lines
        assert "tensor 'fc.weight' holds 1 NaN and 0 Inf" in lines[0], lines
    assert not (tmp_path / "exp").exists()


# ----------------------------------------------------------------- d2t within the vocabulary
def _draft_vocab_export(path: Path) -> Path:
    """A served drafter with a draft vocabulary of 12 tokens (`lm_head.weight` + `d2t`)."""
    import torch

    from dflash.checkpoint.export import write_export
    from dflash.model.drafter import DFlashDrafter, DrafterConfig
    from dflash.model.target import _tiny_config, load_tokenizer

    tc = _tiny_config("tiny-qwen3", load_tokenizer("tiny-qwen3"))
    cfg = DrafterConfig.from_target(tc, target_layer_ids=[1, 3], vocab_size=tc.vocab_size, mask_token_id=16,
                                    block_size=4, draft_vocab_size=12)
    torch.manual_seed(1)
    d = DFlashDrafter(cfg)
    d.set_draft_vocab(torch.arange(100, 112), torch.nn.Linear(tc.hidden_size, tc.vocab_size, bias=False))
    return write_export(d, tc, path, dtype="float32", target="tiny-qwen3")


@pytest.fixture(scope="module")
def vocab_export(tmp_path_factory):
    return _draft_vocab_export(tmp_path_factory.mktemp("d2t") / "drafter")


@pytest.mark.parametrize("entry,token", [(5, 49152 + 7), (0, -1)])
def test_a_d2t_entry_outside_the_vocabulary_is_one_line_before_torch(tmp_path, vocab_export, entry, token):
    """On main: eval ended in an index traceback; serve became ready and its first request
    killed the engine (EngineDeadError, HTTP 500). d2t holds offsets: token = id + d2t[id]."""
    d = Path(shutil.copytree(vocab_export, tmp_path / "d"))

    def point_out(t, torch):
        t["d2t"][entry] = token - entry

    _rewrite(d, point_out)
    _refused_before_torch(d, tmp_path, f"d2t maps draft id {entry} to token {token}, outside the vocabulary "
                                       f"(vocab_size=49152 in config.json)")


@pytest.mark.slow  # three commands that load the target: ~1 min
def test_a_d2t_that_fits_its_config_but_not_the_target_is_one_line(tmp_path, vocab_export):
    """A config whose vocab_size claims more rows than the target has: the d2t is read before
    torch, checked against the target's rows once they are known, before any decode."""
    d = Path(shutil.copytree(vocab_export, tmp_path / "d"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 60000
    (d / "config.json").write_text(json.dumps(cfg))
    _rewrite(d, lambda t, torch: t["d2t"].__setitem__(4, 50000 - 4))
    for name in ("eval", "serve", "init-from"):
        p = run_dflash(*_commands(d, tmp_path)[name], env=_ENV, check=False, timeout=300)
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]  # train says what data it read first
        assert p.returncode == 2 and "Traceback" not in p.stderr, (name, p.stderr[-2000:])
        assert "d2t maps draft id 4 to token 50000, outside the target's 49152 embedding rows" in lines[-1], lines


# ------------------------------------------------------------------------ regular files only
@pytest.mark.parametrize("what", ["fifo weights", "fifo config", "device weights", "directory weights"])
def test_a_fifo_or_a_device_in_a_drafter_dir_is_one_line_never_opened(tmp_path, served, what):
    """On main: a FIFO in place of model.safetensors hung eval forever at start-up."""
    d = Path(shutil.copytree(served, tmp_path / "d"))
    name = "config.json" if what == "fifo config" else "model.safetensors"
    (d / name).unlink()
    if what.startswith("fifo"):
        os.mkfifo(d / name)
    elif what.startswith("device"):
        os.symlink("/dev/zero", d / name)
    else:
        (d / name).mkdir()
    _refused_before_torch(d, tmp_path, f"{name} is not a regular file", timeout=60)


def test_read_json_and_safetensors_headers_never_open_a_fifo(tmp_path):
    """The readers every JSON file and safetensors header go through (a target's config.json,
    an index, a capture's shard): a FIFO is refused without a blocking open."""
    from dflash.errors import ConfigError
    from dflash.preflight.inputs import NotRegularFile, read_json, read_safetensors_header

    f = tmp_path / "x"
    os.mkfifo(f)
    with pytest.raises(ConfigError, match="x is not a regular file"):
        read_json(f, "label", ConfigError)
    with pytest.raises(NotRegularFile):
        read_safetensors_header(f)


# --------------------------------------------------------- DFlash2 floats, the sliding window
@pytest.fixture(scope="module")
def dflash2_export(tmp_path_factory):
    import torch

    from dflash.checkpoint.export import write_export
    from dflash.model.architectures import make_drafter
    from dflash.model.drafter import DrafterConfig
    from dflash.model.target import _tiny_config, load_tokenizer

    tc = _tiny_config("tiny-qwen3", load_tokenizer("tiny-qwen3"))
    cfg = DrafterConfig.from_target(tc, target_layer_ids=[1, 3], vocab_size=tc.vocab_size, mask_token_id=16,
                                    block_size=4, arch="dflash2", selector_rank=4, selector_top_k=4)
    torch.manual_seed(1)
    return write_export(make_drafter(cfg), tc, tmp_path_factory.mktemp("dflash2") / "drafter", dtype="float32",
                        target="tiny-qwen3")


@pytest.mark.parametrize("key,value", [("output_multiplier", float("nan")), ("final_logit_softcapping", float("inf")),
                                       ("input_embedding_scale", -float("inf"))])
def test_dflash2_floats_that_are_not_finite_are_one_line(tmp_path, dflash2_export, key, value):
    d = Path(shutil.copytree(dflash2_export, tmp_path / "d"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"][key] = value  # json writes NaN / Infinity, and Python's reader takes them
    (d / "config.json").write_text(json.dumps(cfg))
    _refused_before_torch(d, tmp_path, f"{key}={value!r}: expected a finite number in")


def test_a_sliding_window_of_10_to_the_12_is_one_line(tmp_path, served):
    d = Path(shutil.copytree(served, tmp_path / "d"))
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(layer_types=["sliding_attention"], sliding_window=10**12, use_sliding_window=True, is_causal=False)
    cfg["dflash_config"].update(swa_window_size=10**12, causal=False)
    (d / "config.json").write_text(json.dumps(cfg))
    _refused_before_torch(d, tmp_path, "sliding_window=1000000000000: expected an integer in [0, 16777216]")


# ------------------------------------------------------------------ sizes against the machine
@pytest.mark.slow  # loads the target (and the data set) first: ~20-30 s on two busy cores
def test_a_drafter_too_large_for_the_machine_is_one_line_before_it_is_allocated(tmp_path):
    """On main: model.selector_rank=65536 (in range) was OOM-killed (rc 137, 16 GB RSS, no word).
    With 128 layers of ungrouped 1024-tap convolutions besides, ~650 GB: no test machine has it.
    A tap reads a slot of its own block, so 1024 taps take a block of 1024 (and data.max_len above two blocks)."""
    sets = ["model.arch=dflash2", "model.selector_rank=65536", "model.num_layers=128", "model.conv_group_size=1",
            "model.conv_kernel_size=1024", "model.block_size=1024", "data.max_len=2100"]
    p = run_dflash("train", "--out", tmp_path / "run", "--target", "tiny-qwen3", *TINY, "--set", "data.regenerate=off",
                   "--no-telemetry", *[x for s in sets for x in ("--set", s)], check=False, timeout=300)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    m = re.search(r"the drafter has ([\d,]+) parameters: training it needs about ([\d.]+) GiB more", lines[-1])
    assert m and int(m[1].replace(",", "")) > 40e9 and float(m[2]) > 600, lines
    assert "the host has" in lines[-1] and "available (MemAvailable)" in lines[-1], lines

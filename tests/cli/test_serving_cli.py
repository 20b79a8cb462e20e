"""`dflash export`, `eval --temperature`, `train --init-from`: the command-line paths and
their bad-input lines (one line, exit 2, before torch where the input alone tells)."""
import json

import pytest
import torch

from helpers import TINY, cli_before_torch, run_dflash

def _probe(*args):
    out, lines = cli_before_torch(*args, heavy=True, timeout=120)
    return out, "\n".join(lines)


def _write_served(path, *, block_size=4, layers=2):
    """A random drafter for tiny-qwen3 in the served format (what a download would be)."""
    from dflash.checkpoint.export import write_export
    from dflash.model.drafter import DFlashDrafter, DrafterConfig
    from dflash.model.target import _tiny_config, load_tokenizer

    tc = _tiny_config("tiny-qwen3", load_tokenizer("tiny-qwen3"))
    cfg = DrafterConfig.from_target(tc, target_layer_ids=[1, 3], vocab_size=tc.vocab_size, mask_token_id=16,
                                    block_size=block_size, num_hidden_layers=layers)
    torch.manual_seed(1)
    return write_export(DFlashDrafter(cfg), tc, path, dtype="float32", target="tiny-qwen3")


@pytest.mark.parametrize("args,needle", [
    (["--temperature", "-0.5"], "--temperature=-0.5"),
    (["--temperature", "0.7", "--top-p", "0"], "--top-p=0.0"),
    (["--temperature", "nan"], "--temperature=nan"),
    (["--top-k", "-1"], "--top-k=-1"),
])
def test_bad_sampling_settings_fail_before_torch(tmp_path, args, needle):
    out, err = _probe("eval", "--checkpoint", tmp_path, *args)
    assert out == {"rc": 2, "heavy": []}, (out, err)
    assert needle in err and err.strip().count("\n") == 0


def test_served_dir_without_target_and_export_checks_fail_before_torch(tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    (served / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
                                                    "hidden_size": 256, "num_attention_heads": 4,
                                                    "num_hidden_layers": 1, "intermediate_size": 512,
                                                    "vocab_size": 49152, "dflash_config": {
                                                        "target_layer_ids": [1], "mask_token_id": 16}}))
    header = json.dumps({"fc.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (served / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)  # whole
    out, err = _probe("eval", "--checkpoint", served)
    assert out == {"rc": 2, "heavy": []} and "--target" in err, err
    ours = tmp_path / "run" / "checkpoint"
    ours.mkdir(parents=True)
    (ours / "config.json").write_text(json.dumps({"architectures": ["DFlashDrafter"], "copy_head": True}))
    out, err = _probe("export", "--checkpoint", ours, "--out", tmp_path / "x")
    assert out == {"rc": 2, "heavy": []} and "copy head" in err and "--without-copy-head" in err, err
    out, err = _probe("export", "--checkpoint", served, "--out", tmp_path / "x")
    assert out == {"rc": 2, "heavy": []} and "already in the served DFlash format" in err, err
    out, err = _probe("train", "--out", tmp_path / "r", "--init-from", tmp_path / "nothing")
    assert out == {"rc": 2, "heavy": []} and "nothing" in err, err


@pytest.mark.slow
def test_init_from_a_served_drafter_then_eval_at_temperature(tmp_path):
    """--init-from takes the served drafter's shape and weights (0 steps: exactly them);
    the after-training eval samples at eval.temperature and reports replayable steps."""
    served = _write_served(tmp_path / "served")
    run = tmp_path / "run"
    run_dflash("train", "--out", run, "--target", "tiny-qwen3", "--steps", 0, "--no-telemetry", *TINY,
               "--init-from", served, "--eval", "--set", "eval.before=false", "--set", "eval.prompts=2",
               "--set", "eval.max_new_tokens=10", "--set", "eval.temperature=0.7", "--set", "eval.top_k=50",
               env={"OMP_NUM_THREADS": "1"})
    ck = json.loads((run / "checkpoint" / "config.json").read_text())
    assert ck["block_size"] == 4 and ck["num_hidden_layers"] == 2 and ck["target_layer_ids"] == [1, 3]
    from safetensors.torch import load_file
    a, b = load_file(str(served / "model.safetensors")), load_file(str(run / "export" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k].bfloat16(), b[k]) for k in a)
    ev = json.loads((run / "summary.json").read_text())["eval_after"]
    assert ev["temperature"] == 0.7 and ev["top_k"] == 50 and ev["lossless"] is None
    steps = ev["per_prompt_steps"]
    assert len(steps) == 2 and all(1 <= x <= 4 for s in steps for x in s["acceptance_lengths"])
    assert all(s["prompt_ids"] for s in steps)


@pytest.mark.slow
def test_export_without_copy_head_and_a_misfit_drafter(tmp_path):
    run = tmp_path / "run"
    run_dflash("train", "--out", run, "--target", "tiny-qwen3", "--steps", 2, "--no-telemetry", *TINY,
               "--set", "model.copy_head=true", env={"OMP_NUM_THREADS": "1"})
    s = json.loads((run / "summary.json").read_text())
    assert "copy head" in s["export"]["skipped"] and not (run / "export").exists()
    p = run_dflash("export", "--checkpoint", run / "checkpoint", "--out", tmp_path / "x", "--without-copy-head")
    assert "without its copy head" in p.stdout
    names = json.loads((tmp_path / "x" / "config.json").read_text())
    assert names["dflash_config"]["block_size"] == 8
    # a served drafter wider than the target: one line naming the mismatch, exit 2
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    cfg["hidden_size"] = 128
    (tmp_path / "x" / "config.json").write_text(json.dumps(cfg))
    p = run_dflash("eval", "--checkpoint", tmp_path / "x", "--target", "tiny-qwen3", check=False)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0, p.stderr
    assert "hidden_size" in p.stderr


def test_side_by_side_wandb_summary_names_every_drafter(monkeypatch, tmp_path):
    from dflash import trackers
    from dflash.checkpoint.drafter_dirs import DrafterDir
    from dflash.commands import eval as eval_command

    calls = []
    monkeypatch.setattr(trackers, "log_eval", lambda run_dir, res, names, **kw: calls.append((run_dir, res, kw)))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".dflash-run").write_text("{}")  # a training run dir: the figures go there
    dirs = [DrafterDir(tmp_path / "run" / "checkpoint", "checkpoint", {}), DrafterDir(tmp_path / "pub", "export", {})]
    results = [{"checkpoint": str(d.path), "acceptance_length": t, "tokens_per_s": 9.0, "lossless": True}
               for d, t in zip(dirs, (2.5, 3.5))]
    eval_command.log_trackers(dirs, results, ["wandb"])
    (run_dir, _, kw), = calls
    assert run_dir == tmp_path / "run"  # the training run's W&B run gets the comparison
    assert kw["summary"]["compare/0/tau"] == 2.5 and kw["summary"]["compare/1/tau"] == 3.5
    assert kw["summary"]["compare/1/checkpoint"] == str(tmp_path / "pub")


def test_serve_refuses_a_busy_port_and_a_training_checkpoint_in_one_line(tmp_path):
    """Bad input for `dflash serve` is one line and exit 2, before any engine starts."""
    import socket

    from helpers import cli_before_torch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out, err = cli_before_torch("serve", str(tmp_path), "--target", "tiny-qwen3", "--port", port)
    assert out["rc"] == 2 and len(err) == 1 and f"127.0.0.1:{port} is busy" in err[0], err
    out, err = cli_before_torch("serve", str(tmp_path / "missing"), "--target", "tiny-qwen3", "--port", 1)
    assert out["rc"] == 2 and len(err) == 1, err

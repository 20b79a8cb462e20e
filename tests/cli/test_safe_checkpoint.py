"""Nothing loaded from disk runs code, and a checkpoint that does not fit is one line.

- training state is written as safetensors + JSON (no pickle); an earlier version's
  training_state.pt is read with torch's weights-only loader, so a crafted one is refused;
- resume checks the checkpoint against the run (target, block size, layers, layer ids)
  from its config.json, before torch loads;
- `dflash eval` on a missing, corrupt or truncated checkpoint: one line, before torch.
"""
import json
import struct
import subprocess
import sys

import pytest

from helpers import TINY, cli_before_torch, run_dflash

def _safetensors(path, *, cut: int = 0):
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    data = struct.pack("<Q", len(header)) + header + b"\0" * 8
    path.write_bytes(data[:len(data) - cut] if cut else data)


def _fake_run(out, *, target="tiny-llama", block_size=8, layers=1, layer_ids=(1, 2, 3), extra=None, train=None):
    """A run dir as dflash train leaves it, written by hand (no torch needed)."""
    from dflash.preflight import run_dir
    run_dir.claim(str(out), resume=False, overwrite=False)
    ck = out / "checkpoint"
    ck.mkdir()
    (ck / "config.json").write_text(json.dumps({
        "block_size": block_size, "num_hidden_layers": layers, "target_layer_ids": list(layer_ids),
        "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "intermediate_size": 512, "vocab_size": 49152, "mask_token_id": 0, "model_type": "dflash_drafter",  # as train writes
        "copy_head": False, "target": target, **(extra or {}),
        "dflash_run": {"model": {"target": target, "target_seed": 0}, "train": train or {}}}))
    _safetensors(ck / "model.safetensors")
    (ck / "trainer_state.json").write_text(json.dumps({"step": 1}))
    return ck


@pytest.mark.parametrize("args,needle", [
    (["--target", "tiny-qwen3"], "model.target: the checkpoint was trained for target 'tiny-llama'"),
    (["--target", "tiny-llama", "--set", "model.block_size=4"], "model.block_size: the checkpoint has 8, this run 4"),
    (["--target", "tiny-llama", "--set", "model.num_layers=2"], "model.num_layers"),
    (["--target", "tiny-llama", "--set", "model.target_layer_ids=1,2"], "model.target_layer_ids"),
    (["--target", "tiny-llama", "--set", "model.num_target_layers=2"], "model.target_layer_ids"),
    (["--target", "tiny-llama", "--set", "model.target_seed=3"], "model.target_seed"),
])
def test_resume_refuses_a_checkpoint_trained_for_something_else(tmp_path, args, needle):
    _fake_run(tmp_path / "run")
    out, lines = cli_before_torch("train", "--out", tmp_path / "run", "--resume", *TINY, *args)
    assert out == {"rc": 2, "torch": False} and len(lines) == 1 and needle in lines[0], lines


@pytest.mark.parametrize("edit,needle", [
    (lambda c: c.update(dflash_run="x"), "dflash_run='x': expected a mapping (the run's config)"),
    (lambda c: c["dflash_run"]["model"].update(target=["tiny-llama"]), "dflash_run.model.target="),
    (lambda c: c["dflash_run"].update(train="x"), "dflash_run.train='x': expected a mapping"),
    (lambda c: c["dflash_run"]["train"].update(lr="fast"), "dflash_run.train.lr='fast': expected float"),
    (lambda c: c.pop("block_size"), "config.json lacks block_size"),  # was read as the default 16
])
def test_a_checkpoint_config_edited_out_of_shape_is_one_line(tmp_path, edit, needle):
    """Hand edits that were an AttributeError or TypeError from whoever read the field first,
    or (block_size deleted) a silent default, for --resume, eval and export alike."""
    ck = _fake_run(tmp_path / "run")
    cfg = json.loads((ck / "config.json").read_text())
    edit(cfg)
    (ck / "config.json").write_text(json.dumps(cfg))
    for cmd in (["train", "--out", tmp_path / "run", "--resume", *TINY], ["eval", "--checkpoint", ck],
                ["export", "--checkpoint", ck, "--out", tmp_path / "exp"]):
        out, lines = cli_before_torch(*cmd)
        assert out == {"rc": 2, "torch": False} and len(lines) == 1 and needle in lines[0], (cmd, lines)


@pytest.mark.parametrize("edit,needle", [
    ({"step": -3}, "step=-3: expected a whole number of steps >= 0"),  # hung the prefetch worker for ever
    ({"step": 4.5}, "step=4.5: expected a whole number"),
    ({"step": "1"}, "step='1': expected a whole number"),
    ({"torch_rng": None}, "torch_rng=None: expected a tensor"),  # was a KeyError
    ({"scheduler": "x"}, "scheduler=x: expected a mapping"),  # was an AttributeError
    ({"step": 10**12}, "the checkpoint is at step 1,000,000,000,000, past train.steps=200"),  # was exit 0, untrained
])
def test_a_training_state_edited_out_of_shape_is_one_line_before_torch(tmp_path, edit, needle):
    ck = _fake_run(tmp_path / "run")
    tree = {"optimizer": {"state": {}, "param_groups": []}, "scheduler": {"last_epoch": 1}, "step": 1,
            "torch_rng": {"__tensor__": "t0"}}
    (ck / "training_state.json").write_text(json.dumps({**tree, **edit}))
    out, lines = cli_before_torch("train", "--out", tmp_path / "run", "--resume", "--target", "tiny-llama", *TINY)
    assert out == {"rc": 2, "torch": False} and len(lines) == 1 and needle in lines[0], lines


@pytest.mark.parametrize("extra,train,args,needle", [
    ({}, {}, ["--set", "model.arch=dspark"], "model.arch: the checkpoint is a dflash drafter, this run builds a dspark"),
    ({"arch": "dspark", "markov_rank": 16, "confidence_head": False, "confidence_with_markov": False}, {},
     ["--set", "model.arch=dspark", "--set", "model.markov_rank=32"], "model.markov_rank: the checkpoint has 16"),
    ({}, {"optimizer": "adamw"}, ["--set", "train.optimizer=muon"],
     "train.optimizer: the checkpoint was trained with adamw, this run uses muon"),
])
def test_resume_refuses_another_family_or_optimizer_before_torch(tmp_path, extra, train, args, needle):
    _fake_run(tmp_path / "run", extra=extra, train=train)
    out, lines = cli_before_torch("train", "--out", tmp_path / "run", "--resume", "--target", "tiny-llama", *TINY, *args)
    assert out == {"rc": 2, "torch": False} and len(lines) == 1 and needle in lines[0], lines


def test_resume_needs_a_whole_checkpoint(tmp_path):
    ck = _fake_run(tmp_path / "run")
    _safetensors(ck / "model.safetensors", cut=3)
    out, lines = cli_before_torch("train", "--out", tmp_path / "run", "--resume", "--target", "tiny-llama", *TINY)
    assert out == {"rc": 2, "torch": False} and "truncated" in lines[0], lines


@pytest.mark.parametrize("damage,needle", [
    ("config", "config.json is not readable JSON"),
    ("truncate", "model.safetensors is truncated"),
    ("header", "model.safetensors is corrupt"),
    ("missing", "no model.safetensors"),
    ("file", "is a file"),
])
def test_eval_of_a_broken_checkpoint_is_one_line_before_torch(tmp_path, damage, needle):
    ck = _fake_run(tmp_path / "run")
    if damage == "config":
        (ck / "config.json").write_bytes(b'{"block_size": 8, \xff')
    elif damage == "truncate":
        _safetensors(ck / "model.safetensors", cut=5)
    elif damage == "header":
        (ck / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    elif damage == "missing":
        (ck / "model.safetensors").unlink()
    else:
        ck = tmp_path / "afile"
        ck.write_text("x")
    out, lines = cli_before_torch("eval", "--checkpoint", ck)
    assert out == {"rc": 2, "torch": False} and len(lines) == 1 and needle in lines[0], lines


_EVIL = """
import os, pickle, sys
class Evil:
    def __reduce__(self):
        return (os.system, ("touch " + sys.argv[2],))
with open(sys.argv[1], "wb") as f:
    pickle.dump({"step": 1, "optimizer": Evil()}, f)
"""


@pytest.mark.slow
def test_training_state_is_written_without_pickle(trained):
    ck = trained / "checkpoint"
    names = sorted(p.name for p in ck.iterdir())
    assert names == ["config.json", "model.safetensors", "trainer_state.json", "training_state.json",
                     "training_state.safetensors"]
    for p in ck.iterdir():  # no file is a pickle (0x80) or a torch.save zip (PK)
        assert p.read_bytes()[:2] not in (b"PK",) and p.read_bytes()[:1] != b"\x80", p


@pytest.mark.slow
def test_a_crafted_pickle_in_a_checkpoint_runs_nothing(trained, tmp_path):
    import shutil
    run = tmp_path / "shared"
    shutil.copytree(trained, run)
    ck = run / "checkpoint"
    (ck / "training_state.json").unlink()
    (ck / "training_state.safetensors").unlink()
    pwned = tmp_path / "pwned"
    subprocess.run([sys.executable, "-c", _EVIL, str(ck / "training_state.pt"), str(pwned)], check=True)
    steps = json.loads((run / "summary.json").read_text())["steps"] + 1
    p = run_dflash("train", "--out", run, "--target", "tiny-qwen3", "--steps", steps, "--no-telemetry", *TINY,
                   "--resume", check=False, timeout=300)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and "interrupt" not in ln]
    assert not pwned.exists(), "the checkpoint's pickle ran a command"
    assert p.returncode == 2 and "refuses to unpickle" in lines[-1], p.stderr[-2000:]


@pytest.mark.slow
def test_an_earlier_versions_plain_training_state_still_resumes(trained, tmp_path):
    """Checkpoints from before this format (torch.save of tensors and plain values) load
    through the weights-only loader: nothing to convert."""
    import shutil

    import torch

    from dflash.checkpoint import state_tree
    run = tmp_path / "old"
    shutil.copytree(trained, run)
    ck = run / "checkpoint"
    tree = state_tree.load(ck / "training_state.safetensors", ck / "training_state.json")
    torch.save(tree, ck / "training_state.pt")
    (ck / "training_state.json").unlink()
    (ck / "training_state.safetensors").unlink()
    steps = json.loads((run / "summary.json").read_text())["steps"] + 1
    run_dflash("train", "--out", run, "--target", "tiny-qwen3", "--steps", steps, "--no-telemetry", *TINY, "--resume")
    assert json.loads((run / "summary.json").read_text())["steps"] == steps


def test_state_tree_round_trips_what_an_optimizer_holds(tmp_path):
    import math

    import torch

    from dflash.checkpoint import state_tree
    tree = {"optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 3)}},
                          "param_groups": [{"betas": (0.9, 0.999), "params": [0], "foreach": None}]},
            "rng": torch.get_rng_state(), "x": [float("inf"), float("-inf"), 1.5], "__odd": {"__tensor__": 1}}
    state_tree.save(tree, tmp_path / "t.safetensors", tmp_path / "t.json")
    back = state_tree.load(tmp_path / "t.safetensors", tmp_path / "t.json")
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], torch.ones(2, 3))
    assert torch.equal(back["rng"], tree["rng"]) and back["x"][:2] == [math.inf, -math.inf]
    assert back["__odd"] == {"__tensor__": 1}
    with pytest.raises(TypeError, match="without pickle"):
        state_tree.save({"f": object()}, tmp_path / "u.safetensors", tmp_path / "u.json")


def test_export_takes_the_checkpoint_old_a_killed_swap_leaves_as_resume_and_eval_do(tmp_path):
    """Issue 54: a kill between a save's two renames leaves only RUN/checkpoint.old; `train
    --resume` and `eval` read it (checkpoint_files.resolve), `export` said "no config.json there"."""
    from dflash.checkpoint import checkpoint as ckpt
    from dflash.model.drafter import DrafterConfig
    from dflash.model.architectures import make_drafter
    from dflash.model.target import _tiny_config, load_tokenizer

    tc = _tiny_config("tiny-qwen3", load_tokenizer("tiny-qwen3"))
    cfg = DrafterConfig.from_target(tc, target_layer_ids=[1, 3], vocab_size=tc.vocab_size, mask_token_id=16,
                                    block_size=4, num_hidden_layers=1)
    run = tmp_path / "run"
    run.mkdir()
    ckpt.save(run / "checkpoint.old", make_drafter(cfg), state={"step": 3},
              run_config={"model": {"target": "tiny-qwen3", "target_seed": 0}})
    p = run_dflash("export", "--checkpoint", run / "checkpoint", "--out", tmp_path / "export", "--dtype", "float32",
                   check=False)
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "export" / "config.json").read_text())["block_size"] == 4
    assert not (run / "checkpoint").exists() and (run / "checkpoint.old" / "config.json").is_file()  # read, not moved


def test_export_into_a_symbolic_link_is_refused_and_the_link_kept(tmp_path):
    """The export is renamed into place: `--out LINK` replaced the user's link with a directory
    and left the link's target empty, with exit 0."""
    ck = _fake_run(tmp_path / "run")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    out, lines = cli_before_torch("export", "--checkpoint", ck, "--out", tmp_path / "link")
    assert out == {"rc": 2, "torch": False} and len(lines) == 1 and "a symbolic link" in lines[0], lines
    assert (tmp_path / "link").is_symlink()


def test_a_resume_with_other_settings_keeps_the_earlier_config_and_names_the_change(tmp_path, capsys):
    from dflash.config import Config, dumps
    from dflash.run.trainer import _write_config

    first, second = Config(), Config()
    second.train.lr = first.train.lr * 2
    _write_config(tmp_path, first, 0)
    _write_config(tmp_path, first, 4)  # the same settings: nothing kept, nothing said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"] and not capsys.readouterr().err
    _write_config(tmp_path, second, 4)
    assert (tmp_path / "config.before-step4.yaml").read_text() == dumps(first)
    assert (tmp_path / "config.yaml").read_text() == dumps(second)
    assert f"train.lr: {first.train.lr!r} -> {second.train.lr!r}" in capsys.readouterr().err


def test_export_of_a_checkpoint_whose_target_is_gone_is_one_line_before_torch(tmp_path):
    """It read the target's config after torch had loaded: a hub id offline took 27 s of
    retries, a missing dir leaked the hub library's own error."""
    ck = _fake_run(tmp_path / "run", target=str(tmp_path / "no-such-model"))
    out, lines = cli_before_torch("export", "--checkpoint", ck, "--out", tmp_path / "exp")
    assert out == {"rc": 2, "torch": False} and len(lines) == 1, lines
    assert "its target: target" in lines[0] and "no such model directory" in lines[0], lines


def test_resume_beside_init_from_says_the_checkpoint_wins(tmp_path):
    """What `what_next` prints after a stop repeats the whole command, --init-from included: a
    resume continues from OUT/checkpoint, and says the other source is ignored."""
    import shutil

    ck = _fake_run(tmp_path / "run")
    other = shutil.copytree(ck, tmp_path / "published")
    out, lines = cli_before_torch("train", "--out", tmp_path / "run", "--resume", "--target", "tiny-llama",
                                  "--init-from", other, *TINY)
    assert out["torch"] is False and out["rc"] == 2, lines  # then refused: this test process holds the run
    said = [ln for ln in lines if "a resume continues from" in ln]
    assert len(said) == 1 and f"--init-from {other}" in said[0] and said[0].endswith("ignored"), lines

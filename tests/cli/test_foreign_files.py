"""Files from elsewhere (docs/failures.md): a target, tokenizer,
features or drafter dir someone else wrote never runs code; what dflash writes never
replaces what a user owns, and is readable by others; a drafter config is checked
against bounds and its safetensors header before anything is built. Each test uses the
attacker's file itself: a dir whose `auto_map` points at a module that leaves a mark when
imported, a real drafter whose config lies, a real run's telemetry."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, TINY, cli_before_torch, run_dflash

EVIL = """
import os, pathlib
pathlib.Path(os.environ["EVIL_MARK"]).write_text("this code ran")
"""


def _evil_dir(path: Path, mark: Path, config: dict | None = None) -> Path:
    """A model dir whose config asks transformers to run its own `evil.py`."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "evil.py").write_text(EVIL)
    cfg = config or {"model_type": "evilmodel", "num_hidden_layers": 4}
    cfg["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel",
                       "AutoTokenizer": ["evil.EvilTokenizer", None]}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _dflash_with_stdin(*args, mark: Path, stdin: str = "y\n", timeout=300):
    """The command line as a user in a pipeline runs it: "y" waiting on stdin."""
    env = dict(os.environ, EVIL_MARK=str(mark))
    return subprocess.run([sys.executable, "-m", "dflash", *map(str, args)], cwd=ROOT, env=env, input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def _lines(p) -> list[str]:
    return [ln for ln in p.stderr.splitlines() if ln.strip() and "%|" not in ln]


# -------------------------------------------------------------------------- no file runs code
@pytest.mark.parametrize("cmd", ["data", "train"])
def test_a_crafted_auto_map_in_a_target_dir_runs_nothing_even_with_yes_on_stdin(tmp_path, cmd):
    mark = tmp_path / "PWNED"
    target = _evil_dir(tmp_path / "target", mark)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"hi {i}"},
                                                          {"from": "gpt", "value": f"hello there {i}"}]}) + "\n"
                            for i in range(4)))
    args = (["data", "inspect", data, "--target", target] if cmd == "data" else
            ["train", "--out", tmp_path / "run", "--target", target, "--set", f"data.path={data}",
             "--no-telemetry"])
    p = _dflash_with_stdin(*args, mark=mark)
    lines = _lines(p)
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "auto_map" in lines[0] and "evil.EvilConfig" in lines[0] and "never runs" in lines[0], lines
    assert not mark.exists(), "the dir's code ran"
    assert "[y/N]" not in p.stdout + p.stderr  # transformers never asked


def test_a_tokenizer_config_auto_map_is_refused_by_name(tmp_path):
    """A target whose model type is real but whose tokenizer_config.json names its own class."""
    from transformers import AutoTokenizer

    from dflash.model.target import _smollm2_tokenizer_dir, from_pretrained
    from dflash.preflight.inputs import TargetSpecError

    mark = tmp_path / "PWNED"
    d = tmp_path / "target"
    shutil.copytree(_smollm2_tokenizer_dir(), d)
    (d / "evil.py").write_text(EVIL)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]})
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    os.environ["EVIL_MARK"] = str(mark)
    try:
        with pytest.raises(TargetSpecError, match="tokenizer_config.json's auto_map .*EvilTokenizer"):
            from_pretrained(AutoTokenizer, d, f"target '{d}'")
    finally:
        del os.environ["EVIL_MARK"]
    assert not mark.exists()


def test_a_served_drafter_with_an_auto_map_is_read_as_data(tmp_path):
    """z-lab's published drafters carry an auto_map for their own loader; ours reads the
    weights itself, so a crafted one is inert: the module is never imported."""
    from dflash.checkpoint import drafter_dirs

    exp = _served(tmp_path / "exp")
    mark = tmp_path / "PWNED"
    (exp / "evil.py").write_text(EVIL)
    cfg = json.loads((exp / "config.json").read_text())
    cfg["auto_map"] = {"AutoModel": "evil.DFlashDraftModel"}
    (exp / "config.json").write_text(json.dumps(cfg))
    os.environ["EVIL_MARK"] = str(mark)
    try:
        drafter = drafter_dirs.load(drafter_dirs.inspect(exp))
    finally:
        del os.environ["EVIL_MARK"]
    assert drafter.cfg.num_hidden_layers == 1 and not mark.exists()


# ------------------------------------------------------------------- sizes before allocating
def _served(path: Path, **kw) -> Path:
    import torch

    from dflash.checkpoint.export import write_export
    from dflash.model.drafter import DFlashDrafter, DrafterConfig
    from dflash.model.target import _tiny_config, load_tokenizer

    tc = _tiny_config("tiny-qwen3", load_tokenizer("tiny-qwen3"))
    cfg = DrafterConfig.from_target(tc, target_layer_ids=[1, 3], vocab_size=tc.vocab_size, mask_token_id=16,
                                    block_size=4, num_hidden_layers=1, **kw)
    torch.manual_seed(1)
    return write_export(DFlashDrafter(cfg), tc, path, dtype="float32", target="tiny-qwen3")


def _edit_config(d: Path, **changes) -> Path:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if k == "block_size":
            cfg["dflash_config"][k] = v
        cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return _served(tmp_path_factory.mktemp("served") / "exp")


@pytest.mark.parametrize("change,needle", [
    ({"num_hidden_layers": 100000}, "num_hidden_layers=100000: expected an integer in [1, 128]"),
    ({"intermediate_size": 1e12}, "intermediate_size=1000000000000.0: expected an integer"),  # a JSON float
    ({"num_attention_heads": 0}, "num_attention_heads=0"),
    ({"block_size": 0}, "block_size=0"),
    ({"block_size": -3}, "block_size=-3"),
    ({"block_size": 1}, "block_size=1: expected an integer in [2, 1024]"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps=nan"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ({"hidden_size": 65536, "intermediate_size": 1 << 20, "num_hidden_layers": 128}, "parameters (at most"),
    ({"architectures": 5}, "architectures=5: expected a list of names"),  # each was a traceback
    ({"architectures": "DFlashDraftModel"}, "architectures=DFlashDraftModel: expected a list of names"),
    ({"layer_types": "sliding_attention"}, "layer_types=sliding_attention: expected a list of names"),
])
def test_a_served_config_no_drafter_can_have_is_one_line_before_torch(tmp_path, served, change, needle):
    d = _edit_config(Path(shutil.copytree(served, tmp_path / "d")), **change)
    for cmd in (["eval", "--checkpoint", d, "--target", "tiny-qwen3"],
                ["train", "--out", tmp_path / "run", "--target", "tiny-qwen3", "--init-from", d]):
        out, lines = cli_before_torch(*cmd)
        assert out == {"rc": 2, "torch": False} and len(lines) == 1, (cmd, lines)
        assert needle in lines[0], lines


@pytest.mark.parametrize("lie,needle", [
    ("wider", "has shape [256, 512]; its config implies [256, 1024]"),
    ("extra", "tensor 'layers.7.mlp.up_proj.weight' is not part of the drafter"),
    ("int8", "has dtype 'I8'"),
    ("dup", "is a second copy of"),  # the later file by name won, silently
])
def test_a_config_that_disagrees_with_its_safetensors_header_is_one_line_before_building(tmp_path, served, lie,
                                                                                      needle):
    """The header, not the config, says what the file holds: checked before a module exists."""
    import torch
    from safetensors.torch import load_file, save_file

    from dflash.checkpoint import drafter_dirs

    d = Path(shutil.copytree(served, tmp_path / "d"))
    if lie == "wider":
        _edit_config(d, intermediate_size=1024)
    elif lie == "dup":
        shutil.copy(d / "model.safetensors", d / "z.safetensors")
    else:
        t = load_file(str(d / "model.safetensors"))
        if lie == "extra":
            t["layers.7.mlp.up_proj.weight"] = torch.zeros(2, 2)
        else:
            t["layers.0.mlp.up_proj.weight"] = t["layers.0.mlp.up_proj.weight"].to(torch.int8)
        save_file(t, str(d / "model.safetensors"))
    with pytest.raises(drafter_dirs.DrafterDirError) as e:
        drafter_dirs.load(drafter_dirs.inspect(d))
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_a_checkpoint_whose_config_asks_for_100000_layers_is_one_line_before_torch(tmp_path, run):
    ck = Path(shutil.copytree(run / "checkpoint", tmp_path / "ck"))
    cfg = json.loads((ck / "config.json").read_text())
    cfg["num_hidden_layers"] = 100000
    (ck / "config.json").write_text(json.dumps(cfg))
    out, lines = cli_before_torch("eval", "--checkpoint", ck)
    assert out == {"rc": 2, "torch": False} and "num_hidden_layers=100000" in lines[-1], lines


# ----------------------------------------------------------- nothing a user owns is replaced
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real 3-step tiny-qwen3 run: checkpoint, export, telemetry."""
    out = tmp_path_factory.mktemp("foreign") / "run"
    run_dflash("train", "--out", out, "--target", "tiny-qwen3", "--steps", "3", *TINY)
    return out


def _digests(d: Path) -> dict:
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.mark.slow
def test_export_never_replaces_a_drafter_it_did_not_write(tmp_path, run, served):
    """A SpecForge export or a downloaded drafter has the same layout as ours, minus our
    marker: refused with and without --overwrite, left byte for byte."""
    theirs = Path(shutil.copytree(served, tmp_path / "theirs"))
    (theirs / ".dflash-export").unlink()
    (theirs / "README.md").unlink()
    before = _digests(theirs)
    for extra in ([], ["--overwrite"]):
        out, lines = cli_before_torch("export", "--checkpoint", run / "checkpoint", "--out", theirs, *extra)
        assert out == {"rc": 2, "torch": False} and len(lines) == 1, lines
        assert "did not write" in lines[0] and "never replaces" in lines[0], lines
    assert _digests(theirs) == before


@pytest.mark.slow
def test_export_replaces_its_own_earlier_export_only_with_overwrite_and_writes_readable_files(tmp_path, run):
    out = tmp_path / "exp"
    p = subprocess.run([sys.executable, "-m", "dflash", "export", "--checkpoint", str(run / "checkpoint"),
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, umask=0o022, timeout=300)
    assert p.returncode == 0, p.stderr
    modes = {q.name: oct(q.stat().st_mode & 0o777) for q in [out, *out.iterdir()]}
    assert modes.pop("exp") == "0o755" and set(modes.values()) == {"0o644"}, modes
    assert {"config.json", "model.safetensors", "README.md", ".dflash-export"} <= set(modes), modes
    res, lines = cli_before_torch("export", "--checkpoint", run / "checkpoint", "--out", out)
    assert res["rc"] == 2 and "pass --overwrite" in lines[-1], lines
    run_dflash("export", "--checkpoint", run / "checkpoint", "--out", out, "--overwrite")
    # a run's own checkpoint is readable too (an engine or a colleague may serve it)
    assert {oct(q.stat().st_mode & 0o044) for q in (run / "checkpoint").iterdir()} == {"0o44"}


@pytest.mark.slow
def test_export_into_the_runs_own_dirs_is_one_line(run):
    """An export inside RUN/checkpoint/ would stop the run's next --resume ("holds files dflash did
    not write"); inside telemetry/ it would sit among the spans: refused before torch, nothing made."""
    for sub in ("checkpoint/sub", "checkpoint.old/x/y", "telemetry/exp"):
        out, lines = cli_before_torch("export", "--checkpoint", run / "checkpoint", "--out", run / sub)
        assert out == {"rc": 2, "torch": False} and len(lines) == 1, lines
        assert f"inside the {sub.split('/')[0]}/ of the run in" in lines[0] and "only that run writes" in lines[0]
        assert not (run / sub).exists()
    link = run.parent / "link-to-checkpoint"  # a link is where it points
    link.symlink_to(run / "checkpoint")
    out, lines = cli_before_torch("export", "--checkpoint", run / "checkpoint", "--out", link / "sub")
    assert out == {"rc": 2, "torch": False} and "inside the checkpoint/ of the run in" in lines[0], lines


@pytest.mark.slow
@pytest.mark.parametrize("make,needle", [
    (lambda t: (t / "afile").write_text("x") and t / "afile" / "x", "afile is a file, not a directory"),
    (lambda t: (t / "f").write_text("x") and t / "f", "is a file (expected"),
])
def test_export_out_under_a_file_is_one_line(tmp_path, run, make, needle):
    out, lines = cli_before_torch("export", "--checkpoint", run / "checkpoint", "--out", make(tmp_path))
    assert out == {"rc": 2, "torch": False} and len(lines) == 1 and needle in lines[0], lines


@pytest.mark.slow
def test_timeline_never_writes_onto_the_runs_files_nor_anyone_elses(tmp_path, run):
    before = _digests(run / "telemetry") | {"summary.json": _digests(run)["summary.json"]}
    mine = tmp_path / "notes.png"
    mine.write_bytes(b"\x89PNG\r\n\x1a\n a user's own picture")
    for flag, path, needle in [
        ("--perfetto", run / "telemetry" / "traces.jsonl", "expected a file name ending in .json"),
        ("--perfetto", run / "summary.json", "is not a picture dflash timeline wrote"),
        ("--png", run / "learning_curve.png", "is not a picture dflash timeline wrote"),
        ("--png", run / "telemetry" / "new.png", "inside the run's own telemetry/"),
        ("--png", mine, "is not a picture dflash timeline wrote"),
        ("--png", tmp_path, "is a directory"),
        ("--png", tmp_path / "x.txt", "expected a file name ending in .png"),
    ]:
        out, lines = cli_before_torch("timeline", run, flag, path, heavy=True)
        assert out == {"rc": 2, "heavy": []} and len(lines) == 1 and needle in lines[0], (flag, path, lines)
    assert _digests(run / "telemetry") | {"summary.json": _digests(run)["summary.json"]} == before
    assert mine.read_bytes().endswith(b"a user's own picture")
    stalls = run_dflash("stalls", run)
    assert "holds no spans" not in stalls.stdout + stalls.stderr
    # its own earlier pictures it replaces, with a plain write's modes
    png, js = tmp_path / "t.png", tmp_path / "t.json"
    for _ in range(2):
        p = subprocess.run([sys.executable, "-m", "dflash", "timeline", str(run), "--png", str(png),
                            "--perfetto", str(js)], cwd=ROOT, capture_output=True, text=True, umask=0o022)
        assert p.returncode == 0, p.stderr
    assert oct(png.stat().st_mode & 0o777) == oct(js.stat().st_mode & 0o777) == "0o644"
    assert json.loads(js.read_text())["traceEvents"]


# ------------------------------------------------------------------------------ smaller ones
@pytest.mark.parametrize("args,needle", [
    (["export", "--checkpoint", "x", "--out", "y", "--dtype", "fp8"], "invalid choice: 'fp8'"),
    (["eval", "--checkpoint", "x", "--max-new-tokens", "1e12"], "invalid int value: '1e12'"),
    (["eval", "--checkpoint", "x", "--max-new-tokens", "1000000000000"], "--max-new-tokens=1000000000000"),
    (["train", "--out", "x", "--target", "tiny-qwen3", "--set", "model.block_size=1"], "model.block_size=1"),
])
def test_smaller_bad_values_are_one_line(args, needle):
    p = run_dflash(*args, check=False, timeout=120)
    lines = _lines(p)
    assert p.returncode == 2 and len(lines) == 1 and needle in lines[0], lines


def test_eval_on_another_target_than_the_drafters_own_says_so(capsys, tmp_path):
    from dflash.checkpoint.drafter_dirs import DrafterDir
    from dflash.commands.eval import _notice_other_targets

    d = DrafterDir(tmp_path, "checkpoint", {}, {"model": {"target": "tiny-qwen3"}})
    _notice_other_targets([d], "tiny-qwen3")
    assert capsys.readouterr().err == ""
    _notice_other_targets([d], "tiny-llama")
    err = capsys.readouterr().err
    assert "trained for target 'tiny-qwen3'" in err and "'tiny-llama'" in err

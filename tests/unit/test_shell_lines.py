"""Every command line dflash prints for a user to paste is quoted for a shell (issue 46): a
path or a target name holding quotes, `$(...)`, spaces or `;` comes back, from the shell's
own split, as the one word it was, and runs nothing. (`dflash serve`'s curl line is also run
by bash, from the real command, in tests/cli/test_serve_inputs.py.)"""
from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

HOSTILE = "/tmp/x'$(touch PWNED)`touch PWNED2`; touch PWNED3 \"q\""


def _run_with_bash(line: str, tmp_path: Path) -> None:
    """The line run by bash with its command replaced by `true`: nothing may be created."""
    work = tmp_path / "work"
    work.mkdir(parents=True)
    subprocess.run(["bash", "-c", "true " + line.split(" ", 1)[1]], cwd=work, check=True, timeout=30)
    assert list(work.iterdir()) == [], "the line ran a command"


def test_the_engines_command_lines_in_an_exports_readme(tmp_path):
    from dflash.checkpoint.export import readme, serve_commands

    cmds = serve_commands("org/model", Path(HOSTILE), 4)
    vllm = shlex.split(cmds["vllm"])
    assert vllm[:3] == ["vllm", "serve", "org/model"] and json.loads(vllm[4])["model"] == HOSTILE
    sglang = shlex.split(cmds["sglang"])
    assert sglang[sglang.index("--speculative-draft-model-path") + 1] == HOSTILE
    for line in cmds.values():
        _run_with_bash(line, tmp_path / str(len(line)))
    dcfg = SimpleNamespace(block_size=4, mask_token_id=1, num_hidden_layers=1, target_layer_ids=[1])
    text = readme(dcfg, target=HOSTILE, out=Path(HOSTILE), dtype="float32", figures=None, note=None)
    line = next(ln.strip() for ln in text.splitlines() if ln.strip().startswith("dflash eval --target"))
    words = shlex.split(line)
    assert words[words.index("--target") + 1] == HOSTILE and words[words.index("--checkpoint") + 1] == HOSTILE


@pytest.mark.parametrize("out", [HOSTILE, "runs/plain"])
def test_the_eval_command_an_interrupted_run_prints(out):
    from dflash.run.trainer import eval_command

    assert shlex.split(eval_command(SimpleNamespace(out=out))) == ["dflash", "eval", "--checkpoint",
                                                                  f"{out}/checkpoint"]


def test_serves_curl_line(tmp_path):
    from dflash.engine.serve import curl_line

    words = shlex.split(curl_line("http://127.0.0.1:8000", HOSTILE))
    assert json.loads(words[words.index("-d") + 1])["model"] == HOSTILE
    _run_with_bash(curl_line("http://127.0.0.1:8000", HOSTILE), tmp_path)

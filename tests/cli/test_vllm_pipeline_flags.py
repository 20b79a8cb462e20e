"""`data.regen_engine` and `dflash capture --engine vllm / --engine-tp` (issue 39): bad values
are one line, exit 2, before torch loads (the engine runs are in tests/engine/)."""
import pytest

from helpers import TINY, cli_before_torch


@pytest.mark.parametrize("args,needle", [
    (["--set", "data.regen_engine=sglang"], "data.regen_engine='sglang': expected hf or vllm"),
    (["--engine", "vllm", "--set", "train.loss=kl", "--set", "train.kl_topk=8"],
     "--engine vllm with train.loss=kl: vLLM's hidden-state extraction gives no next-token log-probs"),
    (["--engine-tp", "2"], "--engine-tp=2 without vLLM"),
    (["--engine-tp", "0", "--engine", "vllm"], "--engine-tp=0: expected an integer >= 1"),
])
def test_capture_engine_flags_are_checked_before_torch(tmp_path, args, needle):
    out, lines = cli_before_torch("capture", "--target", "tiny-qwen3", "--out", tmp_path / "f", *TINY, *args)
    assert out == {"rc": 2, "torch": False}, (out, lines)
    assert len(lines) == 1 and needle in lines[0], lines
    assert not (tmp_path / "f").exists()


def test_capture_engine_vllm_without_the_engine_venv_is_one_line(tmp_path):
    out, lines = cli_before_torch("capture", "--target", "tiny-qwen3", "--out", tmp_path / "f", "--engine", "vllm",
                                  *TINY, env={"DFLASH_VLLM_PYTHON": str(tmp_path / "none" / "python")})
    assert out == {"rc": 2, "torch": False}, (out, lines)
    assert len(lines) == 1 and "no vLLM environment" in lines[0], lines

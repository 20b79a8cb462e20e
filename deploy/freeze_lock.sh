#!/usr/bin/env bash
# freeze_lock.sh VENV LOCK: a green venv's versions as the constraints make setup installs
# (called by deploy/newest.sh --lock, i.e. `make lock`, once the tests passed on VENV).
# `pip freeze` with torch's own build (torch, its CUDA wheels, triton) left to the Makefile's
# TORCH; then what the `gpu` extra would add, resolved against those pins by
# `pip install --dry-run --report` (not installed: on a CPU machine transformers would use it).
set -euo pipefail
VENV=$1; LOCK=$2
PY=$VENV/bin/python
body=$(mktemp)
$PY -m pip freeze --exclude-editable | grep -viE '^(torch|triton|nvidia-|cuda-)' > "$body"
$PY -m pip install -q --dry-run --report "$VENV/gpu.json" -c "$body" ".[gpu]" > /dev/null
$PY - "$VENV/gpu.json" >> "$body" <<'PY'
import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    m = item["metadata"]
    name = m["name"].lower()
    if name != "dflash-otel" and not name.startswith(("torch", "triton", "nvidia-", "cuda-")):
        print(f"{m['name']}=={m['version']}")
PY
{
  echo "# The versions last tested (make lock, $(date -u +%Y-%m-%d)), installed as constraints by make setup."
  echo "# torch is the Makefile's TORCH; the gpu extra's packages were resolved against these pins."
  sort -u -f "$body"
} > "$LOCK"
rm -f "$body"
echo "wrote $LOCK ($(grep -vc '^#' "$LOCK") pins)"

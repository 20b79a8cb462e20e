#!/bin/bash
# A killed-and-resumed regeneration through the real CLI: `dflash train` on tiny-qwen3 is
# killed with SIGKILL once 3 batches are on disk (polled, no fixed sleep), then run again;
# prints what the first left on disk and the second run's counts. Usage: bench/regen_kill_resume.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD DFLASH_CACHE=$(mktemp -d) OMP_NUM_THREADS=2
W=$(mktemp -d)
ARGS="--target tiny-qwen3 --steps 2 --no-telemetry --set data.num_conversations=200 --set data.regen_max_new_tokens=64 --set data.regen_batch_size=16 --set train.batch_size=2 --set data.max_len=160"
${PYTHON:-.venv/bin/python} -m dflash train --out $W/run1 $ARGS > $W/log1 2>&1 &
PID=$!
until [ "$(ls $DFLASH_CACHE/regenerated/*/b-*.json 2>/dev/null | wc -l)" -ge 3 ]; do
  kill -0 $PID 2>/dev/null || { echo "the first run ended before 3 batches were on disk:"; tail -5 $W/log1; exit 1; }
  sleep 0.05
done
kill -9 $PID; wait $PID; echo "first run: rc $? (killed), on disk: $(python3 -c "import glob,json; f=glob.glob('$DFLASH_CACHE/regenerated/*/b-*.json'); print(len(f), 'batch files,', sum(len(json.load(open(x))) for x in f), 'replies')")"
${PYTHON:-.venv/bin/python} -m dflash train --out $W/run2 $ARGS > $W/log2 2>&1; echo "second run: rc $?"
grep "regenerated" $W/log2
python3 -c "import json,sys; print('summary data:', json.load(open('$W/run2/summary.json'))['data'])"

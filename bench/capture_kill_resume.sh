#!/bin/bash
# A killed-and-resumed capture through the real CLI: `dflash capture` of SmolLM2-135M over
# 300 ShareGPT conversations (replies as they are, 8 MB shards) is killed with SIGKILL once
# 3 shards are on disk (polled, no fixed sleep), then run again with --resume; prints what the
# first run left and the second run's counts and times. Usage: bench/capture_kill_resume.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD OMP_NUM_THREADS=2
W=$(mktemp -d)
ARGS="--target smollm2 --out $W/feats --shard-mb 8 --set data.regenerate=off --set data.num_conversations=300 --set data.max_len=256"
${PYTHON:-.venv/bin/python} -m dflash capture $ARGS > $W/log1 2>&1 &
PID=$!
until [ "$(ls $W/feats/shard-*.safetensors 2>/dev/null | wc -l)" -ge 3 ]; do
  kill -0 $PID 2>/dev/null || { echo "the first run ended before 3 shards were on disk:"; tail -5 $W/log1; exit 1; }
  sleep 0.05
done
kill -9 $PID; wait $PID; echo "first run: rc $? (killed), on disk: $(ls $W/feats/shard-*.safetensors | wc -l) shards, $(ls -a $W/feats | grep -c '\.tmp') temp file(s)"
start=$(date +%s.%N)
${PYTHON:-.venv/bin/python} -m dflash capture $ARGS --resume > $W/log2 2>&1; echo "second run (--resume): rc $?, $(python3 -c "print(f'{$(date +%s.%N) - $start:.1f} s')")"
grep -E "resuming|captured" $W/log2
python3 -c "import json; i=json.load(open('$W/feats/index.json')); print('index:', i['samples'], 'samples,', i['tokens'], 'tokens,', len(i['shards']), 'shards, resumed with', i['resumed_with'])"
rm -rf $W

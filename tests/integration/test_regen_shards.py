"""Regeneration at scale (issue 24 part 4): a shard cache on disk that survives kill -9,
the prompts split over torchrun ranks with the replies gathered, and `data.regenerate: off`
taking the data set's replies as they are. Real tiny target, real processes, real torchrun."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ROOT, free_port

CHILD = [sys.executable, str(ROOT / "tests" / "regen_child.py")]


def _env(cache: Path, **extra) -> dict:
    env = dict(os.environ) | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "DFLASH_CACHE": str(cache)}
    return env | {k: str(v) for k, v in extra.items()}


def _child(out: Path, cache: Path, *args) -> dict:
    p = subprocess.run([*CHILD, str(out), *map(str, args)], cwd=ROOT, env=_env(cache), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


def _keys_on_disk(cache: Path) -> list[str]:
    """Every record key in the batch files under ``cache`` (a key twice: listed twice)."""
    return [k for f in sorted((cache / "regenerated").glob("*/b-*.json")) for k in json.loads(f.read_text())]


def _wait_for(cond, what: str, proc, limit_s: float = 300):
    """Poll for a condition (never a fixed sleep): a loaded machine only makes this slower."""
    deadline = time.monotonic() + limit_s
    while not cond():
        assert proc.poll() is None, f"the regeneration ended (rc {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after {limit_s} s"
        time.sleep(0.05)


def test_killed_regeneration_resumes_without_loss_or_repeats(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "run.json"
    hold_after, batch = 3, 2
    log = open(tmp_path / "first.log", "w")
    p = subprocess.Popen([*CHILD, str(out), "--hold-after", str(hold_after), "--batch", str(batch)], cwd=ROOT,
                         env=_env(cache), stdout=log, stderr=log)
    try:  # the 4th batch is in flight (held inside generate), 3 are on disk: kill -9 now
        _wait_for(lambda: Path(str(out) + ".held").exists(), "batch in flight", p)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
        log.close()
    assert p.returncode == -signal.SIGKILL and not out.exists()
    first = _keys_on_disk(cache)
    assert len(first) == hold_after * batch  # whole batches only: the one in flight left nothing
    # a torn temp file a killed writer on this host left (pid gone): ignored, then swept
    sub = next((cache / "regenerated").iterdir())
    torn = sub / f".tmp-b-{socket.gethostname()}-999999999-000000.json"
    torn.write_text('{"abc": [1, 2')

    resumed = _child(out, cache, "--batch", batch)
    c = resumed["counts"]
    assert c["cached"] == len(first)
    assert c["regenerated"] == c["total"] - len(first) > 0, c
    assert not torn.exists()
    on_disk = _keys_on_disk(cache)
    assert len(on_disk) == len(set(on_disk)) == c["total"], "a reply regenerated twice, or one lost"

    whole = _child(tmp_path / "whole.json", tmp_path / "fresh", "--batch", batch)
    assert whole["counts"]["regenerated"] == c["total"] and whole["counts"]["cached"] == 0
    assert resumed["replies"] == whole["replies"]
    assert all(conv[-1]["role"] == "assistant" and conv[-1]["token_ids"] for conv in resumed["replies"])

    again = _child(tmp_path / "again.json", cache, "--batch", batch)  # all cached: nothing generated
    assert again["counts"]["regenerated"] == 0 and again["counts"]["cached"] == c["total"]
    assert again["replies"] == whole["replies"]


@pytest.mark.torchrun
@pytest.mark.slow
def test_two_ranks_regenerate_disjoint_shards_and_gather_everything(tmp_path):
    # each rank its own cache, as on nodes with no shared file system; rank 1 already holds a
    # few replies from an earlier run: nobody makes them again, and rank 1 contributes them
    pre = _child(tmp_path / "pre.json", tmp_path / "c2" / "rank1", "--take", 3, "--batch", 2)
    pre_keys = set(_keys_on_disk(tmp_path / "c2" / "rank1"))
    out = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(ROOT / "tests" / "regen_child.py"), str(out), "--batch", 2]
    p = subprocess.run(list(map(str, cmd)), cwd=ROOT, env=_env(tmp_path / "c2", DFLASH_CACHE_PER_RANK=1),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]
    made = [set(_keys_on_disk(tmp_path / "c2" / f"rank{r}")) for r in (0, 1)]
    made[1] -= pre_keys
    total = ranks[0]["counts"]["total"]
    assert not made[0] & made[1], "two ranks regenerated the same prompt"
    assert not (made[0] | made[1]) & pre_keys, "a cached reply was regenerated"
    assert len(made[0] | made[1]) + len(pre_keys) == total
    assert abs(len(made[0]) - len(made[1])) <= 2  # batch 2: shards differ by at most one batch's worth
    for r in (0, 1):
        assert ranks[r]["counts"]["regenerated_here"] == len(made[r])
        assert ranks[r]["counts"]["cached"] == len(pre_keys) and ranks[r]["counts"]["regenerated"] == total - len(pre_keys)
    assert "rank 0/2: regenerated" in p.stderr and "rank 1/2: regenerated" in p.stderr

    one = _child(tmp_path / "one.json", tmp_path / "c1", "--batch", 2)
    # greedy, fp32, CPU: a reply does not depend on which rows share its batch (left padding is
    # masked; tests/unit/test_data.py checks batched == unbatched), so shards give the same replies
    assert ranks[0]["replies"] == ranks[1]["replies"] == one["replies"]
    assert [c[:-1] for c in pre["replies"]] == [c[:-1] for c in one["replies"][:len(pre["replies"])]]


def test_regenerate_off_trains_on_the_data_sets_replies_as_they_are(tmp_path, monkeypatch, tiny):
    """`data.regenerate: off`: no target generation; every assistant turn of a multi-turn
    conversation is the data set's own text, with the loss on exactly those turns."""
    from dflash.config import load_config
    from dflash.prep import prepare as prep_mod

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    convs = []
    for n in range(12):
        convs.append({"conversations": [
            {"from": "human", "value": f"question {n} about rivers and mountains"},
            {"from": "gpt", "value": f"first answer {n}: " + "the river runs to the sea " * 4},
            {"from": "human", "value": f"and a follow-up {n}?"},
            {"from": "gpt", "value": f"second answer {n}: " + "mountains stand tall and old " * 4}]})
    data = tmp_path / "multi.json"
    data.write_text(json.dumps(convs))
    cfg = load_config(None, [f"data.path={data}", "data.num_conversations=12",
                             "data.regenerate=off", "model.target=tiny-qwen3", "data.max_len=256",
                             "model.block_size=4"])
    target, tok = tiny
    monkeypatch.setattr(prep_mod, "regenerate", lambda *a, **k: pytest.fail("regenerate: off generated"))
    prep = prep_mod.prepare(cfg, target, tok)
    assert not prep.regenerated and prep.counts == {}
    assert not (tmp_path / "cache" / "regenerated").exists()
    assert len(prep.samples) == 6  # 12 less the held-out half (split_heldout keeps >= 8, <= n/2)
    for s in prep.samples:
        ids, mask = s.input_ids, s.loss_mask
        text = tok.decode(ids)
        n = text.split("question ")[1].split(" ")[0]
        learned = tok.decode([t for t, m in zip(ids, mask) if m])
        assert f"first answer {n}: the river runs to the sea" in learned
        assert f"second answer {n}: mountains stand tall and old" in learned
        assert "question" not in learned and "follow-up" not in learned

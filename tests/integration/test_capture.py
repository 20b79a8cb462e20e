"""Capture once, train many: `dflash capture` writes the target's features to disk and
`dflash train --features` trains from them with no target forward.

- the loss history of a run from features equals the online run's (same config);
- the run from features emits the same stage spans, and `dflash stalls` answers;
- two ranks capture what one does, and two ranks train from it;
- a stopped capture resumes: its whole shards are kept, only the rest is captured;
- only the target's embedding and lm_head are read (tied and untied), plus, for
  model.drafter_init=target, the layers the drafter copies;
- bad requests are one line, exit 2, before torch loads.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import NO_OTEL_ENV, ROOT, TINY, cli_before_torch, free_port, last_json, run_dflash

STEPS = 6
COMMON = ["--steps", STEPS, *TINY]


# Features captured in other batches (other ranks, other shard cuts) see other padded
# lengths, so their reductions run in another order. On CI's CPU that moved a value of
# 0.218 by 2.5e-5 (4e-5 of the features' largest, 0.65): same rows, not other rows, whose
# values differ by the features' mean (0.09). So the bound is 1e-4, not float32's last bit.
SAME_ROWS = dict(rtol=1e-4, atol=1e-4)


def _history(run):
    return [h[1] for h in json.loads((run / "checkpoint" / "trainer_state.json").read_text())["history"]]


@pytest.fixture(scope="module")
def feats(tmp_path_factory):
    out = tmp_path_factory.mktemp("capture") / "feats"
    run_dflash("capture", "--target", "tiny-qwen3", "--out", out, *TINY)
    return out


@pytest.fixture(scope="module")
def offline(tmp_path_factory, feats):
    run = tmp_path_factory.mktemp("offline") / "run"
    run_dflash("train", "--features", feats, "--out", run, *COMMON, env=NO_OTEL_ENV)
    return run


def test_training_from_features_matches_the_online_run(tmp_path, offline):
    online = tmp_path / "online"
    run_dflash("train", "--target", "tiny-qwen3", "--out", online, "--no-telemetry", *COMMON)
    a, b = _history(online), _history(offline)
    print(f"\nonline  {a}\noffline {b}\nidentical: {a == b}")
    assert len(a) == len(b) == STEPS
    if a != b:  # features captured in other batches can differ a little on some CPUs (SAME_ROWS)
        assert a == pytest.approx(b, rel=SAME_ROWS["rtol"]), (a, b)


def test_the_index_counts_every_sample_once(feats):
    idx = json.loads((feats / "index.json").read_text())
    from dflash.offline.feature_index import read_index
    from dflash.offline.feature_shards import FeatureStore

    store = FeatureStore(str(feats), read_index(str(feats)))
    samples = store.samples()
    assert len(samples) == idx["samples"] == sum(s["samples"] for s in idx["shards"])
    assert sum(len(s.input_ids) for s in samples) == idx["tokens"]
    assert idx["key"]["target"] == "tiny-qwen3" and idx["key"]["dtype"] == "float32"
    F = idx["feature_dim"]
    assert F == len(idx["key"]["layer_ids"]) * 256  # tiny-qwen3's hidden size
    # features are most of it; ids (int32), mask (uint8), offsets and the header the rest
    assert F * 4 <= idx["bytes_per_token"] < F * 4 + 16


def test_a_features_run_emits_every_stage_and_the_stalls_report_answers(offline):
    from otel import read_spans

    spans = [s for f in sorted((offline / "telemetry").rglob("traces.jsonl")) for s in read_spans(str(f))]
    names = {s["name"] for s in spans}
    assert {"data_load", "model_forward", "pack_hidden", "cpu_copy_enqueue", "queue_get", "drafter_forward",
            "backward", "optimizer_step"} <= names, names
    forwards = [s for s in spans if s["name"] == "model_forward"]
    assert forwards and all(s["attributes"].get("source") == "features" for s in forwards)
    p = run_dflash("stalls", offline, "--json")
    rep = last_json(p.stdout)
    assert {w["worker"] for w in rep["workers"]} >= {"target0", "drafter0"}
    summary = json.loads((offline / "summary.json").read_text())
    assert summary["steps"] == STEPS


def _torchrun(*args):
    env = dict(os.environ) | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)} | NO_OTEL_ENV
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "dflash", *map(str, args)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


@pytest.mark.torchrun
def test_two_ranks_without_torchruns_store_share_one_trace(tmp_path):
    """Launched the way Slurm or an operator launches (the rank variables, no torchrun agent
    store): the ranks agree on the run id by joining first, so both land in one trace (each
    had its own, rank 1's process span hanging from a root nobody emitted)."""
    from otel import read_spans

    out, port = tmp_path / "feats", str(free_port())
    base = dict(os.environ) | {"OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": port} | NO_OTEL_ENV
    base.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    procs = [subprocess.Popen([sys.executable, "-m", "dflash", "capture", "--target", "tiny-qwen3", "--out", str(out),
                               *map(str, TINY)], cwd=ROOT, env=base | {"RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    traces = {r: {s["trace_id"] for s in read_spans(str(out / "telemetry" / f"rank{r}"))} for r in (0, 1)}
    assert len(traces[0]) == 1 and traces[0] == traces[1], traces
    assert any(s["name"] == "join_ranks" for s in read_spans(str(out / "telemetry" / "rank1")))


@pytest.mark.torchrun
@pytest.mark.slow
def test_two_ranks_capture_what_one_does_and_two_ranks_train_from_it(tmp_path, feats):
    from dflash.data.dataset import batches
    from dflash.offline.feature_index import read_index
    from dflash.offline.feature_shards import FeatureStore

    two = tmp_path / "feats2"
    _torchrun("capture", "--target", "tiny-qwen3", "--out", two, *TINY)
    idx = read_index(str(two))
    assert {s["file"].split("-")[1] for s in idx["shards"]} == {"r0", "r1"}  # both ranks wrote
    one_store, two_store = FeatureStore(str(feats), read_index(str(feats))), FeatureStore(str(two), idx)
    samples = one_store.samples()
    assert [s.input_ids for s in two_store.samples()] == [s.input_ids for s in samples]
    b1 = one_store.attach(next(batches(samples, batch_size=len(samples), seed=0, pad_id=0, bucket=False)))
    b2 = two_store.attach(next(batches(samples, batch_size=len(samples), seed=0, pad_id=0, bucket=False)))
    torch.testing.assert_close(b1.features, b2.features, **SAME_ROWS)  # other batches, same rows

    run = tmp_path / "run2"
    _torchrun("train", "--features", two, "--out", run, "--no-telemetry", *COMMON)
    assert len(_history(run)) == STEPS


def _digests(d):
    """The capture's files (not the lock, nor a killed rank's temp files) by content."""
    import hashlib
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.iterdir())
            if f.is_file() and not f.name.startswith(".")}


STOPPED = ["--target", "tiny-qwen3", "--shard-mb", "1", *TINY]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """What a killed capture leaves: its first shards whole (of 1 MB), a temp file half
    written, no index."""
    part = tmp_path_factory.mktemp("stopped") / "feats"
    run_dflash("capture", "--out", part, *STOPPED)
    shards = sorted(part.glob("shard-*.safetensors"))
    assert len(shards) >= 4
    (part / "index.json").unlink()
    for f in shards[len(shards) // 2:]:
        f.unlink()
    (part / f".{shards[-1].name}.tmp4242").write_bytes(b"half a shard")
    return part


def _resumed_like_a_straight_capture(part, feats, kept: dict):
    from dflash.data.dataset import batches
    from dflash.offline.feature_index import read_index
    from dflash.offline.feature_shards import FeatureStore

    idx, whole = read_index(str(part)), read_index(str(feats))
    after = _digests(part)
    assert all(after[n] == d for n, d in kept.items())  # kept as they were, not written again
    assert not list(part.glob(".shard-*"))  # the temp file is gone
    assert idx["samples"] == whole["samples"] and idx["tokens"] == whole["tokens"] and idx["key"] == whole["key"]
    a, b = FeatureStore(str(feats), whole), FeatureStore(str(part), idx)
    samples = a.samples()
    assert b.samples() == samples
    b1 = a.attach(next(batches(samples, batch_size=len(samples), seed=0, pad_id=0, bucket=False)))
    b2 = b.attach(next(batches(samples, batch_size=len(samples), seed=0, pad_id=0, bucket=False)))
    torch.testing.assert_close(b1.features, b2.features, **SAME_ROWS)
    return idx


def test_a_stopped_capture_resumes_with_nothing_captured_twice(tmp_path, feats, stopped):
    import shutil

    from dflash.offline.feature_shards import shards_on_disk

    part = tmp_path / "feats"
    shutil.copytree(stopped, part)
    kept = _digests(part)
    on_disk = sum(s["samples"] for s in shards_on_disk(part))
    total = json.loads((feats / "index.json").read_text())["samples"]

    other = run_dflash("capture", "--out", part, *STOPPED, "--resume", "--set", "data.max_len=80", check=False)
    lines = [ln for ln in other.stderr.splitlines() if "error" in ln]  # other samples: refused
    assert other.returncode == 2 and len(lines) == 1 and "shard(s) of another capture" in lines[0], other.stderr
    assert _digests(part) == kept

    p = run_dflash("capture", "--out", part, *STOPPED, "--resume")
    assert f"{on_disk} of {total} samples are on disk in {len(kept)} shard(s); capturing the other " \
           f"{total - on_disk}" in p.stderr
    assert _resumed_like_a_straight_capture(part, feats, kept)["resumed_with"] == on_disk


@pytest.mark.torchrun
@pytest.mark.slow
def test_two_ranks_resume_what_one_rank_began(tmp_path, feats, stopped):
    import shutil

    part = tmp_path / "feats"
    shutil.copytree(stopped, part)
    kept = _digests(part)
    _torchrun("capture", "--out", part, *STOPPED, "--resume")
    idx = _resumed_like_a_straight_capture(part, feats, kept)
    assert {s["file"].split("-")[1] for s in idx["shards"]} == {"r0", "r1"}  # the new rank wrote too


@pytest.mark.parametrize("case,needle", [
    ("both", "--resume with --overwrite: choose one"),
    ("finished", "holds a finished capture"),
    ("nothing", "no shards in"),
])
def test_bad_resume_requests_are_one_line_before_torch(tmp_path, feats, case, needle):
    out = {"both": tmp_path / "x", "finished": feats, "nothing": tmp_path / "empty"}[case]
    flags = ["--resume", "--overwrite"] if case == "both" else ["--resume"]
    before = _digests(feats)
    res, lines = cli_before_torch("capture", "--target", "tiny-qwen3", "--out", out, *flags, *TINY)
    assert res == {"rc": 2, "torch": False}, lines
    assert len(lines) == 1 and needle in lines[0], lines
    assert _digests(feats) == before and not (tmp_path / "empty").exists()


@pytest.mark.parametrize("tied", [False, True])
def test_only_the_embedding_and_lm_head_are_read(tmp_path, tied):
    from transformers import AutoConfig, Qwen3Config, Qwen3ForCausalLM

    from dflash.offline.head_only import load_head_only

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied)
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # several shards and an index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    head = load_head_only(str(tmp_path), AutoConfig.from_pretrained(tmp_path))
    assert torch.equal(head.get_input_embeddings().weight, model.get_input_embeddings().weight)
    assert torch.equal(head.get_output_embeddings().weight, model.get_output_embeddings().weight)
    assert (head.get_output_embeddings().weight is head.get_input_embeddings().weight) == tied
    n = sum(p.numel() for p in head.parameters())
    assert n == 300 * 64 * (1 if tied else 2)  # nothing else was loaded
    assert "embedding and lm_head only" in head.note


def test_drafter_init_target_from_features_reads_only_the_layers_it_copies(tmp_path):
    """`train --features` with model.drafter_init=target: the drafter starts from exactly the
    weights an online run's would, read from the target's files, and nothing else of its layers."""
    from transformers import AutoConfig, Qwen3Config, Qwen3ForCausalLM

    from dflash.model.architectures import make_drafter
    from dflash.model.build import init_from_target
    from dflash.model.drafter import DrafterConfig
    from dflash.offline.head_only import load_head_only

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    dcfg = DrafterConfig.from_target(cfg, target_layer_ids=[0, 2], mask_token_id=299, vocab_size=300,
                                     num_hidden_layers=2, block_size=4, target="x")
    online, offline = make_drafter(dcfg), make_drafter(dcfg)
    offline.load_state_dict(online.state_dict())
    head = load_head_only(str(tmp_path), AutoConfig.from_pretrained(tmp_path), init_for=([0, 2], 2))
    assert init_from_target(online, model) == init_from_target(offline, head.init_source)
    for k, v in online.state_dict().items():
        assert torch.equal(v, offline.state_dict()[k]), k
    layers = head.init_source.model.layers
    assert [i for i, layer in enumerate(layers) if not layer.mlp.up_proj.weight.is_meta] == [3, 4]
    assert sum(p.numel() for p in head.parameters()) == 2 * 300 * 64  # the pair itself, as without init
    assert "model.drafter_init=target copies" in head.note


@pytest.mark.parametrize("case,needle", [
    ("not_a_capture", "no index.json"),
    ("unfinished", "the capture did not finish"),
    ("shard_missing", "shard(s) listed in index.json are missing"),
    ("other_target", "captured for target 'tiny-qwen3', the run asks for 'tiny-llama'"),
    ("other_layers", "captured layers"),
    ("eval", "--eval with --features"),
    ("layout", "no target ranks are needed"),
    ("block_past_it", "needs samples with >= 64 loss tokens (2 x the block); the longest captured one has"),
])
def test_bad_feature_requests_are_one_line_before_torch(tmp_path, feats, case, needle):
    """block_past_it was a traceback after torch, once --overwrite had cleared the run dir."""
    import shutil

    src = feats
    extra = []
    if case in ("not_a_capture", "unfinished", "shard_missing"):
        src = tmp_path / "feats"
        shutil.copytree(feats, src)
        if case == "not_a_capture":
            for f in src.iterdir():
                if f.is_file():
                    f.unlink()
        elif case == "unfinished":
            (src / "index.json").unlink()
        else:
            next(src.glob("shard-*.safetensors")).unlink()
    extra = {"other_target": ["--target", "tiny-llama"], "other_layers": ["--set", "model.target_layer_ids=0"],
             "eval": ["--eval"], "layout": ["--layout", "target:1,drafter:1"],
             "block_past_it": ["--set", "model.block_size=32"]}.get(case, [])
    out, lines = cli_before_torch("train", "--features", src, "--out", tmp_path / "run", *COMMON, *extra)
    assert out == {"rc": 2, "torch": False}, lines
    assert len(lines) == 1 and needle in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_eval_of_a_run_from_a_capture_splits_with_the_captures_seed(feats):
    """A run may train from one capture with any train.seed (bench/data_scale.py's seeds); its
    held-out prompts are the capture's, split with the capture's seed, never its own: seed 7's
    split of the same conversations held out one the capture trained on."""
    from dflash.commands.eval import _split_seed

    assert _split_seed({"train": {"seed": 7}, "data": {"features": str(feats)}}) == 0
    assert _split_seed({"train": {"seed": 7}, "data": {"features": str(feats) + "-moved"}}) == 7  # gone: its own
    assert _split_seed({"train": {"seed": 7}, "data": {}}) == 7


def test_a_run_from_a_capture_records_the_captures_data_settings_and_names_an_overruled_one(feats, capsys):
    from dflash.commands.train import train_flags
    from dflash.config import load_config

    asked = {}
    cfg = load_config(None, [*[x for x in TINY if x != "--set"], "data.num_conversations=100"], asked=asked)
    flags = train_flags(str(feats), cfg, target_flag=None, eval_flag=False, named=asked)
    assert flags["data.num_conversations"] != 100 and "data.regenerate" in flags  # the capture's, into config.yaml
    err = capsys.readouterr().err
    assert "notice: data.num_conversations=" in err and "which this run records; ignored" in err


def test_a_features_dir_whose_target_config_asks_for_its_own_code_runs_nothing(tmp_path, feats):
    """Features dirs are meant to be shared: FEATS/target/config.json with a crafted
    auto_map is refused by name, with "y" waiting on stdin, and its module never runs."""
    import os
    import shutil

    from pathlib import Path

    mine = Path(shutil.copytree(feats, tmp_path / "feats"))
    mark = tmp_path / "PWNED"
    (mine / "target" / "evil.py").write_text(f"open({str(mark)!r}, 'w').write('ran')\n")
    cfg = json.loads((mine / "target" / "config.json").read_text())
    cfg.update(model_type="evilmodel", auto_map={"AutoConfig": "evil.EvilConfig"})
    (mine / "target" / "config.json").write_text(json.dumps(cfg))
    p = subprocess.run([sys.executable, "-m", "dflash", "train", "--features", str(mine), "--out",
                        str(tmp_path / "run"), *TINY, "--set", "train.steps=1"], cwd=ROOT, input="y\n",
                       capture_output=True, text=True, timeout=300, env=dict(os.environ))
    lines = [ln for ln in p.stderr.splitlines() if "error" in ln]
    assert p.returncode == 2 and len(lines) == 1 and "auto_map" in lines[0] and "never runs" in lines[0], p.stderr
    assert not mark.exists()


def test_a_capture_of_regenerated_replies_keeps_regenerations_features(tmp_path, feats):
    """train.feature_cache: the features regeneration computed go to the shards, no second
    forward; they equal a forward's within 2e-4, but for each reply's last token (never fed
    back while generating: a zero row, which no block reads)."""
    from safetensors.torch import load_file

    out = tmp_path / "kept"
    p = run_dflash("capture", "--target", "tiny-qwen3", "--out", out, *TINY, "--set", "train.feature_cache=true",
                   env={"DFLASH_CACHE": str(tmp_path / "cache")})
    a, b = (json.loads((d / "index.json").read_text()) for d in (feats, out))
    assert b["from_regeneration"] == b["samples"] == a["samples"] and a["from_regeneration"] == 0
    assert b["key"]["data"] == a["key"]["data"]
    assert "with the features regeneration kept" in p.stderr

    def by_sample(d):
        rows = {}
        for f in sorted(d.glob("shard-*.safetensors")):
            t = load_file(f)
            off = t["offsets"].tolist()
            for j, pos in enumerate(t["sample"].tolist()):
                rows[pos] = t["features"][off[j]:off[j + 1]]
        return rows
    fa, fb = by_sample(feats), by_sample(out)
    assert sorted(fa) == sorted(fb)
    for k in fa:
        assert torch.allclose(fa[k][:-1], fb[k][:-1], atol=2e-4), k


def test_a_read_text_kl_capture_keeps_the_targets_own_distribution(tmp_path):
    """data.regenerate=off + train.loss=kl: the text is someone else's (ShareGPT's replies, not
    regenerated) and the stored targets are the target's own next-token distribution on it: at
    every position, its k most likely tokens and their log-probs, as its forward gives them."""
    from safetensors.torch import load_file

    from dflash.model.target import load_target

    out = tmp_path / "read"
    run_dflash("capture", "--target", "tiny-qwen3", "--out", out, *TINY, "--set", "data.regenerate=off",
               "--set", "train.loss=kl", "--set", "train.kl_topk=8")
    index = json.loads((out / "index.json").read_text())
    assert index["kl_topk"] == 8 and index["data"]["regenerate"] == "off"
    target, _ = load_target("tiny-qwen3")
    checked = 0
    for f in sorted(out.glob("shard-*.safetensors")):
        t = load_file(f)
        off = t["offsets"].tolist()
        for j in range(min(3, len(off) - 1)):
            ids = t["input_ids"][off[j]:off[j + 1]].long()
            with torch.no_grad():
                logp = torch.log_softmax(target(ids[None]).logits[0].float(), dim=-1)
            got_ids, got_logp = t["kl_ids"][off[j]:off[j + 1]].long(), t["kl_logp"][off[j]:off[j + 1]].float()
            want = logp.topk(8, dim=-1)
            assert torch.allclose(got_logp, want.values, atol=2e-2)                # fp16 storage
            assert torch.allclose(logp.gather(-1, got_ids), want.values, atol=2e-2)  # same tokens, up to ties
            checked += 1
    assert checked >= 3

"""The training-memory check a run is refused by (preflight/launch_checks.py, memory.py): from
the config alone it counts what a built drafter really holds once an optimizer step has run
(weights, gradients, AdamW's moments, a draft vocabulary's frozen head), models the run's peak
phase by phase (tests/integration/test_memory_peak.py holds it to real runs' VmHWM), reads what
there is (the host's MemAvailable, a memory cgroup's limit: fake v1 and v2 trees here), and
refuses in one line naming the peak, its phase and the limit that applied."""
import dataclasses
from pathlib import Path

import pytest
import torch

from helpers import SMALL_DRAFTER
from dflash.model.architectures import make_drafter
from dflash.model.drafter import DrafterConfig
from dflash.preflight.checkpoint_files import parameter_count, training_bytes
from dflash.preflight.launch_checks import available_memory, training_memory_error
from dflash.preflight.memory import (FIXED_STEPS0, SNAPSHOT_BYTES, CgroupMemory, RunShape, cgroup_memory, estimate,
                                     headroom)


def _held_after_a_step(d) -> int:
    """Bytes of every parameter, gradient, optimizer state tensor and buffer after one AdamW step."""
    params = [p for p in d.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    sum(p.float().sum() for p in params).backward()
    opt.step()
    held = sum(p.numel() * p.element_size() * 2 for p in params)  # the weight and its gradient
    held += sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")
    return held + sum(b.numel() * b.element_size() for b in d.buffers())


@pytest.mark.parametrize("over", [
    {}, {"num_hidden_layers": 3}, {"copy_head": True}, {"draft_vocab_size": 20},
    {"arch": "dflash2", "conv_group_size": 8, "selector_rank": 16, "selector_top_k": 4, "num_hidden_layers": 2},
    {"arch": "dflash2", "conv_kernel_size": 3, "conv_group_size": 1, "selector_rank": 64, "selector_top_k": 4},
])
def test_the_estimate_is_what_a_built_drafter_holds(over):
    cfg = DrafterConfig(**(SMALL_DRAFTER | over))
    d = make_drafter(cfg)
    assert parameter_count(cfg.to_dict()) == sum(p.numel() for p in d.parameters() if p.requires_grad)
    held = _held_after_a_step(d)
    assert abs(training_bytes(cfg.to_dict()) - held) <= 0.02 * held, (training_bytes(cfg.to_dict()), held)


GiB = 2**30
# a run's shape as the tests of tests/helpers.TINY train it (block 8 comes from the fields)
TINY_SHAPE = RunShape(steps=40, batch_size=2, num_anchors=4, max_len=96)
# tiny-qwen3's drafter sizes (target/_tiny_config), 128 layers: the issue-54 run OOM-killed in a 2 GB cgroup
TINY_128 = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
                vocab_size=49152, target_layer_ids=[1, 2, 3], mask_token_id=5, block_size=8, num_hidden_layers=128)


def test_the_refusal_names_the_peak_its_parts_and_the_limit():
    fields = DrafterConfig(**(SMALL_DRAFTER | {"arch": "dflash2", "selector_rank": 64})).to_dict()
    est, err = training_memory_error(fields, TINY_SHAPE, None)
    assert err is None  # nothing known: nothing refused
    need = est["peak"]
    assert need > training_bytes(fields)  # the state plus the step's activations and the fixed share
    assert training_memory_error(fields, TINY_SHAPE, (need, "cpu has enough"))[1] is None
    _, err = training_memory_error(fields, TINY_SHAPE, (need - 1, "cuda:0 has 0.0 GiB free of 80.0 GiB"),
                                   device="cuda:0")
    assert f"the drafter has {parameter_count(fields):,} parameters: training it needs about" in err, err
    assert "the training step" in err and "cuda:0 has 0.0 GiB free" in err and "model.selector_rank" in err
    assert "\n" not in err


def test_a_run_of_no_steps_is_checked_at_what_it_needs():
    """--steps 0: no gradients, no optimizer state, no activations: the drafter's weights and
    their export (or --eval's served copy), less than half of what training the same one needs,
    and accepted where that fits."""
    zero = estimate(TINY_128, dataclasses.replace(TINY_SHAPE, steps=0, eval_after=True))
    train = estimate(TINY_128, TINY_SHAPE)
    n = parameter_count(TINY_128)
    assert zero["peak"] == 8 * n + FIXED_STEPS0 and zero["phase"] == "the save and export"
    assert zero["peak"] < train["peak"] / 2
    room = (zero["peak"], "the memory cgroup /x (v2) leaves ...")
    assert training_memory_error(TINY_128, dataclasses.replace(TINY_SHAPE, steps=0), room, now=2**30)[1] is None
    err = training_memory_error(TINY_128, TINY_SHAPE, room, now=2**30)[1]
    assert "training it needs about" in err and "on top of the 1.00 GiB this process holds now" in err


def test_anchors_beyond_the_sequence_length_are_priced_as_the_step_takes_them():
    """num_anchors=5000 at max_len 256 was refused at ~1 TiB; the step samples min(5000, 256)."""
    from dflash.preflight.memory import estimate

    many = RunShape(steps=1, batch_size=2, num_anchors=5000, max_len=256)
    assert many.num_anchors == 256
    assert estimate(TINY_128, many) == estimate(TINY_128, RunShape(steps=1, batch_size=2, num_anchors=256, max_len=256))


def test_only_a_save_during_training_holds_a_snapshot():
    """The final save copies nothing (it writes the live tensors); one every N steps leaves its
    snapshot (weights and moments, and what the allocator keeps beside them) with the writer
    while training goes on."""
    n = parameter_count(TINY_128)
    last_only = estimate(TINY_128, TINY_SHAPE)
    every = estimate(TINY_128, dataclasses.replace(TINY_SHAPE, save_every=10))
    assert every["peak"] - last_only["peak"] == SNAPSHOT_BYTES * n
    assert estimate(TINY_128, dataclasses.replace(TINY_SHAPE, save_every=40))["peak"] == last_only["peak"]


def test_a_cuda_step_counts_no_attention_scores():
    """The CPU's attention keeps its scores for the backward; CUDA's memory-efficient and flex
    kernels do not, and its chunked loss reuses one chunk's blocks: the recipe's step (Qwen3-8B's
    geometry, 5 layers, 512 anchors x block 16, sequences of 2048, bf16, chunks of 4096) is ~30 GiB
    on a GPU, not the ~90 GiB that counting its [8192 x 10240] scores per head and layer makes it."""
    f = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
             vocab_size=151936, target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=5, block_size=16,
             num_hidden_layers=5)
    gpu = RunShape(steps=100, batch_size=1, num_anchors=512, max_len=2048, loss_chunk=4096, act_bytes=2, host=False)
    assert 25 * GiB < estimate(f, gpu)["peak"] < 40 * GiB
    assert estimate(f, dataclasses.replace(gpu, host=True))["peak"] > 80 * GiB


@pytest.mark.parametrize("copy", [True, False])
def test_the_final_snapshot_is_the_live_tensors(copy):
    from dflash.checkpoint.checkpoint import snapshot
    d = make_drafter(DrafterConfig(**SMALL_DRAFTER))
    params = [p for p in d.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params)
    sum(p.sum() for p in params).backward()
    opt.step()
    snap = snapshot(d, run_config={}, state={"step": 1}, training_state={"optimizer": opt.state_dict()}, copy=copy)
    live = {k: v.data_ptr() for k, v in d.state_dict().items()}
    shared = [k for k, t in snap.tensors.items() if t.data_ptr() == live[k]]
    moment = snap.training_state["optimizer"]["state"][0]["exp_avg"]
    assert (shared == [] and moment.data_ptr() != opt.state[params[0]]["exp_avg"].data_ptr()) if copy else \
        (len(shared) == len(live) and moment.data_ptr() == opt.state[params[0]]["exp_avg"].data_ptr())


def test_the_host_figure_is_the_smaller_of_memavailable_and_the_cgroup():
    free, said = available_memory("cpu")
    with open("/proc/meminfo") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    assert free <= kb * 1024 + 2**30 and ("MemAvailable" in said or "memory cgroup" in said)  # a moving figure


# -- the cgroup reader, on fake trees ---------------------------------------------------------


def _write(d: Path, **files):
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name.replace("__", ".")).write_text(str(text) + "\n")


def _meminfo(tmp_path, avail: int) -> Path:
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal:       {64 * GiB // 1024} kB\nMemAvailable:   {avail // 1024} kB\n")
    return p


def test_a_v2_cgroup_limit_is_honoured(tmp_path):
    root = tmp_path / "cg"
    _write(root, cgroup__controllers="cpu memory")
    _write(root / "kube" / "pod1", memory__max="max", memory__current=GiB)
    _write(root / "kube" / "pod1" / "box", memory__max=2 * GiB, memory__current=GiB + GiB // 2,
           memory__stat=f"anon 1000\ninactive_file {GiB // 4}\nactive_file 5\n")
    got = cgroup_memory(root, "0::/kube/pod1/box\n")
    assert got == CgroupMemory(2, "/kube/pod1/box", 2 * GiB, GiB + GiB // 4)  # inactive file cache is reclaimable
    room, said = headroom(root, "0::/kube/pod1/box\n", _meminfo(tmp_path, 20 * GiB))
    assert room == 3 * GiB // 4
    assert said.startswith("the memory cgroup /kube/pod1/box (v2) leaves 0.75 GiB (limit 2.00 GiB, 1.25 GiB in use)")
    assert "the host has 20.00 GiB available (MemAvailable)" in said
    # a tighter ancestor wins over the process's own cgroup
    _write(root / "kube" / "pod1", memory__max=GiB + GiB // 2, memory__current=GiB + GiB // 4)
    assert cgroup_memory(root, "0::/kube/pod1/box\n").path == "/kube/pod1"
    # no limit anywhere: the host's figure
    _write(root / "kube" / "pod1", memory__max="max")
    _write(root / "kube" / "pod1" / "box", memory__max="max")
    assert cgroup_memory(root, "0::/kube/pod1/box\n") is None
    assert headroom(root, "0::/kube/pod1/box\n", _meminfo(tmp_path, 20 * GiB)) == \
        (20 * GiB, "the host has 20.00 GiB available (MemAvailable)")


def test_a_v1_memory_cgroup_limit_is_honoured(tmp_path):
    root = tmp_path / "cg"
    mem = root / "memory"
    _write(mem, memory__limit_in_bytes=9223372036854771712, memory__usage_in_bytes=5 * GiB)  # v1's "no limit"
    _write(mem / "docker" / "abc", memory__limit_in_bytes=2 * GiB, memory__usage_in_bytes=GiB,
           memory__stat=f"cache 10\ntotal_inactive_file {GiB // 2}\n")
    proc = "12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n"
    assert cgroup_memory(root, proc) == CgroupMemory(1, "/docker/abc", 2 * GiB, GiB // 2)
    room, said = headroom(root, proc, _meminfo(tmp_path, 20 * GiB))
    assert room == 3 * GiB // 2 and "the memory cgroup /docker/abc (v1) leaves 1.50 GiB (limit 2.00 GiB" in said
    # the host's figure when it is the smaller one, the cgroup named beside it
    room, said = headroom(root, proc, _meminfo(tmp_path, GiB))
    assert room == GiB and said.startswith("the host has 1.00 GiB available (MemAvailable)") and "/docker/abc" in said


def test_inside_a_container_the_mount_root_is_its_own_cgroup(tmp_path):
    """/proc/self/cgroup may name the host's path, absent under the container's mount: its root counts."""
    root = tmp_path / "cg"
    _write(root, cgroup__controllers="memory", memory__max=GiB, memory__current=GiB // 4)
    assert cgroup_memory(root, "0::/system.slice/docker-1.scope\n") == CgroupMemory(2, "/", GiB, GiB // 4)
    assert cgroup_memory(tmp_path / "none", "0::/\n") is None  # no cgroupfs at all


@pytest.mark.parametrize("topk", [0, 8], ids=["features", "top-k"])
def test_the_feature_cache_check_counts_what_the_cache_keeps_and_refuses_what_does_not_fit(topk):
    """train.feature_cache grows through the first epoch and is held to the end: its full size
    (memory.feature_cache_bytes) is what a FeatureCache holds once every sequence has been kept,
    and run/setup.py refuses a run whose cache does not fit beside the drafter, in one line."""
    from types import SimpleNamespace

    from dflash.data import dataset as data_mod
    from dflash.data.sample import Sample
    from dflash.model.feature_cache import FeatureCache
    from dflash.model.target import FINAL
    from dflash.preflight.memory import feature_cache_bytes
    from dflash.run.setup import _check_feature_cache

    H, V = 16, 40
    head = torch.nn.Linear(H, V, bias=False)
    fids = [1, 2] + ([FINAL] if topk else [])
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(0, V, (n,), generator=g).tolist(), [1] * n) for n in (9, 7, 12)]
    samples.append(samples[0])  # a repeated sequence is kept once
    cache = FeatureCache(fids, "cpu", head if topk else None, topk)
    stream = data_mod.batches(samples, batch_size=2, seed=0, pad_id=0)  # endless: epochs until all are kept
    while len(cache) < 3:
        b = next(stream)
        cache.keep(b, torch.randn(*b.input_ids.shape, len(fids) * H))
    held = sum(t.nbytes for r in cache._rows.values() for t in (r if isinstance(r, tuple) else (r,)))
    width = (len(fids) - (1 if topk else 0)) * H
    assert feature_cache_bytes(28, width=width, elem_bytes=4, topk=topk) == held

    cfg = SimpleNamespace(train=SimpleNamespace(kl_topk=topk), data=SimpleNamespace(max_len=96))
    place = SimpleNamespace(has_drafter=True, drafter_device="cpu", target_devices=["cpu"])
    target = SimpleNamespace(config=SimpleNamespace(hidden_size=H))
    prep = SimpleNamespace(samples=samples, features=None)
    est = {"peak": 1000, "parts": {"weights": 1000}}
    fits = _check_feature_cache(cfg, place, target, prep, est, fids, torch.float32,
                                room=lambda d: (1000 + held, "the host has enough"))
    assert fits["peak"] == 1000 + held and fits["parts"]["the feature cache"] == held
    with pytest.raises(Exception) as e:
        _check_feature_cache(cfg, place, target, prep, est, fids, torch.float32,
                             room=lambda d: (1000 + held - 1, "the cgroup leaves 0.0 GiB"))
    msg = str(e.value)
    assert msg.startswith("train.feature_cache=true keeps") and "3 sequences, 28 tokens" in msg, msg
    assert "the cgroup leaves 0.0 GiB" in msg and "train.feature_cache=false" in msg and "\n" not in msg
    # what regeneration kept is in the process already: only the rest must still fit
    pre = {tuple(s.ids.tolist()): torch.zeros(len(s.ids), width) for s in samples[:3]}
    _check_feature_cache(cfg, place, target, SimpleNamespace(samples=samples, features=pre), est, fids,
                         torch.float32, room=lambda d: (1000 + held - 28 * width * 4, "the host"))

"""Layout parsing, batch assignment and the balance answer: pure functions, no ranks."""
from __future__ import annotations

import pytest

from dflash.analysis.balance import answer, balance
from dflash.run.roles.layout import Layout, LayoutError


def test_layout_parses_either_order_and_names_bad_values():
    assert Layout.parse("target:5,drafter:3") == Layout(5, 3) == Layout.parse(" drafter:3 , target:5 ")
    assert str(Layout(5, 3)) == "target:5,drafter:3"
    for bad in ("target:5", "target:5,drafter:0", "target:x,drafter:1", "tgt:1,drafter:1",
                "target:1,target:2", ""):
        with pytest.raises(LayoutError, match="pipeline.layout="):
            Layout.parse(bad)
    with pytest.raises(LayoutError, match="needs 8 ranks, but torchrun started WORLD_SIZE=4"):
        Layout(5, 3).check_world(4)


def test_every_batch_has_one_producer_and_one_consumer_round_robin():
    lay = Layout(3, 2)
    assert [lay.role(r) for r in range(5)] == ["target"] * 3 + ["drafter"] * 2
    made = sorted(g for t in range(3) for g in lay.batches_of_target(t, 0, 8))
    assert made == list(range(16))  # 8 steps x 2 drafters, each batch made exactly once
    assert list(lay.batches_of_target(1, 0, 8)) == [1, 4, 7, 10, 13]
    assert list(lay.batches_of_target(1, 3, 8)) == [7, 10, 13]  # a resume starts mid-sequence
    for g in range(16):
        d, step = lay.consumer(g)
        assert lay.batch_id(step, d) == g and lay.producer(g) == g % 3


def test_balance_from_the_issue_figures():
    # target forward 180 ms, drafter work 71 ms per batch: about 2.5 target ranks per drafter rank
    b = answer({"target_s_per_batch": 0.180, "drafter_s_per_batch": 0.071, "targets": 5, "drafters": 3})
    assert b["balanced_targets_per_drafter"] == pytest.approx(2.535, abs=1e-3)
    assert b["idle_side"] == "drafter"  # 5/0.18 = 27.8 batches/s < 3/0.071 = 42.3
    assert b["idle_fraction"] == pytest.approx(1 - (5 / 0.18) / (3 / 0.071), abs=1e-3)
    assert (b["best_split"]["targets"], b["best_split"]["drafters"]) == (6, 2)


def _span(name, worker, rank, ms, **attrs):
    return {"name": name, "start_ns": 0, "end_ns": int(ms * 1e6), "resource": {"rank": rank},
            "attributes": {"worker": worker, "rank": rank, **attrs}}


def test_balance_measures_work_not_waits():
    spans = []
    for _ in range(5):
        spans += [_span("model_forward", "target0", 0, 100), _span("pack_hidden", "target0", 0, 10),
                  # 300 ms in the enqueue, 290 of it waiting for a credit: 10 ms of work
                  _span("cpu_copy_enqueue", "target0", 0, 300, blocked_s=0.29),
                  _span("queue_get", "drafter0", 1, 500),
                  _span("drafter_forward", "drafter0", 1, 20),
                  _span("backward", "drafter0", 1, 50, sync_s=0.02), _span("optimizer_step", "drafter0", 1, 10)]
    b = balance(spans)
    assert b["target_s_per_batch"] == pytest.approx(0.120, abs=1e-6)
    assert b["drafter_s_per_batch"] == pytest.approx(0.060, abs=1e-6)
    assert b["balanced_targets_per_drafter"] == pytest.approx(2.0)
    assert balance([s for s in spans if s["attributes"]["worker"] == "target0"]) is None


def test_the_wandb_summary_carries_the_balance_figure():
    from dflash.trackers.report import run_summary

    b = answer({"target_s_per_batch": 0.180, "drafter_s_per_batch": 0.071, "targets": 5, "drafters": 3})
    out = run_summary({"steps": 3, "balance": b}, None, "spans")
    assert out["balance/targets_per_drafter"] == b["balanced_targets_per_drafter"]
    assert out["balance/idle_side"] == "drafter" and out["balance/best_split_speedup"] == b["best_split"]["speedup"]


def test_the_payload_goes_over_nccl_only_between_distinct_gpus():
    from dflash.config import load_config
    from dflash.run.placement import _role_device, handoff_backend

    def cfg(t, d, handoff="auto"):
        return load_config(None, [f"pipeline.target_devices={t}", f"pipeline.drafter_devices={d}",
                                  f"pipeline.handoff={handoff}"])
    assert handoff_backend(cfg("cuda", "cuda")) == "nccl"              # cuda:LOCAL_RANK on each rank
    assert handoff_backend(cfg("cuda:0,cuda:1", "cuda:2")) == "nccl"
    assert handoff_backend(cfg("cuda:0", "cuda:0")) == "gloo"          # one GPU for both roles: NCCL refuses
    assert handoff_backend(cfg("cpu", "cpu")) == "gloo"
    assert handoff_backend(cfg("cuda:0", "cuda:0", "nccl")) == "nccl"  # the user's call
    c = cfg("cuda:0,cuda:1,cuda:2,cuda:3,cuda:4", "cuda:5,cuda:6,cuda:7")
    assert [_role_device(c.pipeline.target_devices, i) for i in range(5)] == [f"cuda:{i}" for i in range(5)]
    assert [_role_device(c.pipeline.drafter_devices, i) for i in range(3)] == ["cuda:5", "cuda:6", "cuda:7"]

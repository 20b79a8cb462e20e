"""configs/demo.yaml and configs/demo-long.yaml: the long demo is the demo's recipe with more
data and steps (same target, drafter and eval), and both hold out exactly the 64 prompts
their eval scores and their learning curve walks."""
from __future__ import annotations

import dataclasses

from helpers import ROOT
from dflash.config import load_config
from dflash.data.dataset import split_heldout

DEMO, LONG = (load_config(str(ROOT / "configs" / f"{name}.yaml")) for name in ("demo", "demo-long"))


def test_the_long_demo_changes_data_and_training_only():
    assert dataclasses.asdict(LONG.model) == dataclasses.asdict(DEMO.model)
    assert dataclasses.asdict(LONG.eval) == dataclasses.asdict(DEMO.eval)
    assert not LONG.model.copy_head  # its figure is the served drafter's
    trained = [len(split_heldout(range(c.data.num_conversations), eval_fraction=c.data.eval_fraction)[0])
               for c in (DEMO, LONG)]
    assert trained[1] > 5 * trained[0]  # conversations it trains on (before held-out repeats go)
    assert LONG.train.steps >= 5 * DEMO.train.steps
    assert LONG.out == "runs/demo-long" != DEMO.out


def test_each_demo_holds_out_the_prompts_its_eval_scores():
    for cfg in (DEMO, LONG):
        _, held = split_heldout(range(cfg.data.num_conversations), eval_fraction=cfg.data.eval_fraction)
        assert len(held) == cfg.eval.prompts == cfg.train.estimate_samples == 64

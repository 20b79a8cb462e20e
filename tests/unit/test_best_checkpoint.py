"""The best checkpoint by the held-out estimate (run/best.py): the weights of the step
whose estimate was best, not the last ones. A real run's summary, files and export:
tests/integration/test_train.py."""
from __future__ import annotations

import json
from types import SimpleNamespace

import torch
from safetensors.torch import load_file

from dflash.config import Config
from helpers import small_drafter
from dflash.run.best import BestKeeper


def test_keeps_the_weights_of_the_best_estimate_not_the_last(tmp_path):
    drafter = small_drafter()
    train_step = SimpleNamespace(drafter=drafter)
    keeper = BestKeeper(tmp_path, Config(), train_step, None, None, lead=True)
    seen = {}
    for step, tau in ((0, 1.0), (10, 1.3), (20, 1.2), (30, 1.3)):
        with torch.no_grad():
            drafter.fc.weight.fill_(float(step))  # the weights of each step, told apart
        seen[step] = drafter.fc.weight.clone()
        keeper.queued(step)
        keeper.result(step, tau)
    keeper.writer.wait()
    w = load_file(str(tmp_path / "best" / "checkpoint" / "model.safetensors"))
    assert torch.equal(w["fc.weight"], seen[10])  # 1.3 first at step 10; the tie at 30 keeps it
    st = json.loads((tmp_path / "best" / "checkpoint" / "trainer_state.json").read_text())
    assert st["step"] == 10 and st["acceptance_estimate"] == 1.3
    assert keeper.best == (10, 1.3)
    # a resumed run carries the bar on: a later 1.25 is not better
    again = BestKeeper(tmp_path, Config(), train_step, None, None, lead=True, resume=True)
    assert again.best == (10, 1.3)
    again.queued(40)
    again.result(40, 1.25)
    assert again.writer is None


def test_after_a_resume_an_equal_tau_is_not_better(tmp_path):
    """Issue 54: the best tau was stored rounded to 6 places, so after a resume the same tau
    (1.2345674, stored 1.234567) beat it and replaced the earlier, equal step."""
    train_step = SimpleNamespace(drafter=small_drafter())
    keeper = BestKeeper(tmp_path, Config(), train_step, None, None, lead=True)
    tau = 1.2345674
    keeper.queued(10)
    keeper.result(10, tau)
    keeper.writer.wait()
    again = BestKeeper(tmp_path, Config(), train_step, None, None, lead=True, resume=True)
    assert again.best == (10, tau)
    again.queued(20)
    again.result(20, tau)  # a tie keeps the earlier step, resumed or not
    assert again.best == (10, tau) and again.writer is None

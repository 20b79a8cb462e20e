"""The one end-of-step path (dflash.run.workers.StepEnd), shared by the reference loop and the
pipeline: tokens, read-back into history and metrics, non-finite markers, save cadence."""
import contextlib

import torch

import dflash.run.workers as workers_mod
from dflash.config import Config
from dflash.run.context import RunSpec, RunState
from dflash.run.placement import Placement
from dflash.run.workers import StepEnd


class FakeTel:
    def __init__(self):
        self.adds, self.records, self.stages = [], [], []

    def add(self, name, value, **attrs):
        self.adds.append((name, value, attrs))

    def record(self, name, value, **attrs):
        self.records.append((name, value))

    @contextlib.contextmanager
    def stage(self, name, **kw):
        events = []
        self.stages.append((name, kw, events))

        class Span:
            def event(self, ev, **attrs):
                events.append((ev, attrs))

        yield Span()


class FakeStep:
    step = 0


def _run(tmp_path, save_every=0):
    cfg = Config()
    cfg.train.steps, cfg.train.save_every = 6, save_every
    place = Placement("both", "queue", rank=1, world=2)  # rank 1: no progress bar drawn
    spec = RunSpec(cfg=cfg, placement=place, out=tmp_path, run_id="r", tokenizer=None, layer_ids=[],
                   feature_ids=[], start_step=0, target_config=None, samples=[])
    return spec, RunState(tel=FakeTel(), train_step=FakeStep())


def _t(x):
    return torch.tensor(x)


def test_step_end_counts_tokens_reads_back_and_emits_metrics(tmp_path):
    spec, state = _run(tmp_path)
    end = StepEnd(spec, state, "main")
    for step, tokens in enumerate((10, 7)):
        state.train_step.step = step + 1  # what optimizer_step does
        end(step, tokens, _t(2.0 - step), _t(0.5), _t(1.5), _t(False))
    end.close()
    assert state.tokens == 17
    assert [(s, l, a, g) for s, l, a, g in state.history] == [(0, 2.0, 0.5, 1.5), (1, 1.0, 0.5, 1.5)]
    assert ("dflash.tokens", 10, {"worker": "main"}) in state.tel.adds
    assert [a for a in state.tel.adds if a[0] == "dflash.train.steps"] == [("dflash.train.steps", 1, {"worker": "main"})] * 2
    assert [r for r in state.tel.records if r[0] == "dflash.train.loss"] == [("dflash.train.loss", 2.0),
                                                                           ("dflash.train.loss", 1.0)]
    assert state.tel.stages == [] and state.nonfinite == []


def test_step_end_marks_a_nonfinite_step_in_its_batch_trace(tmp_path):
    spec, state = _run(tmp_path)
    end = StepEnd(spec, state, "drafter0")
    state.train_step.step = 4
    end(3, 5, _t(float("nan")), _t(0.0), _t(float("inf")), _t(True))
    assert state.nonfinite == [3]
    (name, kw, events), = state.tel.stages
    assert name == "skipped_step" and kw["trace"] == ("batch", 3) and kw["worker"] == "drafter0"
    assert events == [("nonfinite_loss", {"step": 3, "action": "update skipped"})]
    assert ("dflash.train.nonfinite_steps", 1, {}) in state.tel.adds


def test_step_end_saves_on_the_save_every_cadence(tmp_path, monkeypatch):
    saved = []
    monkeypatch.setattr(workers_mod, "save", lambda spec, state: saved.append(state.train_step.step))
    spec, state = _run(tmp_path, save_every=2)
    end = StepEnd(spec, state, "main")
    for step in range(5):
        state.train_step.step = step + 1
        end(step, 1, _t(1.0), _t(0.0), _t(0.0), _t(False))
    assert saved == [2, 4]
    spec0, state0 = _run(tmp_path, save_every=0)
    end0 = StepEnd(spec0, state0, "main")
    saved.clear()
    for step in range(3):
        state0.train_step.step = step + 1
        end0(step, 1, _t(1.0), _t(0.0), _t(0.0), _t(False))
    assert saved == [], "save_every=0: only the final save, which train() does"

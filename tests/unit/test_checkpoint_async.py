"""Checkpoints leave the drafter's critical path: a snapshot on the drafter's thread, the
write on another thread, still atomic, errors still surface."""
import threading

import pytest
import torch

from dflash.checkpoint import checkpoint as ckpt
from helpers import small_drafter


def _drafter():
    d = small_drafter()
    opt = torch.optim.AdamW(d.parameters(), lr=0.1)
    d.fc.weight.grad = torch.ones_like(d.fc.weight)
    opt.step()
    return d, opt


def test_snapshot_is_frozen_at_the_time_it_was_taken(tmp_path):
    d, opt = _drafter()
    w0 = d.fc.weight.detach().clone()
    m0 = opt.state[d.fc.weight]["exp_avg"].clone()
    snap = ckpt.snapshot(d, run_config={}, state={"step": 1, "history": [(0, 1.0)]},
                         training_state={"optimizer": opt.state_dict()})
    with torch.no_grad():  # training goes on while the writer has not written yet
        d.fc.weight.add_(1.0)
        opt.state[d.fc.weight]["exp_avg"].add_(1.0)
    ckpt.write(tmp_path / "checkpoint", snap)
    loaded, _ = ckpt.load_drafter(tmp_path / "checkpoint")
    assert torch.equal(loaded.fc.weight, w0)
    tstate, jstate = ckpt.load_training_state(tmp_path / "checkpoint")
    saved_m = next(s["exp_avg"] for s in tstate["optimizer"]["state"].values() if s["exp_avg"].shape == m0.shape)
    assert torch.equal(saved_m, m0)
    assert jstate["step"] == 1


def test_writer_returns_before_the_write_and_replaces_atomically(tmp_path, monkeypatch):
    d, opt = _drafter()
    path = tmp_path / "checkpoint"
    ckpt.save(path, d, run_config={}, state={"step": 0})
    gate, entered = threading.Event(), threading.Event()
    real = ckpt.write

    def slow_write(p, snap):  # a write that cannot finish until the test says so
        entered.set()
        assert gate.wait(30)
        return real(p, snap)

    monkeypatch.setattr(ckpt, "write", slow_write)
    w = ckpt.CheckpointWriter()
    with torch.no_grad():
        d.fc.weight.add_(1.0)
    w.submit(path, ckpt.snapshot(d, run_config={}, state={"step": 1}))
    assert entered.wait(30)
    # submit has returned while the write is still blocked: the caller did not wait for it,
    # and the previous checkpoint is still complete on disk
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert '"step": 0' in (path / "trainer_state.json").read_text()
    gate.set()
    w.wait()
    assert '"step": 1' in (path / "trainer_state.json").read_text()
    loaded, _ = ckpt.load_drafter(path)
    assert torch.equal(loaded.fc.weight, d.fc.weight)
    assert not list(tmp_path.glob(".checkpoint.tmp-*")), "no temp dir left behind"


def test_a_failed_write_is_raised_on_the_next_wait(tmp_path):
    d, _ = _drafter()
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    w = ckpt.CheckpointWriter()
    w.submit(blocker / "checkpoint", ckpt.snapshot(d, run_config={}, state={"step": 0}))
    with pytest.raises(ckpt.CheckpointError, match="checkpoint write failed"):
        w.wait()

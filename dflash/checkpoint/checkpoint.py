"""Hugging Face-style drafter checkpoints, written atomically.

Layout of DIR/checkpoint/:
  config.json          DrafterConfig (+ the run config under "dflash_run")
  model.safetensors    drafter weights only (the target's embedding / lm_head stay with the target)
  training_state.safetensors + training_state.json
                       optimizer, scheduler, RNG states and the step: what --resume needs,
                       stored without pickle (state_tree.py); an earlier version's
                       training_state.pt is read with torch's weights-only loader
  trainer_state.json   step, tokens and the loss history so far (human readable)

Saves during training are asynchronous (`snapshot` + `CheckpointWriter`): the drafter's
thread only clones weights and optimizer state on their device (no host wait); a writer
thread copies them to the host on a side stream and writes them. One write at a time.

A save writes everything into a temp dir beside the target and swaps it in with renames,
so a kill at any moment leaves either the previous checkpoint or the new one (a leftover
`checkpoint.old` is picked up by `resolve`). Replacing a checkpoint deletes only the files
dflash writes (checkpoint_files.WRITTEN); temp dirs left by a killed save are removed on
the next save.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import pickle
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..model.architectures import expected_shapes, make_drafter
from ..model.drafter import DFlashDrafter, DrafterConfig
from ..preflight import checkpoint_files as files
from ..preflight.checkpoint_files import CheckpointError, resolve  # noqa: F401  (torch-free; re-exported)
from ..preflight.inputs import read_json_object
from . import state_tree


def save(path: str | os.PathLike, drafter: DFlashDrafter, *, run_config: dict, state: dict,
         training_state: dict | None = None) -> Path:
    """Synchronous save (snapshot + write on the calling thread)."""
    return write(path, snapshot(drafter, run_config=run_config, state=state, training_state=training_state))


# -- asynchronous saves: snapshot on the drafter's thread, write on another ------------------
@dataclass
class Snapshot:
    """Everything a checkpoint holds, detached from the live model and optimizer."""
    config: dict
    tensors: dict                     # drafter weights (device copies until written)
    training_state: dict | None
    state: dict
    ready: torch.cuda.Event | None = None   # the device copies are complete (CUDA)


def _clone(obj):
    """Deep copy of a state tree; tensors are cloned on their own device (on CUDA a
    stream-ordered device-to-device copy: the caller's thread does not wait for it)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return copy.deepcopy(obj)


def _to_host(obj):
    if isinstance(obj, torch.Tensor):
        return obj.to("cpu").contiguous()
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return obj


def snapshot(drafter: DFlashDrafter, *, run_config: dict, state: dict, training_state: dict | None = None,
             copy: bool = True) -> Snapshot:
    """A consistent copy of weights and optimizer state as of now, cheap enough for the
    drafter's critical path: device-side clones plus an event, no host read. ``copy=False``
    when nothing changes them until the write is done (the end of a run): the live tensors
    themselves, so the last save costs no second copy of weights and moments (12 bytes a
    parameter: what pushed a CPU run in a 2 GB cgroup over its limit, issue 54)."""
    own = _clone if copy else (lambda t: t)
    tensors = {k: own(v.detach()) for k, v in drafter.state_dict().items()}
    snap = Snapshot(config=drafter.cfg.to_dict() | {"dflash_run": run_config}, tensors=tensors,
                    training_state=own(training_state) if training_state is not None else None,
                    state=_clone(state))
    devs = {t.device for t in tensors.values() if t.device.type == "cuda"}
    if devs:
        snap.ready = torch.cuda.Event()
        snap.ready.record(torch.cuda.current_stream(next(iter(devs))))
    return snap


class CheckpointWriter:
    """Writes snapshots on one background thread, one at a time, each atomically (`write`).

    `submit` returns at once unless the previous write is still running (then it waits:
    two writes must not race on the same directory). `wait` joins the write in flight and
    re-raises its error, so a failed write fails the run instead of passing silently."""

    def __init__(self, tel=None):
        self.tel = tel
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_write_s = 0.0
        self.writes = 0

    def submit(self, path, snap: Snapshot) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(Path(path), snap), daemon=False,
                                        name="dflash-checkpoint-writer")
        self._thread.start()

    def _run(self, path: Path, snap: Snapshot) -> None:
        t0 = time.perf_counter()
        try:
            stage = self.tel.stage("checkpoint_write", worker="checkpoint_writer", step=snap.state.get("step", -1)) \
                if self.tel is not None else contextlib.nullcontext()
            with stage:
                write(path, snap)
        except BaseException as e:  # re-raised on the drafter's thread by wait()
            self._error = e
        finally:
            self.last_write_s = time.perf_counter() - t0
            self.writes += 1

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"checkpoint write failed: {type(err).__name__}: {err}") from err


def write(path: str | os.PathLike, snap: Snapshot) -> Path:
    """Write a snapshot atomically: a temp dir beside the target, swapped in with renames."""
    if snap.ready is not None:  # poll, never block the device: the clones are queued work
        while not snap.ready.query():
            time.sleep(0.001)
    side = None
    devs = {t.device for t in snap.tensors.values() if t.device.type == "cuda"}
    if devs:  # copy out on a side stream: the drafter's stream never queues behind it
        side = torch.cuda.Stream(next(iter(devs)))
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        tensors = _to_host(snap.tensors)
        training_state = _to_host(snap.training_state)
    dst = Path(path)
    dst.parent.mkdir(parents=True, exist_ok=True)
    files.clean_stale_temps(dst)  # a save killed with -9 left a whole checkpoint in one
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        (tmp / files.CONFIG).write_text(json.dumps(snap.config, indent=2))
        save_file(tensors, str(tmp / files.WEIGHTS), metadata={"format": "pt"})
        if training_state is not None:
            state_tree.save(training_state, tmp / files.STATE_TENSORS, tmp / files.STATE_TREE)
        (tmp / files.TRAINER_STATE).write_text(json.dumps(snap.state, indent=2))
        files.plain_modes(tmp)  # readable as a plain write would be (mkdtemp makes it private)
        for f in tmp.iterdir():  # data on disk before the rename makes it visible
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        old = dst.with_name(dst.name + ".old")
        if old.exists() and not dst.exists():
            os.replace(old, dst)  # a kill between the two renames last time: old is the good one
        files.remove_written(old)
        if dst.exists():
            os.replace(dst, old)
        os.replace(tmp, dst)
        _fsync_dir(dst.parent)
        files.remove_written(old)  # a file dflash did not write keeps old, renamed aside
    except BaseException:
        files.remove_written(tmp)
        raise
    return dst


def _fsync_dir(path: Path) -> None:
    """Make the renames themselves durable (POSIX: fsync the directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_drafter(path, device="cpu", dtype=torch.float32) -> tuple[DFlashDrafter, dict]:
    p, raw = files.check_readable(path)  # sizes within bounds, the file whole
    try:
        cfg = DrafterConfig.from_dict(raw)
    except TypeError as e:  # a config.json without the drafter's fields
        raise CheckpointError(f"checkpoint {str(path)!r}: {files.CONFIG} is not a dflash drafter config ({e})") from None
    err = files.header_mismatch(expected_shapes(cfg), {files.WEIGHTS: files.check_safetensors(p / files.WEIGHTS)})
    if err:  # before a module is built or a weight read
        raise CheckpointError(f"checkpoint {str(path)!r}: {err}")
    drafter = make_drafter(cfg)
    try:
        drafter.load_state_dict(load_file(str(p / files.WEIGHTS)))
    except RuntimeError as e:  # missing / unexpected / mis-shaped weights
        first = str(e).strip().splitlines()
        raise CheckpointError(f"checkpoint {str(path)!r}: weights do not fit its config "
                              f"({first[1].strip() if len(first) > 1 else first[0]})") from None
    return drafter.to(device=device, dtype=dtype), raw.get("dflash_run", {})


def load_training_state(path) -> tuple[dict, dict]:
    """(optimizer/scheduler/RNG state, trainer_state.json). Nothing in either file can run
    code: safetensors + JSON, or an earlier version's pickle through torch's weights-only
    loader, which refuses every object that is not a tensor or a plain value."""
    p = resolve(path)
    jstate = read_json_object(p / files.TRAINER_STATE, f"checkpoint {str(path)!r}", CheckpointError)
    if (p / files.STATE_TREE).is_file():
        try:
            return state_tree.load(p / files.STATE_TENSORS, p / files.STATE_TREE), jstate
        except state_tree.StateFormatError as e:
            raise CheckpointError(f"checkpoint {str(path)!r}: training state unreadable ({e})") from None
    legacy = p / files.LEGACY_STATE
    if not legacy.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r}: no training state (cannot resume from it)")
    try:
        return torch.load(legacy, weights_only=True), jstate
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"checkpoint {str(path)!r}: {files.LEGACY_STATE} holds objects other than tensors and plain values, "
            "which dflash refuses to unpickle (a crafted file runs code); dflash never writes such a file, so "
            "this one was not written by dflash train: train into a new --out instead") from None
    except (OSError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r}: {files.LEGACY_STATE} unreadable ({type(e).__name__})") from None

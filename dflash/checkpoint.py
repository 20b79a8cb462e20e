"""Hugging Face-style drafter checkpoints, written atomically.

Layout of DIR/checkpoint/:
  config.json          DrafterConfig (+ the run config under "dflash_run")
  model.safetensors    drafter weights only (the target's embedding / lm_head stay with the target)
  training_state.pt    optimizer, scheduler, RNG states and the step: what --resume needs
  trainer_state.json   step, tokens and the loss history so far (human readable)

A save writes everything into a temp dir beside the target and swaps it in with renames,
so a kill at any moment leaves either the previous checkpoint or the new one (a leftover
`checkpoint.old` is picked up by `resolve`).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .drafter import DFlashDrafter, DrafterConfig


class CheckpointError(ValueError):
    pass


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint dir to read: the path itself, or the `.old` left by an interrupted swap."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    old = p.with_name(p.name + ".old")
    if (old / "config.json").is_file():
        return old
    raise CheckpointError(f"checkpoint {str(path)!r}: no config.json there (expected a dir written by dflash train)")


def save(path: str | os.PathLike, drafter: DFlashDrafter, *, run_config: dict, state: dict,
         training_state: dict | None = None) -> Path:
    dst = Path(path)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        cfg = drafter.cfg.to_dict() | {"dflash_run": run_config}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in drafter.state_dict().items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if training_state is not None:
            torch.save(training_state, tmp / "training_state.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
        for f in tmp.iterdir():  # data on disk before the rename makes it visible
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        old = dst.with_name(dst.name + ".old")
        if old.exists() and not dst.exists():
            os.replace(old, dst)  # a kill between the two renames last time: old is the good one
        if old.exists():
            shutil.rmtree(old)
        if dst.exists():
            os.replace(dst, old)
        os.replace(tmp, dst)
        _fsync_dir(dst.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
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
    p = resolve(path)
    raw = json.loads((p / "config.json").read_text())
    drafter = DFlashDrafter(DrafterConfig.from_dict(raw))
    drafter.load_state_dict(load_file(str(p / "model.safetensors")))
    return drafter.to(device=device, dtype=dtype), raw.get("dflash_run", {})


def load_training_state(path) -> tuple[dict, dict]:
    p = resolve(path)
    f = p / "training_state.pt"
    if not f.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r}: no training_state.pt (cannot resume from it)")
    return torch.load(f, weights_only=False), json.loads((p / "trainer_state.json").read_text())

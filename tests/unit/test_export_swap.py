"""An export is replaced in one step (issue 54): a kill at any moment of `export --overwrite`
(or of the export at the end of `dflash train`) leaves the earlier export or the new one at
--out, whole, never neither; and what a killed export left beside it (`.NAME.tmp-PID-*`, an
earlier export set aside) is swept by the next export once its writer is gone."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, served_drafter

DEAD = 4194305  # above PID_MAX_LIMIT (2**22): never a live process

_CHILD = """
import os, sys
sys.path.insert(0, {tests!r})
import torch
from dflash.checkpoint import export as X
from dflash.preflight import checkpoint_files as files
from dflash.model.architectures import make_drafter
from dflash.model.drafter import DrafterConfig
from dflash.model.target import _tiny_config, load_tokenizer

out, where, exchange = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
tc = _tiny_config("tiny-qwen3", load_tokenizer("tiny-qwen3"))
cfg = DrafterConfig.from_target(tc, target_layer_ids=[1, 3], vocab_size=tc.vocab_size, mask_token_id=16,
                                block_size=4, num_hidden_layers=1)
torch.manual_seed(2)  # weights of its own: told apart from the earlier export's
drafter = make_drafter(cfg)
if not exchange:  # a file system without renameat2's exchange: the rename-aside way
    X._exchange = lambda a, b: False

def dies_after(f):
    def wrapped(*a, **k):
        r = f(*a, **k)
        os._exit(9)  # SIGKILL's effect: nothing after this runs, no finally, no atexit
    return wrapped

def dies_at(f):
    def wrapped(*a, **k):
        os._exit(9)
    return wrapped

if where == "before":  # the new export whole in its temp dir, nothing swapped yet
    files.plain_modes = dies_after(files.plain_modes)
elif where == "swapped":  # the earlier export's files about to be deleted
    files.remove_written = dies_at(files.remove_written)
else:  # just after they were: in the version before this one, the new export was not in yet
    files.remove_written = dies_after(files.remove_written)
X.write_export(drafter, tc, out, dtype="float32", target="tiny-qwen3")
"""


def _weights(d: Path) -> bytes:
    return (d / "model.safetensors").read_bytes()


def _left_beside(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name)


@pytest.mark.parametrize("where,exchange", [("before", True), ("swapped", True), ("between", True),
                                            ("swapped", False)])
def test_a_kill_during_an_overwrite_leaves_a_whole_export_and_the_next_sweeps_what_it_left(tmp_path, where,
                                                                                           exchange):
    out = tmp_path / "export"
    served_drafter(out)
    old = _weights(out)
    p = subprocess.run([sys.executable, "-c", _CHILD.format(tests=str(ROOT / "tests")), str(out), where,
                        str(int(exchange))], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 9, p.stderr[-2000:]
    assert (out / "config.json").is_file() and (out / ".dflash-export").is_file(), sorted(os.listdir(tmp_path))
    assert _weights(out) == old if where == "before" else _weights(out) != old  # the earlier one, or the new one
    if where != "between":
        assert _left_beside(out), "the kill left nothing beside the export (the fault was not injected)"
    served_drafter(out)  # the next export: swept
    assert _left_beside(out) == [] and _weights(out) == old


def test_an_earlier_export_set_aside_by_a_killed_writer_comes_back(tmp_path):
    """The rename-aside way has a moment with no export (aside, the new one not yet in): the
    sweep puts the earlier one back; one whose writer lives is left alone."""
    from dflash.checkpoint.export import sweep_stale

    out = tmp_path / "export"
    aside = tmp_path / f".export.old-{DEAD}-abc"
    served_drafter(aside)
    live = tmp_path / f".export.tmp-{os.getpid()}-xyz"
    live.mkdir()
    (tmp_path / ".export.tmp-junk").mkdir()  # not a name an export makes: never touched
    sweep_stale(out)
    assert (out / "config.json").is_file() and not aside.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".export.tmp-junk", live.name, "export"])


def test_an_export_that_appeared_while_this_one_was_made_is_not_replaced_without_overwrite(tmp_path):
    """Two `dflash export --out cc` at once both said "exported": the later rename replaced the
    other's export though neither had --overwrite. The second now refuses, the first kept."""
    from dflash.checkpoint import export as X
    from dflash.errors import ConfigError

    out = tmp_path / "cc"
    served_drafter(out)  # the other process's export, there by the time this one swaps in
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="another export was written there while this one was made"):
        _another_drafter(X, out, replace=False)  # dflash export without --overwrite, its check long passed
    assert (out / "model.safetensors").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".cc.tmp")]  # its temp dir removed


def _another_drafter(X, path, replace: bool):
    import torch

    from dflash.model.drafter import DFlashDrafter, DrafterConfig
    from dflash.model.target import _tiny_config, load_tokenizer

    tc = _tiny_config("tiny-qwen3", load_tokenizer("tiny-qwen3"))
    cfg = DrafterConfig.from_target(tc, target_layer_ids=[1, 3], vocab_size=tc.vocab_size, mask_token_id=16,
                                    block_size=4, num_hidden_layers=1)
    torch.manual_seed(3)
    return X.write_export(DFlashDrafter(cfg), tc, path, dtype="float32", target="tiny-qwen3", replace=replace)


def test_a_full_disk_is_named_in_words_from_either_kind_of_error():
    import errno

    from dflash.checkpoint.export import _no_room

    assert _no_room(OSError(errno.ENOSPC, "No space left on device")) == "no space left on device"
    assert _no_room(RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                                 "message: \"No space left on device\" })")) == "no space left on device"
    assert _no_room(ValueError("shape mismatch")) is None

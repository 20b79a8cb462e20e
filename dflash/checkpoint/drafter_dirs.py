"""Read a drafter from either directory kind `dflash eval` and `--init-from` accept.

- ours: `RUN/checkpoint/` written by `dflash train` (architectures ["DFlashDrafter"], the run
  config under "dflash_run", training state for --resume);
- served: the z-lab format (checkpoint/export_format.py) that `dflash export` writes, z-lab
  publishes and SpecForge exports. It carries no run config: the target comes from --target.

The kind is told by config.json alone (`export_format.is_export_config`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from . import export_format as fmt


class DrafterDirError(ConfigError):
    """A drafter directory that cannot be read or does not fit the target: bad input, exit 2."""


@dataclass
class DrafterDir:
    path: Path
    kind: str                      # "checkpoint" (ours) | "export" (the served format)
    raw: dict                      # its config.json
    run_config: dict = field(default_factory=dict)  # ours only: the training run's config
    # a draft vocabulary's highest target token id and the draft id that maps to it (d2t /
    # draft_ids); None without one. Checked against the target's rows (check_fits, fit_error)
    draft_token_max: tuple[int, int] | None = None

    @property
    def target(self) -> str | None:
        return (self.run_config.get("model") or {}).get("target") or self.raw.get("target") or None


def inspect(path: str | Path, flag: str = "--checkpoint") -> DrafterDir:
    """Which kind a directory is, from its config.json, and that what it holds can be used,
    before an engine or a decoder sees it (one line each; nothing heavy is imported): a
    config and safetensors that are regular files (a FIFO would hang the reader), whole,
    within bounds; every weight finite (read in bounded memory: a NaN drafter fails eval at
    T > 0 and trains nan -> nan); a draft vocabulary's ids inside its vocabulary. `flag`:
    how the command names the dir in its messages (`dflash serve` has no --checkpoint)."""
    from ..preflight import checkpoint_files as files

    def named(e: Exception) -> str:  # checkpoint_files says "checkpoint '<dir>': ..."
        msg = str(e)
        return flag + msg[len("checkpoint"):] if msg.startswith("checkpoint ") else msg

    try:  # an interrupted checkpoint swap leaves `checkpoint.old`: resolve takes it
        p = files.resolve(path)
        raw = files.read_config(p)
        headers = {f: files.check_safetensors(f) for f in sorted(p.glob("*.safetensors")) or [p / files.WEIGHTS]}
    except files.CheckpointError as e:
        raise DrafterDirError(named(e)) from None
    if not isinstance(raw.get("dflash_config", {}), dict):  # what every reader looks into first
        raise DrafterDirError(f"{flag} {str(path)!r}: config.json: dflash_config={str(raw['dflash_config'])[:60]}: "
                              f"expected a mapping (of target_layer_ids, mask_token_id, block_size, ...)")
    if fmt.is_export_config(raw):
        try:
            f = fmt.drafter_config_fields(raw, str(path))
        except fmt.FormatError as e:
            raise DrafterDirError(str(e)) from None
        err = files.bounds_error(f, f"{flag} {str(path)!r}: config.json")
        if err:
            raise DrafterDirError(err)
        d = DrafterDir(p, "export", raw)
    else:
        if raw.get("model_type") != "dflash_drafter" and "DFlashDrafter" not in (raw.get("architectures") or []):
            raise DrafterDirError(f"{flag} {str(path)!r}: config.json is neither a dflash train checkpoint "
                                  f"nor a DFlash drafter (architectures {raw.get('architectures')})")
        try:
            files.check_drafter_bounds(path, raw)
        except files.CheckpointError as e:
            raise DrafterDirError(named(e)) from None
        from ..config import run_config_error
        err = run_config_error(raw.get("dflash_run") or {})  # its run's settings, each of its field's type
        if err:
            raise DrafterDirError(f"{flag} {str(path)!r}: config.json: {err}")
        f, d = raw, DrafterDir(p, "checkpoint", raw, raw.get("dflash_run") or {})
    try:  # the weights' values: after the config's bounds (sizes known sane), before anything is built
        for file in headers:  # a checkpoint's training state (optimizer moments) is not what is run
            if d.kind == "export" or file.name == files.WEIGHTS:
                files.check_safetensors(file, values=True)
    except files.CheckpointError as e:
        raise DrafterDirError(named(e)) from None
    d.draft_token_max = _draft_tokens(d, f, headers, flag)
    return d


def _draft_tokens(d: DrafterDir, fields: dict, headers: dict, flag: str) -> tuple[int, int] | None:
    """(highest target id, its draft id) of a draft vocabulary (served: `d2t` offsets, as
    vLLM reads EAGLE-3's; ours: `draft_ids`), refused when one falls outside the drafter's own
    vocab_size (an index error in eval, a dead engine on the first request when served)."""
    from ..preflight import checkpoint_files as files

    name = "d2t" if d.kind == "export" else "draft_ids"
    if not fields.get("draft_vocab_size"):
        return None
    for f, header in headers.items():
        k = next((k for k in header if k.removeprefix("model.") == name), None)
        if k is None or header[k][0] not in ("I64", "I32"):
            continue  # absent, or a float: the header check of load() names it
        found = files.token_ids(f, k, offsets=d.kind == "export")
        if found is None:
            continue  # empty: the header check of load() names its shape
        lo, lo_at, hi, hi_at = found
        vocab = fields["vocab_size"]
        for tok, at in ((lo, lo_at), (hi, hi_at)):
            if not 0 <= tok < vocab:
                raise DrafterDirError(f"{flag} {str(d.path)!r}: {f.name}: {name} maps draft id {at} to token "
                                      f"{tok}, outside the vocabulary (vocab_size={vocab} in config.json)")
        return hi, hi_at
    return None


def load(d: DrafterDir, device="cpu"):
    """The drafter (float32 master weights, eval-ready) of an inspected directory."""
    import torch

    if d.kind == "checkpoint":
        from . import checkpoint as ckpt
        drafter, _ = ckpt.load_drafter(d.path, device=device, dtype=torch.float32)
        return drafter
    from safetensors.torch import load_file

    from ..model.architectures import expected_shapes, make_drafter
    from ..model.drafter import DrafterConfig

    fields = fmt.drafter_config_fields(d.raw, str(d.path))
    files = sorted(d.path.glob("*.safetensors"))
    if not files:
        raise DrafterDirError(f"--checkpoint {str(d.path)!r}: no *.safetensors weights beside config.json")
    cfg = DrafterConfig(**fields, target=d.raw.get("target", ""))
    from ..preflight import checkpoint_files
    try:
        headers = {f.name: checkpoint_files.check_safetensors(f) for f in files}
    except checkpoint_files.CheckpointError as e:
        raise DrafterDirError(f"--{e}") from None
    own_head = cfg.draft_vocab_size > 0  # then lm_head.weight and d2t are the drafter's own
    err = checkpoint_files.header_mismatch(expected_shapes(cfg), headers,
                                           lambda k: fmt.from_export_name(k, own_head))
    if err:  # before a single weight is read or a module built
        raise DrafterDirError(f"--checkpoint {str(d.path)!r}: {err}")
    state = {}
    try:
        for f in files:
            state.update(fmt.import_state_dict(load_file(str(f)), own_head))
    except fmt.FormatError as e:
        raise DrafterDirError(f"{d.path}: {e}") from None
    drafter = make_drafter(cfg)
    want = drafter.state_dict()
    missing = sorted(set(want) - set(state))
    if missing:
        raise DrafterDirError(f"{d.path}: weights missing for this config: {', '.join(missing[:4])}"
                              + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
    for k, v in state.items():
        if tuple(v.shape) != tuple(want[k].shape):
            raise DrafterDirError(f"{d.path}: weight {fmt.to_export_name(k)} has shape {tuple(v.shape)}; "
                                  f"its config implies {tuple(want[k].shape)}")
    drafter.load_state_dict({k: v if k == "draft_ids" else v.float() for k, v in state.items()})
    return drafter.to(device)


def fields(d: DrafterDir) -> dict:
    """Its DrafterConfig fields, from config.json alone."""
    return fmt.drafter_config_fields(d.raw, str(d.path)) if d.kind == "export" else d.raw


# the fields that decide whether a drafter's weights fit a target (the rest are labels)
_FIT_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
               "vocab_size", "num_hidden_layers", "block_size", "target_layer_ids", "mask_token_id", "copy_head")


def check_fits(have: dict, where: str, *, target=None, built=None, draft_token_max=None) -> None:
    """One line (bad input, exit 2) naming the first way a drafter does not fit, from its
    DrafterConfig fields ``have`` (config.json: before its weights are read).
    - ``target``: the model it is to draft for (a served drafter, --init-from, eval): the
      target's hidden size, decoder layers and embedding rows (export_format.fit_error), and
      ``draft_token_max`` (DrafterDir.draft_token_max) within those rows;
    - ``built``: the DrafterConfig this run builds for its target (a resumed checkpoint: the
      CLI checked the run config, this checks shapes): every field that shapes the weights
      is equal."""
    if built is not None:
        from ..preflight.checkpoint_files import CheckpointError

        from .. import family

        # the family's own sizes (dflash/family/); a checkpoint without "arch" is a DFlash one
        extra = ("arch", *family.of(built).fit)
        for f in (*_FIT_FIELDS, *extra):
            a, b = have.get(f, family.DEFAULT) if f == "arch" else have[f], getattr(built, f)
            if a != b:
                raise CheckpointError(f"{where}: {f}={a!r} does not fit this run's target (expected {b!r})")
    if target is not None:
        from ..model.target import num_layers

        tc = target.config.get_text_config()
        err = fmt.fit_error(have, hidden_size=tc.hidden_size, num_layers=num_layers(target),
                            embed_rows=target.get_input_embeddings().weight.shape[0], where=where,
                            draft_token_max=draft_token_max)
        if err:
            raise DrafterDirError(err)

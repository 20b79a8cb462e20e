"""The drafter families' rooms (dflash/family/, model/architectures.py): one registry, and each
family's bounds read from one place: config.RANGES (a YAML or --set value) and the checkpoint
checks (a drafter's config.json) take the very same Bound, so changing it changes both."""
from __future__ import annotations

import dataclasses

import pytest

from dflash import family
from dflash.config import RANGES, ModelConfig, TrainConfig, load_config
from dflash.model.architectures import NETWORKS
from dflash.model.drafter import DrafterConfig
from dflash.preflight import checkpoint_files as files

FIELDS = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
              vocab_size=100, target_layer_ids=[0, 1], mask_token_id=5, num_hidden_layers=1, block_size=4)


def test_one_registry():
    assert tuple(NETWORKS) == family.NAMES == ("dflash", "dflash2", "dspark")
    for f in family.FAMILIES.values():  # every family field lives in the config tree and the drafter's config
        assert set(f.model_names) <= {x.name for x in dataclasses.fields(ModelConfig)} & \
            {x.name for x in dataclasses.fields(DrafterConfig)}
        assert set(f.train_names) <= {x.name for x in dataclasses.fields(TrainConfig)}


def test_the_backbone_sizes_are_written_once():
    assert ModelConfig().block_size == DrafterConfig(**{k: v for k, v in FIELDS.items() if k != "block_size"}) \
        .block_size == family.BLOCK_SIZE
    assert (RANGES["model.block_size"].lo, RANGES["model.block_size"].hi) == files.BOUNDS["block_size"] == \
        family.BLOCK_SIZES
    assert (RANGES["model.num_layers"].lo, RANGES["model.num_layers"].hi) == files.BOUNDS["num_hidden_layers"]


def _owner(key: str) -> family.Family:
    return next(f for f in family.FAMILIES.values() if key in f.bounds)


def _value(owner: family.Family, section: str, name: str, v):
    """v as the field's type (an int field's bound is checked with an int)."""
    cls = {"model": owner.model_fields, "train": owner.train_fields, "eval": owner.eval_fields}[section]
    return int(v) if type(getattr(cls, name)) is int else float(v)


@pytest.mark.parametrize("key", sorted(family.config_bounds()))
def test_each_bound_is_the_configs_and_the_checkpoints(key, monkeypatch):
    owner, b = _owner(key), family.config_bounds()[key]
    r = RANGES[key]
    assert (r.lo, r.hi, r.lo_open) == (b.lo, b.hi, b.lo_open)  # config.RANGES holds the family's Bound
    section, name = key.split(".")
    bad = _value(owner, section, name, b.lo if b.lo_open else b.lo - 1)  # just below it
    with pytest.raises(Exception, match=f"{key}="):
        load_config(None, [f"{key}={bad}"])
    if section != "model":
        return
    err = files.bounds_error(FIELDS | {"arch": owner.name, name: bad}, "x")  # a config.json: the same bound
    assert err is not None and f"{name}=" in err, err
    # and the checkpoint check reads it where it is: a tighter Bound refuses what the old one took
    fine = _value(owner, section, name, b.lo + 1)
    assert files.bounds_error(FIELDS | {"arch": owner.name, name: fine}, "x") is None
    monkeypatch.setitem(owner.bounds, key, dataclasses.replace(b, lo=b.lo + 2, lo_open=False))
    assert files.bounds_error(FIELDS | {"arch": owner.name, name: fine}, "x") is not None


def test_another_familys_settings_are_named_as_unused():
    from dflash import family
    from dflash.config import load_config

    assert family.unused_settings(*_sections(load_config(None, []))) == []
    cfg = load_config(None, ["model.markov_rank=8", "model.selector_rank=32"])
    assert family.unused_settings(*_sections(cfg)) == ["model.selector_rank=32 applies to model.arch=dflash2",
                                                       "model.markov_rank=8 applies to model.arch=dspark"]
    own = load_config(None, ["model.arch=dspark", "model.markov_rank=8"])
    assert family.unused_settings(*_sections(own)) == []


def _sections(cfg):
    return cfg.model, cfg.train

"""Every numeric config value is checked for type, finiteness and range, and every bad
config file is one line: the rules, tested over the whole tree rather than by example."""
import math

import pytest

from dflash.config import RANGES, Config, load_config, numeric_fields
from dflash.errors import ConfigError

FIELDS = dict(numeric_fields())


def test_every_numeric_field_has_a_range():
    """A new int/float config field without a rule fails here, not in a user's run."""
    missing = sorted(set(FIELDS) - set(RANGES))
    assert not missing, f"config fields without a Range in dflash/config.py RANGES: {missing}"
    assert not set(RANGES) - set(FIELDS), "RANGES names a field the config does not have"


def _override(key: str, value: str) -> str:
    """--set text that puts ``value`` into the field (lists and mappings take an element)."""
    default = Config()
    obj = default
    for part in key.split("."):
        obj = getattr(obj, part)
    if isinstance(obj, list):
        return f"{key}={value}"
    if isinstance(obj, dict):
        return f"{key}=model_forward={value}"
    return f"{key}={value}"


@pytest.mark.parametrize("key", sorted(k for k, t in FIELDS.items() if t is float))
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "nan", "inf"])
def test_no_float_field_takes_nan_or_inf(key, value):
    with pytest.raises(ConfigError) as e:
        load_config(None, [_override(key, value)])
    assert key.split(".")[-1] in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("key", sorted(k for k, t in FIELDS.items() if t is int))
@pytest.mark.parametrize("value", [".inf", ".nan", "1e400"])
def test_no_int_field_takes_inf_or_nan(key, value):
    with pytest.raises(ConfigError) as e:
        load_config(None, [_override(key, value)])
    assert key.split(".")[-1] in str(e.value)


@pytest.mark.parametrize("key", sorted(k for k, r in RANGES.items() if r.lo is not None))
def test_below_the_lower_bound_is_refused(key):
    rng, typ = RANGES[key], FIELDS[key]
    below = rng.lo if rng.lo_open else (rng.lo - 1 if typ is int else rng.lo - 1e-3)
    shown = str(int(below)) if typ is int else repr(float(below))
    with pytest.raises(ConfigError) as e:
        load_config(None, [_override(key, shown)])
    assert "expected" in str(e.value)


@pytest.mark.parametrize("key", sorted(k for k, r in RANGES.items() if r.hi is not None))
def test_above_the_upper_bound_is_refused(key):
    rng, typ = RANGES[key], FIELDS[key]
    above = rng.hi if rng.hi_open else (rng.hi + 1 if typ is int else rng.hi + 1e-3)
    with pytest.raises(ConfigError):
        load_config(None, [_override(key, str(above))])


@pytest.mark.parametrize("key", sorted(FIELDS))
def test_defaults_hold_their_own_ranges(key):
    obj = Config()
    for part in key.split("."):
        obj = getattr(obj, part)
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else [obj]
    assert all(RANGES[key].holds(v) for v in values)


def test_the_message_names_value_and_expectation():
    with pytest.raises(ConfigError, match=r"train.grad_clip=-1.0: expected a finite number > 0"):
        load_config(None, ["train.grad_clip=-1"])
    with pytest.raises(ConfigError, match=r"pipeline.inject_delay.data_load=nan: expected a finite number >= 0"):
        load_config(None, ["pipeline.inject_delay=data_load=nan"])
    assert math.isclose(load_config(None, ["train.lr=1e-3"]).train.lr, 1e-3)


def test_a_turn_is_zero_or_long_enough():
    """eval.engine_turn_ms: 0 asks whole requests; a turn shorter than 5 ms would be mostly the
    signals and /proc reads around it (engine/paired.py), so it is refused, not run."""
    assert load_config(None, ["eval.engine_turn_ms=0"]).eval.engine_turn_ms == 0
    assert load_config(None, ["eval.engine_turn_ms=5"]).eval.engine_turn_ms == 5
    with pytest.raises(ConfigError, match=r"eval.engine_turn_ms=0.001: expected 0 \(whole requests"):
        load_config(None, ["eval.engine_turn_ms=0.001"])


def test_layer_ids_beyond_the_target_are_refused_before_loading_it():
    with pytest.raises(ConfigError, match=r"model.target_layer_ids=\[1, 6\]: expected ids < 6"):
        load_config(None, ["model.target=tiny-qwen3", "model.target_layer_ids=1,6"])
    assert load_config(None, ["model.target=tiny-qwen3", "model.target_layer_ids=0,5"]).model.target_layer_ids == [0, 5]


def test_layer_ids_of_a_local_target_come_from_its_config_json(tmp_path):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 4}')
    with pytest.raises(ConfigError, match="expected ids < 4"):
        load_config(None, [f"model.target={tmp_path}", "model.target_layer_ids=4"])


@pytest.mark.parametrize("content,needle", [
    (b"1: 2\n", "key 1 is not a name"),
    (b"train:\n  steps: 3\n\xff\xfe bad: 1\n", "not UTF-8"),
    (b"train: [unclosed\n", "not valid YAML"),
    (b"- 1\n", "expected a mapping at top level"),
    (b"train:\n  steps: .inf\n", "train.steps=inf: expected int"),
    # a key twice is refused, never a silent last-one-wins (a second `train:` dropped the first)
    (b"train: {steps: 3}\ntrain: {lr: 0.1}\n", "key 'train' given twice in one mapping (lines 1 and 2)"),
    (b"train:\n  steps: 3\n  steps: 5\n", "key 'steps' given twice"),
    (b"train.steps: 3\ntrain: {steps: 4}\n", "train.steps is given twice"),
    (b"model:\n  target:\n", "model.target: empty; expected a string"),
])
def test_bad_config_files_are_one_line(tmp_path, content, needle):
    f = tmp_path / "c.yaml"
    f.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        load_config(str(f))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_directory_as_config_file(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(str(tmp_path))


@pytest.mark.parametrize("text", ["1,3", "[1,3]", "[1, 3]", " [1,3] "])
def test_a_list_key_takes_the_list_form_in_set_as_in_a_config_file(text):
    """Issue 54: `--set model.target_layer_ids=[1,5]` said "'[1': expected int"."""
    assert load_config(None, [f"model.target_layer_ids={text}"]).model.target_layer_ids == [1, 3]


@pytest.mark.parametrize("text,needle", [("[1,x]", "model.target_layer_ids="), ("[1,", "model.target_layer_ids="),
                                         ("[[1],2]", "model.target_layer_ids=")])
def test_a_bad_list_form_is_one_line(text, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"model.target_layer_ids={text}"])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_yaml_11_on_off_reads_as_the_word_and_merge_keys_still_override(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  regenerate: off\n")  # YAML 1.1: the bool False
    assert load_config(str(f)).data.regenerate == "off"
    f.write_text("model: &m\n  num_layers: 2\n  block_size: 8\n")
    assert load_config(str(f)).model.num_layers == 2


def test_replies_too_short_to_train_on_are_refused_before_the_target_loads():
    from dflash.config import check_regen_lengths

    short = ["model.target=tiny-qwen3", "data.regen_max_new_tokens=20"]
    with pytest.raises(ConfigError, match="data.regen_max_new_tokens=20 with model.block_size=16"):
        check_regen_lengths(load_config(None, short + ["model.block_size=16"]))  # eval loads such settings fine
    check_regen_lengths(load_config(None, short + ["model.block_size=8"]))
    check_regen_lengths(load_config(None, short + ["model.block_size=16", "data.regenerate=off"]))  # others' text
    check_regen_lengths(load_config(None, short + ["model.block_size=16", "data.features=/some/capture"]))

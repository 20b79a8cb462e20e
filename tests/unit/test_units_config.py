"""load_config in-process: type coercion of YAML / --set / flag values, and precedence
(defaults <- --config FILE <- --set key=value <- dedicated flags)."""
import pytest

from dflash.config import Config, load_config
from dflash.errors import ConfigError


def _yaml(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


def test_defaults_validate():
    cfg = load_config()
    assert cfg == Config()


def test_set_values_are_coerced_to_the_declared_types():
    cfg = load_config(None, ["train.lr=3e-4", "train.steps=12", "telemetry.enabled=off",
                             "pipeline.target_devices=cpu,cpu", "pipeline.inject_delay=model_forward=0.5,backward=0",
                             "pipeline.inject_fault=pack_hidden=3", "model.target_layer_ids=1,3",
                             "data.eval_fraction=0.1", "out=runs/x"])
    assert cfg.train.lr == 3e-4 and isinstance(cfg.train.lr, float)
    assert cfg.train.steps == 12 and isinstance(cfg.train.steps, int)
    assert cfg.telemetry.enabled is False
    assert cfg.pipeline.target_devices == ["cpu", "cpu"]
    assert cfg.pipeline.inject_delay == {"model_forward": 0.5, "backward": 0.0}
    assert cfg.pipeline.inject_fault == {"pack_hidden": 3}
    assert cfg.model.target_layer_ids == [1, 3]
    assert cfg.out == "runs/x"


@pytest.mark.parametrize("text", ["yes", "true", "1", "on", "True"])
def test_bool_spellings(text):
    assert load_config(None, [f"telemetry.wandb={text}"]).telemetry.wandb is True


def test_yaml_values_are_coerced_too(tmp_path):
    cfg = load_config(_yaml(tmp_path, "train:\n  lr: 1.0e-3\n  steps: 4\npipeline:\n  drafter_devices: [cpu]\n"
                                      "  inject_delay: {data_load: 1}\nmodel.block_size: 8\n"))
    assert cfg.train.lr == 1e-3 and cfg.train.steps == 4
    assert cfg.pipeline.drafter_devices == ["cpu"]
    assert cfg.pipeline.inject_delay == {"data_load": 1.0} and isinstance(cfg.pipeline.inject_delay["data_load"], float)
    assert cfg.model.block_size == 8


@pytest.mark.parametrize("override,needle", [
    ("train.steps=2.5", "train.steps=2.5: expected int"),
    ("train.steps=true", "train.steps=True: expected int"),   # a bool is not an int
    ("train.lr=fast", "train.lr='fast': expected float"),
    ("telemetry.enabled=maybe", "expected true or false"),
    ("pipeline.inject_delay=model_forward", "is not KEY=VALUE"),
    ("train.nope=1", "unknown config key 'train.nope'"),
    ("train.steps.x=1", "train.steps is not a section"),
    ("train=3", "expected a section"),
    ("no_equals_sign", "expected key=value"),
])
def test_bad_values_raise_config_error_naming_them(override, needle):
    with pytest.raises(ConfigError, match=None) as e:
        load_config(None, [override])
    assert needle in str(e.value)


def test_yaml_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_yaml(tmp_path, "train: [unclosed\n"))
    with pytest.raises(ConfigError, match="expected a mapping at top level"):
        load_config(_yaml(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(ConfigError, match="unknown config key 'trian'"):
        load_config(_yaml(tmp_path, "trian:\n  steps: 3\n"))


def test_precedence_defaults_file_set_flags(tmp_path):
    path = _yaml(tmp_path, "train:\n  steps: 5\n  seed: 3\n  lr: 0.01\nmodel:\n  target: tiny-llama\n")
    cfg = load_config(path)
    assert (cfg.train.steps, cfg.train.seed, cfg.train.lr, cfg.model.target) == (5, 3, 0.01, "tiny-llama")
    assert cfg.train.batch_size == Config().train.batch_size  # untouched: the default

    cfg = load_config(path, ["train.steps=7", "train.seed=4"])
    assert (cfg.train.steps, cfg.train.seed, cfg.train.lr) == (7, 4, 0.01)  # --set beats the file

    cfg = load_config(path, ["train.steps=7", "train.seed=4"], **{"train.steps": 9, "train.seed": None})
    assert (cfg.train.steps, cfg.train.seed) == (9, 4)  # a flag beats --set; an absent flag (None) does not


def test_later_set_wins_and_sections_merge(tmp_path):
    cfg = load_config(None, ["train.steps=1", "train.steps=2"])
    assert cfg.train.steps == 2
    cfg = load_config(_yaml(tmp_path, "train:\n  steps: 5\n"), [], **{"train": {"seed": 8}})
    assert (cfg.train.steps, cfg.train.seed) == (5, 8)  # a section value sets only its keys


def test_validation_runs_after_all_sources_are_merged(tmp_path):
    # block_size=200 needs max_len > 400: the file alone is invalid, the --set repairs it
    path = _yaml(tmp_path, "model:\n  block_size: 200\n")
    with pytest.raises(ConfigError, match="data.max_len"):
        load_config(path)
    assert load_config(path, ["data.max_len=512"]).model.block_size == 200


def test_feature_cache_is_off_by_default_and_refused_with_a_layout():
    assert load_config().train.feature_cache is False
    assert load_config(None, ["train.feature_cache=true"]).train.feature_cache is True
    with pytest.raises(ConfigError, match="train.feature_cache=true with pipeline.layout"):
        load_config(None, ["train.feature_cache=true", "pipeline.layout=target:1,drafter:1"])


def test_a_comma_list_ignores_the_spaces_after_its_commas():
    from dflash.config import load_config

    cfg = load_config(None, ["model.num_layers=2", "model.layer_types=sliding_attention, full_attention",
                             "model.sliding_window=64"])
    assert cfg.model.layer_types == ["sliding_attention", "full_attention"]

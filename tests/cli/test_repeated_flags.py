"""A flag given twice: two config files do not merge, so a second --config is refused (exit 2)
instead of silently replacing the first; --tracker lists add up, as the repeated form reads."""
import pytest

from dflash.cli import _parser


def test_a_second_config_is_refused_and_trackers_add_up(capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["train", "--config", "a.yaml", "--config", "b.yaml"])
    assert e.value.code == 2 and "--config given twice ('a.yaml', then 'b.yaml')" in capsys.readouterr().err
    a = _parser().parse_args(["train", "--tracker", "tensorboard", "--tracker", "mlflow,wandb"])
    assert a.tracker == "tensorboard,mlflow,wandb"
    assert _parser().parse_args(["eval", "--checkpoint", "x", "--tracker", "mlflow", "--tracker", "wandb"]
                                ).tracker == "mlflow,wandb"

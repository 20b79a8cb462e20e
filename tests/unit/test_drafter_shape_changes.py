"""What a run may change about a drafter it continues or starts from (eighth pass): a resume
refuses every field the drafter is built from, its shape's or not (a window, a multiplier, a
draft vocabulary), rather than recording the new value while training the old; --init-from
says what of the config DIR's shape replaces and refuses another family than DIR's; a draft
vocabulary as wide as the target's is the full vocabulary; hand-edited configs are one line."""
import json

import pytest

from dflash.checkpoint.drafter_dirs import DrafterDirError, inspect
from dflash.checkpoint.init_from import say_replaced
from dflash.config import ModelConfig
from dflash.model.build import draft_vocab_size
from dflash.preflight.checkpoint_files import bounds_error, resume_mismatch

CKPT = {"target": "tiny-qwen3", "block_size": 8, "num_hidden_layers": 1, "vocab_size": 100, "layer_types": [],
        "sliding_window": None, "draft_vocab_size": 0}


@pytest.mark.parametrize("change, key", [
    (dict(layer_types=["sliding_attention"], sliding_window=8), "model.layer_types"),
    (dict(draft_vocab=50), "model.draft_vocab"),
])
def test_a_resume_refuses_a_field_the_drafter_keeps(change, key):
    model = ModelConfig(target="tiny-qwen3", block_size=8, num_layers=1)
    assert resume_mismatch(CKPT, model, None) is None
    assert resume_mismatch(CKPT, ModelConfig(target="tiny-qwen3", block_size=8, num_layers=1, draft_vocab=100),
                           None) is None  # as wide as the vocabulary: none, as the drafter was built
    for k, v in change.items():
        setattr(model, k, v)
    assert resume_mismatch(CKPT, model, None).startswith(key)
    dflash2 = CKPT | {"arch": "dflash2", "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
                      "selector_top_k": 4, "output_multiplier": 1.0, "final_logit_softcapping": 0.0,
                      "input_embedding_scale": 1.0}
    m2 = ModelConfig(target="tiny-qwen3", block_size=8, num_layers=1, arch="dflash2", selector_rank=8,
                     selector_top_k=4)
    assert resume_mismatch(dflash2, m2, None) is None
    m2.output_multiplier = 3.0
    assert resume_mismatch(dflash2, m2, None).startswith("model.output_multiplier")


def test_init_from_says_what_it_replaces_and_refuses_another_family(capsys):
    flags = {"model.init_from": "D", "model.block_size": 16, "model.draft_vocab": 0, "model.arch": "dspark",
             "model.markov_rank": 16}
    say_replaced("D", flags, {"model.block_size": 4, "model.draft_vocab": 4096, "model.markov_rank": 16})
    err = capsys.readouterr().err
    assert "model.block_size=16 (asked 4)" in err and "model.draft_vocab=0 (asked 4096)" in err
    assert "markov_rank" not in err
    with pytest.raises(DrafterDirError, match="a dspark drafter, and model.arch=dflash asks for another family"):
        say_replaced("D", flags, {"model.arch": "dflash"})
    say_replaced("D", {"model.init_from": "D"}, {"model.arch": "dspark"})  # a DFlash DIR starts any family


def test_a_draft_vocabulary_as_wide_as_the_target_is_none_and_a_bad_one_is_one_line():
    assert (draft_vocab_size(4096, 49152), draft_vocab_size(49152, 49152), draft_vocab_size(60000, 49152)) == \
        (4096, 0, 0)
    fields = {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
              "intermediate_size": 64, "vocab_size": 100, "num_hidden_layers": 1, "block_size": 4,
              "target_layer_ids": [0, 1], "mask_token_id": 5}
    assert bounds_error(fields | {"draft_vocab_size": 50}, "w") is None
    for bad in ("x", True, 100, -1):
        assert "draft_vocab_size=" in bounds_error(fields | {"draft_vocab_size": bad}, "w")


def test_a_dflash_config_that_is_no_mapping_is_one_line(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"fc.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "dflash_config": [1, 2]}))
    with pytest.raises(DrafterDirError, match="dflash_config=\\[1, 2\\]: expected a mapping"):
        inspect(str(tmp_path))

"""vLLM's `speculators` library reads our export with its DFlash converter.

speculators 0.9 pins transformers<=5.19 and pulls torchaudio/torchvision, so it is not a
test dependency of this project (it would downgrade transformers); where it is installed,
this test runs, elsewhere it skips and says why. docs/serving.md says how it was run on a
CPU machine (a side venv)."""
import importlib.util

import pytest
import torch


def _speculators_or_skip():
    if importlib.util.find_spec("speculators") is None:
        pytest.skip("speculators is not installed here (0.9 pins transformers<=5.19 and needs "
                    "torchaudio/torchvision; this project's venv has a newer transformers)")
    try:
        from speculators.convert.dflash import DFlashConverter
    except Exception as e:  # installed but not importable with this transformers / torch
        pytest.skip(f"speculators does not import here: {type(e).__name__}: {e}")
    return DFlashConverter


def test_speculators_converter_reads_our_export(tmp_path, tiny):
    DFlashConverter = _speculators_or_skip()
    from dflash.checkpoint.export import write_export
    from dflash.model.drafter import DFlashDrafter, DrafterConfig

    target, tok = tiny
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    cfg = DrafterConfig.from_target(target.config, target_layer_ids=[1, 2, 3], vocab_size=len(tok),
                                    mask_token_id=16, block_size=8)
    torch.manual_seed(0)
    write_export(DFlashDrafter(cfg), target.config, tmp_path / "export", dtype="float32", target="tiny-qwen3")
    DFlashConverter().convert(tmp_path / "export", tmp_path / "converted", base_model=str(tmp_path / "target"),
                              validate=True)
    import json

    from safetensors.torch import load_file
    conv = json.loads((tmp_path / "converted" / "config.json").read_text())
    # speculators counts hidden states from the embedding: our layer i is its i + 1
    assert conv["aux_hidden_state_layer_ids"] == [2, 3, 4] and conv["block_size"] == 8
    ours = load_file(str(tmp_path / "export" / "model.safetensors"))
    theirs = {}
    for f in (tmp_path / "converted").glob("*.safetensors"):
        theirs.update(load_file(str(f)))
    for name in ("fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"):
        assert torch.equal(ours[name], theirs[name]), name

"""The training step's speed levers for the GPU, checked for equality on the CPU:
`train.attention=flex` (flex_attention with a block mask: its mask is the bool mask's, its
forward the same loss; torch has no flex backward on the CPU, so the gradient is the GPU run's
to check) and `train.compile` (each drafter layer through torch.compile: traced here with the
aot_eager backend, which needs no C++ build, the same loss and gradients)."""
import pytest
import torch

from dflash.model import drafter as D

from test_head_loss import _step

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # flex_attention uncompiled on the CPU


@pytest.mark.parametrize("window", [None, 3, 6])
def test_flex_block_mask_is_the_bool_mask(window):
    anchors = torch.tensor([[2, 9, 0], [5, 11, 17]])
    valid = torch.tensor([[True, True, False], [True, True, True]])
    S, Bk = 24, 4
    want = D.DFlashDrafter.block_mask(anchors, valid, S, Bk, window)[:, 0]   # [B, Q, S + Q]
    bm = D.flex_block_mask(anchors, valid, S, Bk, window)
    B, Q, KV = want.shape
    got = bm.mask_mod(torch.arange(B)[:, None, None], torch.zeros(()), torch.arange(Q)[None, :, None],
                      torch.arange(KV)[None, None, :])
    assert torch.equal(got, want)


@pytest.mark.parametrize("extra", [[], ["model.layer_types=sliding_attention", "model.sliding_window=3"]])
def test_flex_attention_gives_the_sdpa_loss(tiny, extra):
    res = {}
    for att in ("sdpa", "flex"):
        st, b, feats = _step(tiny, "train.loss_weights=decay", *extra)
        st.drafter.attention = att  # what train.attention sets; the config refuses flex on a CPU drafter (no backward)
        with torch.no_grad():
            res[att] = st.forward(feats, b)
    torch.testing.assert_close(res["flex"][0], res["sdpa"][0], rtol=1e-5, atol=1e-6)
    assert torch.equal(res["flex"][1], res["sdpa"][1])


def test_compiled_layers_give_the_eager_loss_and_gradients(tiny, monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setattr(D, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    res = {}
    for compiled in (False, True):
        st, b, feats = _step(tiny, "train.loss_weights=dpace", f"train.compile={str(compiled).lower()}")
        loss, acc = st.forward(feats, b)
        st.backward(loss)
        res[compiled] = loss.detach(), {n: p.grad.clone() for n, p in st.drafter.named_parameters()}
        assert bool(counters["stats"]["unique_graphs"]) == compiled  # the layers really went through dynamo
        # compiled in place: the state dict (checkpoints, exports) keeps its names
        assert all("_orig_mod" not in k for k in st.drafter.state_dict())
    torch.testing.assert_close(res[True][0], res[False][0], rtol=1e-6, atol=1e-7)
    for n, g in res[False][1].items():
        assert (res[True][1][n] - g).norm() <= 1e-5 * g.norm() + 1e-12, n
    torch._dynamo.reset()


def test_bad_lever_values_are_one_line_each():
    from dflash.config import load_config
    from dflash.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train.attention='xformers': expected sdpa or flex"):
        load_config(None, ["train.attention=xformers"])
    with pytest.raises(ConfigError, match=r"train.loss_chunk=-2"):
        load_config(None, ["train.loss_chunk=-2"])
    with pytest.raises(ConfigError, match=r"train.attention=flex with pipeline.drafter_devices=\['cpu'\]: flex needs"):
        load_config(None, ["train.attention=flex"])
    assert load_config(None, ["train.attention=flex", "pipeline.drafter_devices=cuda:0",
                              "pipeline.target_devices=cuda:0"]).train.attention == "flex"

"""train.optimizer=muon (run/step.py): torch.optim.Muon for the 2-D weight matrices, AdamW for the
rest (the 2-D vocabulary tables at Muon's rate), as vLLM's speculators splits them; it trains,
and a non-finite step leaves every weight finite without a host read."""
import pytest
import torch

from dflash.config import load_config
from dflash.model.architectures import make_drafter
from dflash.model.drafter import DrafterConfig
from dflash.run.step import TrainStep, muon_split

SMALL = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64,
             vocab_size=100, target_layer_ids=[0, 1], mask_token_id=5, block_size=4)


@pytest.mark.parametrize("arch, extra", [("dspark", {"markov_rank": 8, "confidence_head": True}),
                                         ("dflash2", {"selector_rank": 8, "selector_top_k": 4}),
                                         ("dflash", {"copy_head": True})])
def test_muon_takes_the_matrices_and_adamw_the_rest(arch, extra):
    d = make_drafter(DrafterConfig(**SMALL, arch=arch, **extra))
    named = list(d.named_parameters())
    muon, adamw, tables = muon_split(named)
    name = {id(p): n for n, p in named}
    muon, adamw, tables = ({name[id(p)] for p in g} for g in (muon, adamw, tables))
    assert muon | adamw | tables == set(name.values()) and not (muon & adamw or muon & tables or adamw & tables)
    assert {"fc.weight", "layers.0.q_proj.weight", "layers.0.down_proj.weight"} <= muon
    assert {"norm.weight", "layers.0.input_layernorm.weight"} <= adamw
    if arch == "dspark":
        assert tables == {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
        assert {"confidence_head.proj.weight", "confidence_head.proj.bias"} <= adamw  # a [1, N] row is no matrix
    elif arch == "dflash":  # the copy head's 2-D bias keeps AdamW and its own rate (lr_scale)
        assert "copy.bias" in adamw and not tables
    else:
        assert tables == {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"}
        assert "candidate_selector.hidden_projection.weight" in muon and "layers.0.mlp_conv.base_kernel" in adamw


def _step(tiny, *sets):
    from dflash.data import dataset as data_mod
    from dflash.model import features as Fm
    from dflash.model.build import build_drafter

    target, tok = tiny
    cfg = load_config(None, ["model.block_size=4", "train.num_anchors=6", "train.lr=3e-3", "train.warmup_ratio=0",
                             "train.steps=8", *sets])
    drafter = build_drafter(cfg, target, tok, [1, 2, 3])
    st = TrainStep(cfg.train, 4, drafter, target.get_input_embeddings(), target.get_output_embeddings(), "cpu")
    g = torch.Generator().manual_seed(1)
    samples = [data_mod.Sample(torch.randint(0, 400, (n,), generator=g).tolist(), [0] * 5 + [1] * (n - 5))
               for n in (30, 26)]
    b = next(data_mod.batches(samples, batch_size=2, seed=0, pad_id=0))
    return st, b, Fm.capture(target, b.input_ids, b.attention_mask, [1, 2, 3])


def test_muon_trains(tiny):
    st, b, feats = _step(tiny, "train.optimizer=muon", "train.loss_weights=decay")
    assert st.muon is not None and len(st.muon_params) == 1 + 7  # fc and the one layer's seven projections
    before = {n: p.detach().clone() for n, p in st.drafter.named_parameters()}
    losses = []
    for _ in range(3):  # a Muon step is ~1 s on 2 CPU cores (Newton-Schulz in bf16): a few suffice
        loss, _ = st.forward(feats, b)
        st.backward(loss)
        st.optimizer_step(loss)
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0], losses
    assert all(not torch.equal(p, before[n]) for n, p in st.drafter.named_parameters())  # every group stepped
    assert st.muon_sched.get_last_lr() == st.sched.get_last_lr()[:1]  # one schedule


def test_a_nonfinite_step_leaves_every_weight_finite(tiny):
    st, b, feats = _step(tiny, "train.optimizer=muon")
    loss, _ = st.forward(feats, b)
    st.backward(loss * float("nan"))
    adamw_before = [p.detach().clone() for g in st.opt.param_groups for p in g["params"]]
    gnorm, skipped = st.optimizer_step(loss * float("nan"))
    assert bool(skipped)
    assert all(torch.isfinite(p).all() for p in st.drafter.parameters())
    assert all(torch.equal(a, p) for a, p in zip(adamw_before, (p for g in st.opt.param_groups for p in g["params"])))


@pytest.mark.parametrize("sets, msg", [(["train.optimizer=sgd"], "train.optimizer='sgd'"),
                                       (["train.muon_adjust_lr=spectral"], "train.muon_adjust_lr='spectral'"),
                                       (["train.muon_momentum=1"], "train.muon_momentum=1")])
def test_bad_muon_settings_are_one_line(sets, msg):
    import re

    from dflash.errors import ConfigError
    with pytest.raises(ConfigError, match=re.escape(msg)):
        load_config(None, sets)

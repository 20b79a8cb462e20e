"""`model.drafter_init=target` on every family we copy from: the drafter's norms (x·w) take the
scale the target's norms apply, whatever their convention. Qwen3.5 (and Qwen3-Next, Gemma)
store w near 0 and multiply by (1 + w); a weight-for-weight copy gave a drafter whose norms
were all ~0: uniform logits and a loss stuck at ln V (10.803 -> 10.802 on tiny-qwen3.5)."""
import math

import pytest
import torch


@pytest.fixture(scope="module")
def qwen35():
    """tiny-qwen3.5 with its norms moved off their zero init, so that a copy of w and the
    scale 1 + w differ everywhere."""
    from dflash.model.target import load_target

    model, tok = load_target("tiny-qwen3.5", seed=0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model, tok


def _build(model, tok, layers=1, spec="tiny-qwen3.5"):
    from dflash.config import load_config
    from dflash.model import target as target_mod
    from dflash.model.build import build_drafter

    cfg = load_config(None, [f"model.target={spec}", "model.drafter_init=target", "model.block_size=8",
                             f"model.num_layers={layers}", "train.num_anchors=8", "train.lr=3e-3",
                             "train.warmup_ratio=0", "train.steps=30", "train.weight_decay=0"])
    ids = target_mod.default_layer_ids(target_mod.num_layers(model), 2)
    return cfg, ids, build_drafter(cfg, model, tok, ids)


def test_norm_scale_reads_each_convention():
    from torch import nn

    from dflash.model.build import norm_scale
    from dflash.model.drafter import RMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    w = torch.linspace(-0.5, 0.5, 8)
    for norm, scale in ((RMSNorm(8, 1e-6), w), (LlamaRMSNorm(8, eps=1e-5), w), (Qwen3_5RMSNorm(8, eps=1e-6), 1 + w),
                        (Qwen3NextRMSNorm(8, eps=1e-6), 1 + w), (Gemma3RMSNorm(8, eps=1e-6), 1 + w)):
        with torch.no_grad():
            norm.weight.copy_(w)
        torch.testing.assert_close(norm_scale(norm), scale, msg=type(norm).__name__)
    assert norm_scale(nn.Linear(8, 8)) is None  # no 1-D weight: nothing to copy


def test_qwen35_drafter_init_copies_norm_scales_and_continues_the_target(qwen35):
    model, tok = qwen35
    _, ids, drafter = _build(model, tok)
    dec = model.model
    nxt = next(i for i in range(max(ids) + 1, len(dec.layers)) if hasattr(dec.layers[i], "self_attn"))
    layer = dec.layers[nxt]
    torch.testing.assert_close(drafter.norm.weight, 1 + dec.norm.weight)
    torch.testing.assert_close(drafter.layers[0].input_layernorm.weight, 1 + layer.input_layernorm.weight)
    torch.testing.assert_close(drafter.layers[0].k_norm.weight, 1 + layer.self_attn.k_norm.weight)
    assert (drafter.norm.weight.abs() > 0.5).all(), "no drafter norm may be ~0"
    # the context the drafter's first layer reads is what the target's next attention layer reads
    input_ids = torch.randint(20, 1000, (1, 12))
    with torch.no_grad():
        hs = model(input_ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1] for i in ids], dim=-1)
        torch.testing.assert_close(drafter.fuse(feats), layer.input_layernorm(hs[max(ids) + 1]))


def _learns(model, tok, spec):
    """The loss falls on a fixed batch; its history."""
    from dflash.data.batch import Batch
    from dflash.run.step import TrainStep

    cfg, ids, drafter = _build(model, tok, spec=spec)
    st = TrainStep(cfg.train, cfg.model.block_size, drafter, model.get_input_embeddings(),
                   model.get_output_embeddings(), "cpu")
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(20, 1000, (2, 48), generator=g)
    lm = torch.ones_like(input_ids)
    lm[:, :8] = 0
    b = Batch(index=0, input_ids=input_ids, attention_mask=torch.ones_like(input_ids), loss_mask=lm,
              lengths=[48, 48])
    with torch.no_grad():
        hs = model(input_ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1] for i in ids], dim=-1)
    losses = []
    for _ in range(30):
        loss, _ = st.forward(feats, b)
        st.backward(loss)
        st.optimizer_step(loss)
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 1.0, f"the loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}"
    return losses


def test_qwen35_drafter_init_target_learns(qwen35):
    losses = _learns(*qwen35, "tiny-qwen3.5")
    ln_v = math.log(qwen35[0].get_output_embeddings().weight.shape[0])
    assert abs(losses[0] - ln_v) > 0.02, f"uniform logits at the start: {losses[0]:.4f} = ln V {ln_v:.4f}"


@pytest.fixture(scope="module")
def gemma3():
    """A tiny Gemma 3 text model (a local target dir's family): (1 + w) norms, four per layer, a
    GELU-gated MLP, attention scaled by query_pre_attn_scalar, an embedding scaled by sqrt(H),
    a tied head; its norms moved off their zero init as for Qwen3.5."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from dflash.model.target import load_tokenizer

    tok = load_tokenizer("tiny-qwen3")
    cfg = Gemma3TextConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=256,
                           max_position_embeddings=4096, tie_word_embeddings=True, sliding_window=512,
                           pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Gemma3ForCausalLM(cfg).float().eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") and p.dim() == 1:
                    p.copy_(0.1 * torch.randn(p.shape))
    return model, tok


def test_gemma3_drafter_init_copies_by_role_and_says_what_it_cannot(gemma3, capsys):
    """The drafter's pre-MLP norm takes Gemma's pre_feedforward_layernorm (not its norm on the
    attention's output), its q norm carries the attention scale (64/256)^1/2, the GELU MLP is not
    copied into the SiLU one, and the run says both; the embedding it reads is Gemma's scaled
    one and its head the tied one, as the target's own modules."""
    model, tok = gemma3
    _, ids, drafter = _build(model, tok, spec="tiny-qwen3")
    err = capsys.readouterr().err
    assert "Gemma3DecoderLayer" in err and "gelu_pytorch_tanh" in err and "MLP's outputs" in err, err
    layer = model.model.layers[max(ids) + 1]
    d = drafter.layers[0]
    torch.testing.assert_close(d.post_attention_layernorm.weight, 1 + layer.pre_feedforward_layernorm.weight)
    torch.testing.assert_close(d.input_layernorm.weight, 1 + layer.input_layernorm.weight)
    torch.testing.assert_close(d.q_norm.weight, (1 + layer.self_attn.q_norm.weight) * 0.5)
    torch.testing.assert_close(d.k_norm.weight, 1 + layer.self_attn.k_norm.weight)
    torch.testing.assert_close(d.q_proj.weight, layer.self_attn.q_proj.weight)
    assert not torch.equal(d.gate_proj.weight, layer.mlp.gate_proj.weight)
    from dflash.model.target import embed_and_head

    x = torch.randint(20, 1000, (1, 6))
    for where in (None, "cpu"):  # the target's own modules, and a drafter rank's copy of the pair
        embed, head = embed_and_head(model, where, torch.float32)
        with torch.no_grad():
            torch.testing.assert_close(embed(x), model(x, output_hidden_states=True).hidden_states[0])  # x·sqrt(H)
        assert head.weight.data_ptr() == embed.weight.data_ptr(), where  # still tied
    assert embed is not model.get_input_embeddings()


def test_gemma2_drafter_init_scales_the_q_norm_it_has_no_copy_for_and_says_the_soft_cap(capsys):
    """Gemma 2 has no q norm: the drafter's (at 1) still takes the attention scale ratio
    (query_pre_attn_scalar 144 over head_dim 64: (64/144)^1/2), and the attention's logit soft cap,
    which the drafter cannot carry, is said."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from dflash.model.target import load_tokenizer

    tok = load_tokenizer("tiny-qwen3")
    cfg = Gemma2Config(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=144,
                       attn_logit_softcapping=50.0, max_position_embeddings=4096, sliding_window=512,
                       pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Gemma2ForCausalLM(cfg).float().eval()
    _, _, drafter = _build(model, tok, spec="tiny-qwen3")
    assert "soft-capping at 50.0" in capsys.readouterr().err
    torch.testing.assert_close(drafter.layers[0].q_norm.weight, torch.full((64,), (64 / 144) ** 0.5))


def test_gemma3_drafter_init_target_learns(gemma3):
    """(A random Gemma's own logits are near uniform, 0.006 from ln V: only the fall is asked.)"""
    _learns(*gemma3, "tiny-qwen3")


def test_more_drafter_layers_than_the_target_has_attention_layers_is_said(qwen35, capsys):
    model, tok = qwen35
    from dflash.model.build import init_layers

    n_attn = len(init_layers(model, [1], 99))
    _build(model, tok, layers=n_attn + 1)
    err = capsys.readouterr().err
    assert f"drafter layers {n_attn}..{n_attn} of {n_attn + 1} stay random" in err

"""Mixed precision: a bf16 target with a drafter that keeps fp32 master weights and computes
in bf16 on the CPU (which has bf16) — the path `model.dtype=auto` takes on CUDA. The same
through train, resume and eval: tests/integration/test_train.py; float16 refused:
tests/cli/test_bad_input_before_torch.py."""
import pytest
import torch


@pytest.fixture(scope="module")
def bf16_target():
    from dflash.model import target as T
    return T.load_target("tiny-qwen3", seed=0, dtype=torch.bfloat16)


def test_bf16_target_trains_fp32_master_weights_computing_in_bf16(bf16_target):
    from dflash.data.batch import Batch
    from dflash.model.build import build_drafter
    from dflash.run.step import TrainStep

    from dflash.config import load_config

    model, tok = bf16_target
    cfg = load_config(None, ["model.block_size=8", "model.dtype=bfloat16", "train.num_anchors=4", "train.lr=1e-3",
                             "train.warmup_ratio=0", "train.steps=10", "train.weight_decay=0"])
    drafter = build_drafter(cfg, model, tok, [1, 2, 3])
    st = TrainStep(cfg.train, cfg.model.block_size, drafter, model.get_input_embeddings(),
                        model.get_output_embeddings(), "cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 1000, (2, 40), generator=g)
    lm = torch.ones_like(ids)
    lm[:, :8] = 0
    b = Batch(index=0, input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=lm, lengths=[40, 40])
    feats = torch.randn(2, 40, 3 * 256, generator=g).to(torch.bfloat16)  # what a bf16 target hands over

    seen = {}

    def spy(module, inputs, output):  # returns None: the output is left as it is
        seen.setdefault("q", output.dtype)
    hook = drafter.layers[0].q_proj.register_forward_hook(spy)
    before = drafter.fc.weight.detach().clone()
    loss, acc = st.forward(feats, b)
    st.backward(loss)
    grads = {p.grad.dtype for p in drafter.parameters() if p.grad is not None}
    _, skipped = st.optimizer_step(loss)
    hook.remove()

    assert seen["q"] == torch.bfloat16, "drafter matmuls must run in the target's bf16"
    assert torch.isfinite(loss) and not bool(skipped)
    assert {p.dtype for p in drafter.parameters()} == {torch.float32}, "master weights stay fp32"
    assert grads == {torch.float32}
    moments = [s["exp_avg"].dtype for s in st.opt.state.values()]
    assert moments and set(moments) == {torch.float32}, "optimizer state stays fp32"
    assert not torch.equal(before, drafter.fc.weight), "the step updated the fp32 weights"
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16  # frozen, shared, untouched
    assert not model.get_input_embeddings().weight.requires_grad


def test_float32_target_is_untouched_by_autocast():
    """fp32 targets take no autocast: CPU fp32 runs stay bit-for-bit what they were."""
    from dflash.model.drafter import compute_precision

    w = torch.zeros(2, 2)
    with compute_precision(w):
        assert not torch.is_autocast_enabled("cpu")
    with compute_precision(w.bfloat16()):
        assert torch.is_autocast_enabled("cpu")

"""The chunked head + loss (model/head_loss.py, `train.loss_chunk`) is the full-logits path's
twin: per-slot terms bit for bit when one chunk holds every row, the loss to fp32 rounding and
the gradients to rounding in chunks, for every (loss, weighting) pair, with and without a loss
vocabulary; a copy head and DFlash2 keep the full logits."""
import pytest
import torch

from dflash.config import load_config
from dflash.model import head_loss
from dflash.model import losses as L
from dflash.model.loss_vocab import RowsHead

H, V, B, A, K = 16, 50, 2, 3, 4


def _inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, A, K, H, generator=g, dtype=dtype)
    head = torch.nn.Linear(H, V, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g, dtype=dtype) * 0.5)
    labels = torch.randint(0, V, (B, A, K), generator=g)
    logp = torch.log_softmax(torch.randn(B, A, K, V, generator=g, dtype=dtype) * 2, -1).float()
    valid = torch.tensor([[True, True, False], [True, True, True]])
    mask = (torch.rand(B, A, K, generator=g) > 0.2).float()
    return h, head, labels, logp, valid, mask


def _targets(logp, loss, topk, rows_ids=None):
    return L.target_slot_dist(logp, topk, rows_ids) if loss != "ce" else None


@pytest.mark.parametrize("loss", ["ce", "kl", "lk"])
@pytest.mark.parametrize("weighting", ["decay", "dpace"])
@pytest.mark.parametrize("subset", [False, True])
def test_chunked_terms_loss_and_gradient_equal_the_full_logits(loss, weighting, subset):
    h, head, labels, logp, valid, mask = _inputs()
    decay = L.decay_weights(K + 1)[1:]
    cols, rows_ids, hd = labels, None, head
    if subset:  # train.loss_vocab: the head's rows of a sorted id set holding every label
        rows_ids = torch.unique(torch.cat([labels.flatten(), torch.arange(0, V, 3)]))
        hd = RowsHead(head, rows_ids)
        cols = hd.to_subset(labels)
    tgt = _targets(logp, loss, 5, rows_ids)
    kw = dict(loss=loss, weighting=weighting, targets=tgt, lk_eta=3.0)

    def full(x):
        return L.slot_terms(hd(x.reshape(-1, H)).view(B, A, K, -1), cols, **kw)

    def reduce(t):
        return L.reduce_terms(t, valid, mask, decay, weighting=weighting)

    ref_h = h.clone().requires_grad_(True)
    ref_terms = full(ref_h)
    ref_loss, ref_acc = reduce(ref_terms)
    ref_loss.backward()
    for chunk in (B * A * K, 5):  # one chunk holds every row; then uneven chunks
        x = h.clone().requires_grad_(True)
        terms = head_loss.chunked_terms(x, hd, cols, chunk=chunk, **kw)
        got_loss, got_acc = reduce(terms)
        got_loss.backward()
        if chunk == B * A * K:  # the same products and the same per-slot functions: the same bits
            assert torch.equal(terms.per, ref_terms.per.detach())
            assert torch.equal(got_loss, ref_loss.detach())
        torch.testing.assert_close(terms.per, ref_terms.per.detach(), rtol=1e-12, atol=1e-12)
        if weighting == "dpace":
            torch.testing.assert_close(terms.label_logq, ref_terms.label_logq, rtol=1e-12, atol=1e-12)
        assert torch.equal(terms.hit, ref_terms.hit) and torch.equal(got_acc, ref_acc)
        # the loss computes in fp32 (losses.py: logits.float()), so the gradients agree to fp32 rounding
        torch.testing.assert_close(x.grad, ref_h.grad, rtol=1e-5, atol=1e-8)
        assert ref_h.grad.abs().sum() > 0


def test_bf16_chunked_matches_the_full_logits_to_bf16_rounding():
    """The GPU's precision on the CPU: bf16 head products, fp32 loss."""
    h, head, labels, logp, valid, mask = _inputs(torch.float32)
    head = head.to(torch.bfloat16)
    decay = L.decay_weights(K + 1)[1:]
    ref_h = h.to(torch.bfloat16).requires_grad_(True)
    ref = L.reduce_terms(L.slot_terms(head(ref_h.reshape(-1, H)).view(B, A, K, -1), labels, weighting="dpace"),
                         valid, mask, decay, weighting="dpace")[0]
    ref.backward()
    x = h.to(torch.bfloat16).requires_grad_(True)
    got = L.reduce_terms(head_loss.chunked_terms(x, head, labels, weighting="dpace", chunk=7), valid, mask, decay,
                         weighting="dpace")[0]
    got.backward()
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    # each side rounds its [rows, H] product to bf16 once, in a different order: within a few ulps
    diff = (x.grad.float() - ref_h.grad.float()).norm() / ref_h.grad.float().norm()
    assert diff < 1e-2, diff


def _step(tiny, *overrides, layer_ids=(1, 2, 3)):
    from dflash.data import dataset as data_mod
    from dflash.model.build import build_drafter
    from dflash.model import features as Fm
    from dflash.model.losses import feature_ids
    from dflash.run.step import TrainStep

    target, tok = tiny
    cfg = load_config(None, ["model.target=tiny-qwen3", "model.block_size=4", "train.num_anchors=5", *overrides])
    drafter = build_drafter(cfg, target, tok, list(layer_ids))
    st = TrainStep(cfg.train, cfg.model.block_size, drafter, target.get_input_embeddings(),
                   target.get_output_embeddings(), "cpu")
    g = torch.Generator().manual_seed(1)
    samples = [data_mod.Sample(torch.randint(0, 400, (n,), generator=g).tolist(), [0] * 5 + [1] * (n - 5))
               for n in (30, 26, 22)]
    st.use_loss_vocab(samples)
    b = next(data_mod.batches(samples, batch_size=3, seed=0, pad_id=0))
    feats = Fm.capture(target, b.input_ids, b.attention_mask, feature_ids(cfg.train, list(layer_ids), False))
    return st, b, feats


@pytest.mark.parametrize("setting", [
    ["train.loss=ce", "train.loss_weights=decay"],
    ["train.loss=ce", "train.loss_weights=dpace"],
    ["train.loss=kl", "train.loss_weights=dpace", "train.kl_topk=8"],
    ["train.loss=lk", "train.loss_weights=decay", "train.kl_topk=0"],
    ["train.loss=ce", "train.loss_weights=dpace", "train.loss_vocab=64"],
])
def test_training_step_chunked_equals_full_logits(tiny, setting):
    """DraftLoss end to end on the tiny target: the same loss and accuracy and the same drafter
    gradients with `train.loss_chunk=7` as with the full logits (`-1`)."""
    res = {}
    for chunk in (-1, 7):
        st, b, feats = _step(tiny, *setting, f"train.loss_chunk={chunk}")
        assert st.loss.chunked() == (chunk > 0)
        loss, acc = st.forward(feats, b)
        st.backward(loss)
        res[chunk] = loss.detach(), acc, {n: p.grad.clone() for n, p in st.drafter.named_parameters()}
    (l0, a0, g0), (l1, a1, g1) = res[-1], res[7]
    # a KL between two near-uniform distributions is ~3e-4 made of O(1) terms: fp32 rounding of
    # another summation order is ~1e-7 absolute (1.4e-7 on an AVX-512/AMX CPU), far from a wrong chunk
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=5e-7)
    assert torch.equal(a1, a0)
    # fp32 rounding of another product order: ~3e-6 of a gradient's norm with CE, up to ~6e-5 with
    # KL, whose gradients on a random target (two near-uniform distributions) are ~1e-6 in all
    for n in g0:
        assert (g1[n] - g0[n]).norm() <= 1e-4 * g0[n].norm(), n


def test_copy_head_and_dflash2_keep_the_full_logits(tiny):
    st, _, _ = _step(tiny, "train.loss_chunk=7", "model.copy_head=true")
    assert not st.loss.chunked()
    st, _, _ = _step(tiny, "train.loss_chunk=7", "model.arch=dflash2", "model.selector_top_k=4")
    assert not st.loss.chunked()


def test_auto_chunks_on_cuda_only():
    from dflash.model.objective import CUDA_LOSS_CHUNK, loss_chunk_rows
    assert loss_chunk_rows(0, torch.device("cpu")) == 0      # the CPU keeps its loss histories bit for bit
    assert loss_chunk_rows(0, torch.device("cuda", 0)) == CUDA_LOSS_CHUNK
    assert loss_chunk_rows(-1, torch.device("cuda", 0)) == 0
    assert loss_chunk_rows(512, torch.device("cpu")) == 512

"""train.loss_vocab: the loss over the frequent tokens plus the batch's own equals the
full-vocabulary loss restricted to that set, and the whole set gives the full loss."""
import pytest
import torch
import torch.nn.functional as F

from dflash.config import load_config
from dflash.data import dataset as data_mod
from dflash.errors import ConfigError
from dflash.model import target as target_mod
from dflash.model.build import build_drafter
from dflash.model.loss_vocab import RowsHead, batch_vocab, frequent_tokens
from dflash.run.step import TrainStep


def _step(k: int, tiny):
    # the paper's weights: the subset loss is compared with weighted_block_loss by hand below
    cfg = load_config(None, ["model.target=tiny-qwen3", "model.block_size=4", "train.num_anchors=4",
                             f"train.loss_vocab={k}", "train.loss_weights=decay"])
    target, tok = tiny
    ids = target_mod.default_layer_ids(target_mod.num_layers(target), 3)
    drafter = build_drafter(cfg, target, tok, ids)
    step = TrainStep(cfg.train, cfg.model.block_size, drafter, target.get_input_embeddings(),
                          target.get_output_embeddings(), "cpu")
    g = torch.Generator().manual_seed(0)
    samples = [data_mod.Sample(torch.randint(0, 300, (n,), generator=g).tolist(), [0] * 4 + [1] * (n - 4))
               for n in (20, 24, 18, 22)]
    b = next(data_mod.batches(samples, batch_size=4, seed=0, pad_id=0))
    feats = target_mod.capture_hidden(target, b.input_ids, b.attention_mask, ids)
    return step, samples, b, feats


def test_frequent_tokens_and_batch_vocab():
    s = [data_mod.Sample([5, 5, 9, 2, 9, 5], [1] * 6)]
    assert frequent_tokens(s, 2).tolist() == [5, 9]
    assert frequent_tokens(s, 5).tolist() == [2, 5, 9]  # as many as there are
    assert frequent_tokens(s, 5, exactly=True).tolist() == [0, 1, 2, 5, 9]  # a fixed-size head: unseen fill in
    assert batch_vocab(torch.tensor([5, 9]), torch.tensor([[7, 5], [1, 1]])).tolist() == [1, 5, 7, 9]
    head = RowsHead(torch.nn.Linear(4, 10, bias=False), torch.tensor([1, 5, 7, 9]))
    assert head.to_subset(torch.tensor([[9, 1], [7, 5]])).tolist() == [[3, 0], [2, 1]]
    assert head(torch.ones(3, 4)).shape == (3, 4)


def test_whole_vocab_subset_gives_the_full_loss(tiny):
    step, samples, b, feats = _step(0, tiny)
    full, _ = step.forward(feats, b)
    step.loss.loss_vocab = torch.arange(step.lm_head.weight.shape[0])
    sub, _ = step.forward(feats, b)
    torch.testing.assert_close(sub, full)


def test_subset_loss_is_the_restricted_softmax_and_trains(tiny):
    step, samples, b, feats = _step(16, tiny)
    step.use_loss_vocab(samples)
    assert len(step.loss.loss_vocab) == 16
    vocab = batch_vocab(step.loss.loss_vocab, b.input_ids)
    assert set(b.input_ids.flatten().tolist()) <= set(vocab.tolist())
    loss, _ = step.forward(feats, b)
    # the same restricted softmax, by hand from the full logits
    g = torch.Generator().manual_seed(step.train.seed * 1_000_003 + b.index)
    from dflash.model.objective import sample_anchors, slot_labels
    from dflash.model.losses import weighted_block_loss
    anchors, valid = sample_anchors(b.loss_mask, 4, 4, generator=g)
    labels = slot_labels(b.input_ids, anchors, 4)
    logits = step.drafter.train_forward(feats, b.input_ids, anchors, valid, step.embed, step.lm_head)
    pos = anchors[..., None] + torch.arange(1, 4)
    lm = torch.gather(b.loss_mask, 1, pos.clamp(max=b.padded_len - 1).view(4, -1)).view_as(pos).float()
    want, _ = weighted_block_loss(logits[..., vocab], torch.searchsorted(vocab, labels.contiguous()), valid, lm, step.loss.weights)
    torch.testing.assert_close(loss, want)
    assert loss < F.cross_entropy(logits.flatten(0, 2), labels.flatten()) + 1e-3  # fewer competitors
    first = loss.item()
    for _ in range(5):
        loss, _ = step.forward(feats, b)
        step.backward(loss)
        step.optimizer_step(loss)
    assert step.forward(feats, b)[0].item() < first


def test_negative_loss_vocab_is_refused():
    with pytest.raises(ConfigError, match="train.loss_vocab=-1"):
        load_config(None, ["train.loss_vocab=-1"])

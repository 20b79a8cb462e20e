"""One training step of the drafter and its learning-rate schedule, free of host reads of
device tensors:

    drafter_forward (anchors, one-pass block forward, the loss: model/losses.py) -> backward
    -> optimizer_step (clip, AdamW, cosine schedule)

Loss, accuracy and grad norm come back as device tensors and are read later
(run/readback.py `DeferredScalars` copies them to the host without stalling the loop).

The learning-rate schedule, at the end, is the DFlash recipe's: linear warm-up, then cosine to
zero. A LambdaLR over this function rather than torch's SequentialLR(LinearLR, CosineAnnealingLR):
those compute each factor from the previous one (chainable form), which drifts from the
closed form in the last bits (measured: 189 of 200 steps' rates differ, by up to 7e-19, at lr
6e-4 with 8 warm-up steps); the guard tests keep loss histories bit for bit.
"""
from __future__ import annotations

import math

import torch

from ..config import MAX_SEED, TrainConfig, needs_target_distribution
from ..data.batch import Batch
from ..model.drafter import DFlashDrafter, compute_precision, sample_anchors
from ..model.loss_vocab import RowsHead, batch_vocab, frequent_tokens
from ..model.losses import decay_weights, selector_loss, sparse_targets, target_slot_dist, training_loss


class TrainStep:
    """Owns the trainable drafter, its optimizer and LR schedule on one device, and counts
    the optimizer steps taken (`step`). Takes the `train` section and the block size."""

    def __init__(self, train: TrainConfig, block_size: int, drafter: DFlashDrafter, embed, lm_head, device,
                 ddp=None):
        self.train, self.block_size, self.device = train, block_size, torch.device(device)
        self.drafter = drafter
        self.model = ddp or drafter  # what forward/backward go through (DDP wrapper or not)
        self.embed, self.lm_head = embed, lm_head
        params = [p for p in drafter.parameters() if p.requires_grad]
        # a parameter may ask for a multiple of the learning rate (`lr_scale`: the copy head's
        # bias, model/copy_head.py); the schedule scales every group alike
        scales = sorted({getattr(p, "lr_scale", 1.0) for p in params})
        groups = [{"params": [p for p in params if getattr(p, "lr_scale", 1.0) == sc], "lr": train.lr * sc}
                  for sc in scales]
        # fused AdamW: one kernel, and it honours `found_inf` on the device (see optimizer_step)
        self.opt = torch.optim.AdamW(groups, lr=train.lr, betas=(0.9, 0.95),
                                     weight_decay=train.weight_decay, fused=True)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, cosine_with_warmup(max(1, train.steps), train.warmup_ratio))
        # the fixed decay of slots 1..B-1: the paper's weights, and always the accuracy's
        self.weights = decay_weights(block_size, train.loss_gamma or None).to(self.device)[1:]
        self.step = 0
        self.loss_vocab = None   # train.loss_vocab: the frequent token ids (see use_loss_vocab)
        self.target_dist = needs_target_distribution(train.loss)

    def use_loss_vocab(self, samples) -> None:
        """With `train.loss_vocab=K`, score the loss over the K most frequent tokens of these
        (training) samples plus each batch's own tokens (model/loss_vocab.py)."""
        if self.train.loss_vocab:
            self.loss_vocab = frequent_tokens(samples, self.train.loss_vocab)

    def forward(self, features: torch.Tensor, batch: Batch):
        """drafter_forward: returns (loss, accuracy) device tensors. With train.loss=kl|lk the
        features end with the target's last hidden state (model/losses.py `feature_ids`),
        unless the batch brings its top-k distribution from a capture."""
        last = None
        if self.target_dist and batch.kl_topk is None:
            n = self.drafter.fc.in_features
            features, last = features[..., :n], features[..., n:]
        ids = batch.input_ids.to(self.device, non_blocking=True)
        lm = batch.loss_mask.to(self.device, non_blocking=True)
        # anchors depend only on (seed, batch id): the same whichever worker or loop runs it
        # (wrapped into torch's seed range as config.derived_seed does; inline, so that a step
        # reads through no more files than it must: tests/integration/test_step_files.py)
        g = torch.Generator().manual_seed((self.train.seed * 1_000_003 + batch.index) % (MAX_SEED + 1))
        anchors, valid = sample_anchors(batch.loss_mask, self.train.num_anchors,
                                        self.block_size, generator=g)
        anchors, valid = anchors.to(self.device, non_blocking=True), valid.to(self.device, non_blocking=True)
        head = self.lm_head
        if self.loss_vocab is not None:
            head = RowsHead(self.lm_head, batch_vocab(self.loss_vocab, batch.input_ids).to(self.device,
                                                                                          non_blocking=True))
        # fp32 master weights; the drafter autocasts to the frozen embedding's dtype itself
        logits, labels = self.model(features, ids, anchors, valid, self.embed, head)
        if head is not self.lm_head:
            labels = head.to_subset(labels)
        Bk = self.block_size
        pos = anchors[..., None] + torch.arange(1, Bk, device=self.device)
        label_mask = torch.gather(lm, 1, pos.clamp(max=ids.shape[1] - 1).view(ids.shape[0], -1)).view_as(pos)
        targets = self.slot_targets(last, batch, anchors, head) if self.target_dist else None
        loss, acc = training_loss(logits, labels, valid, label_mask.float(), self.weights, self.train, targets)
        ce = getattr(self.drafter, "selector_ce", None)  # DFlash2 (model/dflash2.py): its selector's CE
        if ce is not None:
            self.drafter.selector_ce = None  # taken: the module holds no graph between steps (deepcopy, memory)
            loss = loss + selector_loss(ce, self.weights, label_mask, valid, self.train.selector_loss_alpha)
        return loss, acc

    def slot_targets(self, last, batch: Batch, anchors, head):
        """The target's next-token distribution for every slot (slot k of the block at p is
        token p+k, which the target predicts from position p+k-1), on the loss's columns:
        from its lm_head on the carried last hidden state ``last`` [B, S, H], or from the
        batch's captured top-k."""
        Bsz, A = anchors.shape
        K = self.block_size - 1
        S = batch.input_ids.shape[1]
        prev = (anchors[..., None] + torch.arange(K, device=self.device)).clamp(max=S - 1).view(Bsz, -1)
        rows_ids = head.ids if isinstance(head, RowsHead) else None

        def at(x):  # [B, S, C] -> [B, A, K, C] at the slots' predicting positions
            x = x.to(self.device, non_blocking=True)
            return torch.gather(x, 1, prev[..., None].expand(-1, -1, x.shape[-1])).view(Bsz, A, K, -1)

        if batch.kl_topk is not None:
            logp, tok = batch.kl_topk
            k = self.train.kl_topk or logp.shape[-1]
            return sparse_targets(at(logp[..., :k]).float(), at(tok[..., :k]), rows_ids)
        with torch.no_grad(), compute_precision(self.embed.weight):
            h = at(last).to(self.embed.weight.dtype)
            tl = self.lm_head(h.reshape(-1, h.shape[-1]))
        logp = torch.log_softmax(tl.float(), dim=-1).view(Bsz, A, K, -1)
        return target_slot_dist(logp, self.train.kl_topk, rows_ids)

    def backward(self, loss: torch.Tensor):
        loss.backward()

    def optimizer_step(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip, then update only when loss and grad norm are finite — decided on the device
        (no host read): fused AdamW skips the whole update (weights, moments, step count)
        when `found_inf` is set, the mechanism GradScaler uses. The LR schedule advances."""
        params = [p for p in self.drafter.parameters() if p.grad is not None]
        gnorm = torch.nn.utils.clip_grad_norm_(params, self.train.grad_clip)
        finite = torch.isfinite(loss) & torch.isfinite(gnorm)
        self.opt.found_inf = (~finite).to(torch.float32)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return gnorm.detach(), ~finite

    def state(self) -> dict:
        return {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(), "step": self.step,
                "torch_rng": torch.get_rng_state()}

    def load_state(self, st: dict):
        self.opt.load_state_dict(st["optimizer"])
        self.sched.load_state_dict(st["scheduler"])
        self.step = st["step"]
        torch.set_rng_state(st["torch_rng"])


# -- the learning-rate schedule ----------------------------------------------------------
def cosine_with_warmup(total_steps: int, warmup_ratio: float):
    warm = max(1, int(round(total_steps * warmup_ratio)))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        prog = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, prog)))
    return f

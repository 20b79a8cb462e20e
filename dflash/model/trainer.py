"""The pieces of one training step, shared by the reference loop and the pipeline.

Target side:  model_forward (capture layers) -> pack_hidden (valid tokens only)
Drafter side: unpack -> drafter_forward (anchors, one-pass block forward, loss)
              -> backward -> optimizer_step (clip, AdamW, cosine schedule)

Every function here is free of host reads of device tensors: loss, accuracy and grad
norm come back as device tensors and are read later (see run/readback.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import Config
from . import target as target_mod
from .drafter import DFlashDrafter, DrafterConfig, loss_weights, sample_anchors, weighted_block_loss
from .loss_vocab import RowsHead, batch_vocab, frequent_tokens


@dataclass
class Batch:
    """A tokenized batch on the host, with the metadata every stage's span carries."""
    index: int                 # global batch id: the trace key
    input_ids: torch.Tensor    # [B, S] right-padded
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    lengths: list[int]         # valid tokens per sequence (host ints: packing needs no sync)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def padded_len(self) -> int:
        return int(self.input_ids.shape[1])

    @classmethod
    def from_dict(cls, d: dict) -> "Batch":
        return cls(index=d["batch_index"], input_ids=d["input_ids"], attention_mask=d["attention_mask"],
                   loss_mask=d["loss_mask"], lengths=d["attention_mask"].sum(1).tolist())


def target_features(target, batch: Batch, layer_ids, device) -> torch.Tensor:
    """model_forward: one target forward, selected layers concatenated: [B, S, n*H].

    With `train.feature_cache` (see build_drafter) the target carries a dict of each
    sequence's features, keyed by its token ids: a batch whose sequences were all seen
    before is assembled from it without a forward (the target is frozen; padding rows are
    zero, which is what pack/unpack hand the drafter anyway)."""
    cache = getattr(target, "_dflash_feature_cache", None)
    keys = None
    if cache is not None:
        keys = [feature_key(layer_ids, batch.input_ids[i, :n]) for i, n in enumerate(batch.lengths)]
        rows = [cache.get(k) for k in keys]
        if all(r is not None for r in rows):
            out = rows[0].new_zeros(len(rows), batch.padded_len, rows[0].shape[-1])
            for i, r in enumerate(rows):
                out[i, :r.shape[0]] = r
            return out
    ids = batch.input_ids.to(device, non_blocking=True)
    am = batch.attention_mask.to(device, non_blocking=True)
    feats = target_mod.capture_hidden(target, ids, am, layer_ids)
    if keys is not None:
        for i, (k, n) in enumerate(zip(keys, batch.lengths)):
            cache.setdefault(k, feats[i, :n].clone())
    return feats


def feature_key(layer_ids, ids: torch.Tensor) -> tuple:
    """The feature cache's key for one sequence: the layers and the int64 token ids."""
    return tuple(layer_ids), ids.to(torch.long).numpy().tobytes()


def preload_features(target, layer_ids, features: dict, max_len: int) -> int:
    """Seed `train.feature_cache` with features regeneration kept (token-id tuple -> [len, n*H]),
    cut to `data.max_len` as the samples are, on the target's device (where a forward would
    have left them: a hit must look like a forward to the pipeline). Returns how many went in."""
    cache = getattr(target, "_dflash_feature_cache", None)
    if cache is None or not features:
        return 0
    dev = next(target.parameters()).device
    for ids, rows in features.items():
        cache.setdefault(feature_key(layer_ids, torch.tensor(ids[:max_len])), rows[:max_len].to(dev))
    return len(features)


def replicate_target(target, device):
    """A frozen copy of the target on `device`, with its own feature cache (if any) there:
    a cache hit must come back on the replica's device, and the dict is not deep-copied twice."""
    import copy

    cache = getattr(target, "_dflash_feature_cache", None)
    target._dflash_feature_cache = None
    try:
        replica = copy.deepcopy(target).to(device)
    finally:
        target._dflash_feature_cache = cache
    replica._dflash_feature_cache = None if cache is None else {k: v.to(device) for k, v in cache.items()}
    return replica


def pack(features: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """pack_hidden: keep valid tokens only -> [sum(lengths), n*H]; host ints, no nonzero()."""
    return torch.cat([features[i, :n] for i, n in enumerate(lengths)], dim=0)


def unpack(packed: torch.Tensor, lengths: list[int], padded_len: int) -> torch.Tensor:
    out = packed.new_zeros(len(lengths), padded_len, packed.shape[-1])
    start = 0
    for i, n in enumerate(lengths):
        out[i, :n] = packed[start:start + n]
        start += n
    return out


def build_drafter(cfg: Config, target, tokenizer, layer_ids) -> DFlashDrafter:
    vocab_rows = target.get_input_embeddings().weight.shape[0]
    mask_id, _ = target_mod.choose_mask_token_id(tokenizer, vocab_rows)
    dcfg = DrafterConfig.from_target(
        target.config, target_layer_ids=layer_ids, mask_token_id=mask_id, vocab_size=vocab_rows,
        num_hidden_layers=cfg.model.num_layers, block_size=cfg.model.block_size, target=cfg.model.target,
        copy_head=cfg.model.copy_head)
    torch.manual_seed(cfg.train.seed)
    if cfg.model.init_from:  # someone else's drafter (a published one): its weights, this run's data
        from ..init_from import load_into_run
        drafter = load_into_run(cfg, target)
    else:
        drafter = DFlashDrafter(dcfg)
    if cfg.train.feature_cache:  # read by target_features: later epochs skip the target forward
        target._dflash_feature_cache = {}
    if cfg.model.drafter_init == "target" and not cfg.model.init_from:
        from .drafter_init import init_from_target
        init_from_target(drafter, target)
    return drafter


def cosine_with_warmup(total_steps: int, warmup_ratio: float):
    warm = max(1, int(round(total_steps * warmup_ratio)))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        prog = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, prog)))
    return f


class DrafterStep:
    """Owns the trainable drafter, its optimizer and schedule on one device."""

    def __init__(self, cfg: Config, drafter: DFlashDrafter, embed, lm_head, device, ddp=None):
        self.cfg, self.device = cfg, torch.device(device)
        self.drafter = drafter
        self.model = ddp or drafter  # what forward/backward go through (DDP wrapper or not)
        self.embed, self.lm_head = embed, lm_head
        params = [p for p in drafter.parameters() if p.requires_grad]
        # a parameter may ask for a multiple of the learning rate (`lr_scale`: the copy head's
        # bias, model/copy_head.py); the schedule scales every group alike
        scales = sorted({getattr(p, "lr_scale", 1.0) for p in params})
        groups = [{"params": [p for p in params if getattr(p, "lr_scale", 1.0) == sc], "lr": cfg.train.lr * sc}
                  for sc in scales]
        # fused AdamW: one kernel, and it honours `found_inf` on the device (see optimizer_step)
        self.opt = torch.optim.AdamW(groups, lr=cfg.train.lr, betas=(0.9, 0.95),
                                     weight_decay=cfg.train.weight_decay, fused=True)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, cosine_with_warmup(max(1, cfg.train.steps), cfg.train.warmup_ratio))
        self.weights = loss_weights(cfg.model.block_size, cfg.train.loss_gamma or None).to(self.device)[1:]
        self.step = 0
        self.loss_vocab = None   # train.loss_vocab: the frequent token ids (see use_loss_vocab)

    def use_loss_vocab(self, samples) -> None:
        """With `train.loss_vocab=K`, score the loss over the K most frequent tokens of these
        (training) samples plus each batch's own tokens (model/loss_vocab.py)."""
        if self.cfg.train.loss_vocab:
            self.loss_vocab = frequent_tokens(samples, self.cfg.train.loss_vocab)

    def forward(self, features: torch.Tensor, batch: Batch):
        """drafter_forward: returns (loss, accuracy) device tensors."""
        ids = batch.input_ids.to(self.device, non_blocking=True)
        lm = batch.loss_mask.to(self.device, non_blocking=True)
        # anchors depend only on (seed, batch id): the same whichever worker or loop runs it
        g = torch.Generator().manual_seed(self.cfg.train.seed * 1_000_003 + batch.index)
        anchors, valid = sample_anchors(batch.loss_mask, self.cfg.train.num_anchors,
                                        self.cfg.model.block_size, generator=g)
        anchors, valid = anchors.to(self.device, non_blocking=True), valid.to(self.device, non_blocking=True)
        head = self.lm_head
        if self.loss_vocab is not None:
            head = RowsHead(self.lm_head, batch_vocab(self.loss_vocab, batch.input_ids).to(self.device,
                                                                                          non_blocking=True))
        # fp32 master weights; the drafter autocasts to the frozen embedding's dtype itself
        logits, labels = self.model(features, ids, anchors, valid, self.embed, head)
        if head is not self.lm_head:
            labels = head.to_subset(labels)
        Bk = self.cfg.model.block_size
        pos = anchors[..., None] + torch.arange(1, Bk, device=self.device)
        label_mask = torch.gather(lm, 1, pos.clamp(max=ids.shape[1] - 1).view(ids.shape[0], -1)).view_as(pos)
        return weighted_block_loss(logits, labels, valid, label_mask.float(), self.weights)

    def backward(self, loss: torch.Tensor):
        loss.backward()

    def optimizer_step(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip, then update only when loss and grad norm are finite — decided on the device
        (no host read): fused AdamW skips the whole update (weights, moments, step count)
        when `found_inf` is set, the mechanism GradScaler uses. The LR schedule advances."""
        params = [p for p in self.drafter.parameters() if p.grad is not None]
        gnorm = torch.nn.utils.clip_grad_norm_(params, self.cfg.train.grad_clip)
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

"""One training step of the drafter and its learning-rate schedule, free of host reads of
device tensors:

    drafter_forward (`forward`: the loss of the batch, its family's forward through
    model/objective.py) -> backward -> optimizer_step (clip, AdamW or Muon, cosine schedule)

`train.optimizer=muon` (`muon_split`, as vLLM's speculators splits them): torch.optim.Muon
orthogonalizes the update of every 2-D weight matrix (attention, MLP, the fusion's fc, DFlash2's
kernel projections and selector projection) at `train.muon_lr`; AdamW keeps the rest (norms,
biases, vectors) at `train.lr`, and the 2-D tables Muon skips for their shape, not their step
(DFlash2's codebooks, DSpark's Markov factors), at Muon's rate and weight decay. Both follow
the one schedule.

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

from ..config import TrainConfig
from ..data.batch import Batch
from ..model.drafter import DFlashDrafter
from ..model.objective import DraftLoss


# 2-D parameters speculators leaves to AdamW (optimizers.py `_ADAMW_NAME_HINTS`): vocabulary-indexed
# tables, whose rows are not a linear map's; ours are DFlash2's codebooks and DSpark's Markov factors
MUON_SKIPS = ("codebook", "markov_w1", "markov_w2")


def muon_split(named_params) -> tuple[list, list, list]:
    """(Muon's, AdamW's, the 2-D tables AdamW takes at Muon's rate) of (name, parameter) pairs:
    a matrix with both sides > 1 goes to Muon unless its name marks a table (`MUON_SKIPS`);
    everything else (norms, biases, [1, N] rows) to AdamW, a 2-D bias too (the copy head's
    [slot, match length] table, with its own `lr_scale`, is no linear map to orthogonalise)."""
    muon, adamw, tables = [], [], []
    for name, p in named_params:
        if p.ndim != 2 or min(p.shape) == 1 or name.rsplit(".", 1)[-1] == "bias" or hasattr(p, "lr_scale"):
            adamw.append(p)
        elif any(h in name for h in MUON_SKIPS):
            tables.append(p)
        else:
            muon.append(p)
    return muon, adamw, tables


class TrainStep:
    """Owns the trainable drafter, its loss (`loss`: model/objective.py), its optimizer and LR
    schedule on one device, and counts the optimizer steps taken (`step`). Takes the `train`
    section and the block size."""

    def __init__(self, train: TrainConfig, block_size: int, drafter: DFlashDrafter, embed, lm_head, device,
                 ddp=None):
        self.train, self.block_size, self.device = train, block_size, torch.device(device)
        self.drafter = drafter
        self.embed, self.lm_head = embed, lm_head
        # what forward/backward go through: the DDP wrapper or the drafter itself
        self.loss = DraftLoss(train, block_size, drafter, embed, lm_head, self.device, model=ddp or drafter)
        if train.compile:
            drafter.compile_layers()
        named = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]
        schedule = cosine_with_warmup(max(1, train.steps), train.warmup_ratio)
        self.muon = self.muon_sched = None
        self.muon_params: list = []
        params, tables = [p for _, p in named], []
        if train.optimizer == "muon":
            self.muon_params, params, tables = muon_split(named)
            muon_lr = train.muon_lr or train.lr
            self.muon = torch.optim.Muon(self.muon_params, lr=muon_lr, weight_decay=train.muon_weight_decay,
                                         momentum=train.muon_momentum, nesterov=True,
                                         adjust_lr_fn=train.muon_adjust_lr)
            self.muon_sched = torch.optim.lr_scheduler.LambdaLR(self.muon, schedule)
        # a parameter may ask for a multiple of the learning rate (`lr_scale`: the copy head's
        # bias, model/copy_head.py); the schedule scales every group alike
        scales = sorted({getattr(p, "lr_scale", 1.0) for p in params})
        groups = [{"params": [p for p in params if getattr(p, "lr_scale", 1.0) == sc], "lr": train.lr * sc}
                  for sc in scales]
        if tables:  # skipped by Muon for their shape: Muon's rate and weight decay (speculators' rule)
            groups.append({"params": tables, "lr": train.muon_lr or train.lr, "weight_decay": train.muon_weight_decay})
        # fused AdamW: one kernel, and it honours `found_inf` on the device (see optimizer_step)
        self.opt = torch.optim.AdamW(groups, lr=train.lr, betas=(0.9, 0.95),
                                     weight_decay=train.weight_decay, fused=True)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule)
        self.step = 0

    def use_loss_vocab(self, samples) -> None:
        """`train.loss_vocab`: the loss over the samples' most frequent tokens (model/objective.py)."""
        self.loss.use_loss_vocab(samples)

    def forward(self, features: torch.Tensor, batch: Batch):
        """drafter_forward: (loss, accuracy) device tensors of the batch."""
        return self.loss(features, batch)

    def backward(self, loss: torch.Tensor):
        loss.backward()

    def optimizer_step(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip, then update only when loss and grad norm are finite — decided on the device
        (no host read): fused AdamW skips the whole update (weights, moments, step count)
        when `found_inf` is set, the mechanism GradScaler uses. torch's Muon has no such flag:
        on a non-finite step its matrices' gradients are zeroed on the device instead, so only
        its momentum and weight decay move them. The LR schedule advances."""
        params = [p for p in self.drafter.parameters() if p.grad is not None]
        gnorm = torch.nn.utils.clip_grad_norm_(params, self.train.grad_clip)
        finite = torch.isfinite(loss) & torch.isfinite(gnorm)
        self.opt.found_inf = (~finite).to(torch.float32)
        if self.muon is not None:
            for p in self.muon_params:
                if p.grad is not None:
                    p.grad.masked_fill_(~finite, 0.0)
            self.muon.step()
            self.muon_sched.step()
            self.muon.zero_grad(set_to_none=True)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return gnorm.detach(), ~finite

    def state(self) -> dict:
        st = {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(), "step": self.step,
              "torch_rng": torch.get_rng_state()}
        if self.muon is not None:
            st |= {"muon": self.muon.state_dict(), "muon_scheduler": self.muon_sched.state_dict()}
        return st

    def load_state(self, st: dict):
        from ..errors import ConfigError
        if ("muon" in st) != (self.muon is not None):
            saved = "muon" if "muon" in st else "adamw"
            raise ConfigError(f"train.optimizer={self.train.optimizer}: the checkpoint was trained with {saved}; "
                              f"resume with --set train.optimizer={saved}")
        try:
            self.opt.load_state_dict(st["optimizer"])
            if self.muon is not None:
                self.muon.load_state_dict(st["muon"])
        except ValueError as e:  # torch: the groups or their sizes differ (a checkpoint of an earlier split)
            raise ConfigError(f"--resume: the checkpoint's optimizer state does not fit this run's parameter "
                              f"groups ({str(e).splitlines()[0][:120]}): it was saved by a version that grouped "
                              f"them otherwise (Muon with a copy head); train into a new --out, or --init-from "
                              f"its export") from None
        self.sched.load_state_dict(st["scheduler"])
        if self.muon is not None:
            self.muon_sched.load_state_dict(st["muon_scheduler"])
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

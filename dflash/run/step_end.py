"""The end of a training step: one path for the reference loop and the pipeline.

After each optimizer step: count the tokens, queue the deferred read-back of loss /
accuracy / grad norm and turn whatever has come back into metrics (a non-finite step gets
a `skipped_step` marker in its batch's trace), move the progress bar, and save when
`train.save_every` says so. Nothing here reads a device tensor on the host.
"""
from __future__ import annotations

from .progress import Progress
from .saving import save


class StepEnd:
    def __init__(self, ctx, worker: str):
        self.ctx, self.tel, self.worker = ctx, ctx.tel, worker
        self.save_every = ctx.cfg.train.save_every
        self.bar = Progress(ctx)

    def __call__(self, step: int, tokens: int, loss, acc, gnorm, nonfinite) -> None:
        ctx, tel, worker = self.ctx, self.tel, self.worker
        ctx.tokens += tokens
        tel.add("dflash.tokens", tokens, worker=worker)
        tel.add("dflash.train.steps", 1, worker=worker)
        self._record(step, loss, acc, gnorm, nonfinite)
        self.bar.update(tokens)
        est = ctx.estimate
        if est is not None and est.due(ctx.trainer.step):
            with tel.stage("acceptance_estimate", trace=("batch", step), worker=worker, step=step):
                est(ctx.trainer.step)
        if self.save_every and ctx.trainer.step % self.save_every == 0:
            save(ctx)

    def _record(self, step, loss, acc, gnorm, nonfinite) -> None:
        ctx, tel = self.ctx, self.tel
        before, nf_before = len(ctx.history), len(ctx.nonfinite)
        ctx.record(step, loss, acc, gnorm, nonfinite)
        for _, l, _, g in ctx.history[before:]:
            tel.record("dflash.train.loss", l)
            tel.record("dflash.train.grad_norm", g)
        for s in ctx.nonfinite[nf_before:]:  # known only now (deferred read): mark the batch
            tel.add("dflash.train.nonfinite_steps", 1)
            with tel.stage("skipped_step", trace=("batch", s), worker=self.worker, step=s) as sp:
                sp.event("nonfinite_loss", step=s, action="update skipped")

    def close(self) -> None:
        self.bar.close()

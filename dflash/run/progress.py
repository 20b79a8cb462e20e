"""The progress bar: step, last known loss (read back asynchronously) and tokens/s."""
from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
    def __init__(self, ctx):
        self.ctx = ctx
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.bar = tqdm(total=ctx.cfg.train.steps, initial=ctx.trainer.step, desc="train", unit="step",
                        file=sys.stderr, dynamic_ncols=True, disable=not ctx.is_lead, mininterval=0.5)

    def update(self, tokens: int) -> None:
        self.tokens += tokens
        self.bar.update(1)
        h = self.ctx.history
        rate = self.tokens / max(1e-9, time.perf_counter() - self.t0)
        self.bar.set_postfix_str(f"loss={h[-1][1]:.3f} tok/s={rate:,.0f}" if h else f"tok/s={rate:,.0f}",
                                 refresh=False)

    def close(self) -> None:
        self.bar.close()

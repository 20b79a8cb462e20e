"""The run's learning curve as a picture: training loss and the held-out acceptance
estimate (dflash/run/acceptance_estimate.py) against steps, written next to the run's other
files as OUT/learning_curve.png."""
from __future__ import annotations

from pathlib import Path


def write_png(path: Path, loss_history: list, estimate_history: list, block_size: int, title: str = "") -> Path:
    import matplotlib
    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.0), dpi=110)
    if loss_history:
        steps, losses = zip(*[(s, l) for s, l, *_ in loss_history])
        ax.plot(steps, losses, color="tab:blue", linewidth=1.0, alpha=0.8, label="training loss")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss", color="tab:blue")
    ax.set_yscale("log")
    if estimate_history:
        ax2 = ax.twinx()
        steps, taus = zip(*[(s, t) for s, t, *_ in estimate_history])
        ax2.plot(steps, taus, color="tab:red", marker="o", markersize=3, linewidth=1.5,
                 label="acceptance estimate (held out)")
        own = [(h[0], h[3]) for h in estimate_history if len(h) > 3 and h[3] is not None]
        if own:  # a copy head's drafter: the same estimate without its copy proposals
            ax2.plot(*zip(*own), color="tab:red", linestyle="--", marker="o", markersize=2, linewidth=1.0,
                     alpha=0.7, label="estimate without the copy head")
            ax2.legend(loc="lower right", fontsize=8)
        ax2.set_ylabel(f"estimated tau (block {block_size})", color="tab:red")
        ax2.set_ylim(bottom=1.0)
    ax.set_title(title or "learning curve")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path

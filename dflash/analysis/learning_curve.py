"""The run's learning curve as a picture: training loss and the held-out acceptance
estimate (dflash/run/acceptance_estimate.py: tau per verify step, walked) against steps,
written next to the run's other files as OUT/learning_curve.png.

With `train --eval` the picture also shows what the after-training eval decoded: the served
drafter's tau (a star at the last step) beside prompt lookup's (a dashed line: the free
baseline a drafter has to beat), both per verify step as the curve counts them (the eval's
`tau_per_step`), and a side panel with the share of verify steps that accepted each draft
position, for both."""
from __future__ import annotations

from pathlib import Path

from otel.confined import open_for_write


def write_png(path: Path, loss_history: list, estimate_history: list, block_size: int, title: str = "",
              final: dict | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    final = final if final and "acceptance_length" in final else None
    if final and final.get("per_position_acceptance"):
        fig, (ax, side) = plt.subplots(1, 2, figsize=(10.0, 4.0), dpi=110, gridspec_kw={"width_ratios": [3, 1]})
    else:
        (fig, ax), side = plt.subplots(figsize=(7.5, 4.0), dpi=110), None
    if loss_history:
        steps, losses = zip(*[(s, l) for s, l, *_ in loss_history])
        ax.plot(steps, losses, color="tab:blue", linewidth=1.0, alpha=0.8, label="training loss")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss", color="tab:blue")
    ax.set_yscale("log")
    if estimate_history or final:
        ax2 = ax.twinx()
        legend = False
        if estimate_history:
            steps, taus = zip(*[(s, t) for s, t, *_ in estimate_history])
            ax2.plot(steps, taus, color="tab:red", marker="o", markersize=3, linewidth=1.5,
                     label="held-out tau per verify step (walked)")
            own = [(h[0], h[3]) for h in estimate_history if len(h) > 3 and h[3] is not None]
            if own:  # a copy head's drafter: the same estimate without its copy proposals
                ax2.plot(*zip(*own), color="tab:red", linestyle="--", marker="o", markersize=2, linewidth=1.0,
                         alpha=0.7, label="estimate without the copy head")
                legend = True
        if final:
            last = max([s for s, *_ in loss_history] + [s for s, *_ in estimate_history] + [0])
            partial = " (partial)" if final.get("interrupted") else ""
            tau = _per_step(final)
            ax2.plot([last], [tau], marker="*", markersize=11, color="tab:green",
                     linestyle="none", label=f"decoded per verify step, served drafter: {tau:.3f}{partial}")
            base = final.get("baseline") or {}
            if "acceptance_length" in base:
                ax2.axhline(_per_step(base), color="tab:gray", linestyle="--", linewidth=1.2,
                            label=f"decoded, prompt lookup: {_per_step(base):.3f}")
            legend = True
        if legend:
            ax2.legend(loc="lower right", fontsize=8)
        ax2.set_ylabel(f"tau (block {block_size})", color="tab:red")
        ax2.set_ylim(bottom=1.0)
    ax.set_title(title or "learning curve")
    ax.grid(alpha=0.3)
    if side is not None:
        _per_position(side, final)
    fig.tight_layout()
    path = Path(path)
    with open_for_write(path, "wb") as f:  # a link in its place is refused, never followed
        fig.savefig(f, format="png")
    plt.close(fig)
    return path


def _per_step(res: dict) -> float:
    """An eval's tau per verify step (the curve's count), from an older result its histogram."""
    if "tau_per_step" in res:
        return res["tau_per_step"]
    hist = res.get("histogram") or {}
    steps = sum(hist.values())
    return sum(int(k) * v for k, v in hist.items()) / steps if steps else res["acceptance_length"]


def _per_position(ax, final: dict) -> None:
    """Bars: the share of verify steps that accepted draft position k, served drafter and
    prompt lookup side by side (where a drafter gives up)."""
    ours = final["per_position_acceptance"]
    base = (final.get("baseline") or {}).get("per_position_acceptance")
    ks = list(range(1, len(ours) + 1))
    w = 0.4 if base else 0.8
    ax.bar([k - (w / 2 if base else 0) for k in ks], ours, width=w, color="tab:green", label="served drafter")
    if base:
        ax.bar([k + w / 2 for k in ks], base, width=w, color="tab:gray", label="prompt lookup")
    ax.set_xticks(ks)
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of verify steps accepted")
    ax.set_ylim(0, 1)
    ax.set_title("after training", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(alpha=0.3, axis="y")

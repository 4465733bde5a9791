"""Stacked-area memory charts of traced steps (matplotlib, the `plot` extra)."""

from hf_memfit.estimator.breakdown import CATEGORIES
from hf_memfit.errors import MemFitError

_COLORS = {"weights": "#4C72B0", "gradients": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52",
           "temporary": "#8172B3", "overhead": "#937860"}


def plot_timelines(timelines: list, path: str, title: str = "") -> str:
    """Draw one panel per timeline, side by side with a shared y axis; phases marked, peak annotated."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MemFitError("`--plot` needs matplotlib: pip install 'hf-memfit[plot]'") from None
    gib = 2**30
    fig, axes = plt.subplots(1, len(timelines), figsize=(6.5 * len(timelines), 4.8), sharey=True, squeeze=False)
    for ax, timeline in zip(axes[0], timelines):
        layers = [[v / gib for v in timeline.by_category[c]] for c in CATEGORIES]
        ax.stackplot(timeline.clock, layers, labels=CATEGORIES, colors=[_COLORS[c] for c in CATEGORIES], alpha=0.9)
        for phase in timeline.phases:
            ax.axvline(phase.start, color="0.3", lw=0.8, ls="--")
            ax.text(phase.start, 1.0, f" {phase.name}", transform=ax.get_xaxis_transform(), va="top", fontsize=8,
                    rotation=90, color="0.2")
        if timeline.device_total_bytes > timeline.peak_bytes:  # CUDA: reserved segments, context, NCCL on top
            ax.axhline(timeline.device_total_bytes / gib, color="0.2", lw=1.0, ls=":")
            ax.text(timeline.clock[0], timeline.device_total_bytes / gib,
                    f" device total (nvidia-smi) {timeline.device_total_bytes / gib:.2f} GiB", va="bottom", fontsize=8)
        ax.annotate(f"peak {timeline.peak_bytes / gib:.2f} GiB", xy=(timeline.peak_clock, timeline.peak_bytes / gib),
                    xytext=(0.55, 0.93), textcoords="axes fraction", fontsize=9,
                    arrowprops={"arrowstyle": "->", "color": "black"})
        ax.set_title(timeline.label, fontsize=10)
        ax.set_xlabel("allocator events (forward → backward → optimizer step)")
        ax.set_xlim(timeline.clock[0], timeline.clock[-1])
    axes[0][0].set_ylabel("live memory (GiB)")
    axes[0][0].legend(loc="upper left", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

"""Charts (matplotlib, the `plot` extra): stacked-area memory of traced steps, and `--seq-len max`'s scaling."""

from hf_memfit.estimator.breakdown import CATEGORIES
from hf_memfit.errors import MemFitError

_COLORS = {"weights": "#4C72B0", "gradients": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52",
           "temporary": "#8172B3", "overhead": "#937860"}


def _pyplot(flag: str):
    """matplotlib's pyplot on the file-only Agg backend, or a one-line error naming the flag that needs it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MemFitError(f"`{flag}` needs matplotlib: pip install 'hf-memfit[plot]'") from None
    return plt


def plot_timelines(timelines: list, path: str, title: str = "") -> str:
    """Draw one panel per timeline, side by side with a shared y axis; phases marked, peak annotated."""
    plt = _pyplot("--plot")
    gib = 2**30
    fig, axes = plt.subplots(1, len(timelines), figsize=(6.5 * len(timelines), 4.8), sharey=True, squeeze=False)
    for ax, timeline in zip(axes[0], timelines):
        layers = [[v / gib for v in timeline.by_category[c]] for c in CATEGORIES]
        ax.stackplot(timeline.clock, layers, labels=CATEGORIES, colors=[_COLORS[c] for c in CATEGORIES], alpha=0.9)
        for phase in timeline.phases:
            ax.axvline(phase.start, color="0.3", lw=0.8, ls="--")
            ax.text(phase.start, 1.0, f" {phase.name}", transform=ax.get_xaxis_transform(), va="top", fontsize=8,
                    rotation=90, color="0.2")
        panel_title = timeline.label
        if timeline.device_total_bytes > timeline.peak_bytes:  # CUDA: reserved segments, context, NCCL on top
            ax.axhline(timeline.device_total_bytes / gib, color="0.2", lw=1.0, ls=":")
            # named in the title: inside the panel the phase names, hanging from the top, crossed it
            panel_title += f"\ndotted: device total (nvidia-smi) {timeline.device_total_bytes / gib:.2f} GiB"
        ax.set_ylim(0, 1.15 * max(timeline.device_total_bytes, timeline.peak_bytes) / gib)  # room for the labels
        ax.annotate(f"peak {timeline.peak_bytes / gib:.2f} GiB", xy=(timeline.peak_clock, timeline.peak_bytes / gib),
                    xytext=(0.55, 0.93), textcoords="axes fraction", fontsize=9,
                    arrowprops={"arrowstyle": "->", "color": "black"})
        ax.set_title(panel_title, fontsize=10)
        ax.set_xlabel("allocator events (forward → backward → optimizer step)")
        ax.set_xlim(timeline.clock[0], timeline.clock[-1])
    axes[0][0].set_ylabel("live memory (GiB)")
    # below the panels: inside one it covered the first phases' names and the memory of the first forward
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=len(CATEGORIES), fontsize=8,
               frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_length_scaling(points: list, path: str, title: str = "") -> str:
    """`plan --seq-len max --explain FILE.png`: device peak and step time of the plan at each length searched.

    `points` are `planner.longest.LengthPoint`s; those that do not fit are marked on the budget line.
    """
    plt = _pyplot("--explain FILE.png")
    gib = 2**30
    fits = [p for p in points if p.fits]
    fig, memory = plt.subplots(figsize=(7.5, 4.6))
    memory.plot([p.seq_len for p in fits], [p.device_total_bytes / gib for p in fits], "o-", color=_COLORS["weights"],
                label="device peak (GiB)")
    for p in fits:
        memory.annotate(f"{p.seq_len:,}", (p.seq_len, p.device_total_bytes / gib), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=7)
    memory.set_xscale("log", base=2)
    memory.set_xlabel("tokens per sample")
    memory.set_ylabel("device peak (GiB)")
    time_axis = memory.twinx()
    time_axis.plot([p.seq_len for p in fits], [p.step_seconds for p in fits], "s--", color=_COLORS["activations"],
                   label="step time (s)")
    time_axis.set_ylabel("predicted step time (s)")
    for p in points:
        if not p.fits:
            memory.axvline(p.seq_len, color="0.4", lw=0.8, ls=":")
            memory.text(p.seq_len, 0.02, " does not fit", transform=memory.get_xaxis_transform(), fontsize=7,
                        rotation=90, va="bottom")
    handles = memory.get_legend_handles_labels()[0] + time_axis.get_legend_handles_labels()[0]
    memory.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize=8)
    if title:
        memory.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

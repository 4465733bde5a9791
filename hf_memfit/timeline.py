"""Where the memory goes: a traced step's timeline by category, its phases, and what is live at the peak.

Built from an exact-mode trace at full depth (no extrapolation), so every
layer is there to see and the peak equals the exact estimate of the same
settings on one device. Plain data; `plot.py` draws it and `report.py` prints it.
"""

from dataclasses import dataclass
import re

from hf_memfit.breakdown import CATEGORIES
from hf_memfit.settings import TrainSettings


@dataclass
class Phase:
    name: str  # "forward", "backward", "optimizer step"
    start: int  # clock
    end: int
    peak_bytes: int


@dataclass
class Timeline:
    """Live bytes by category over the step's clock (one tick per allocation or release)."""

    label: str
    clock: list[int]
    by_category: dict[str, list[int]]  # category -> live bytes at each clock sample
    phases: list[Phase]
    peak_bytes: int
    peak_clock: int
    peak_breakdown: dict[str, int]
    top_modules: list[tuple[str, int]]  # module -> activation bytes live at the peak
    top_module_groups: list[tuple[str, int]]  # the same with layer indices folded ("h.*.mlp")

    @property
    def total(self) -> list[int]:
        return [sum(values) for values in zip(*self.by_category.values())]


def trace_timeline(spec, settings: TrainSettings, label: str = "", samples: int = 1500) -> Timeline:
    """Trace one configuration at full depth and summarise it (CUDA semantics follow `settings.device`).

    Under ZeRO the step is traced as the device runs it (in the compute dtype, see
    `estimator.traced_settings`) on one unsharded device: the timeline shows where
    activations and temporaries go; the sharded model states are the estimate's.
    """
    from hf_memfit.estimator import traced_settings
    from hf_memfit.trace import _config_with_depths, _real_depths, trace_step

    depths = _real_depths(spec)
    trace = trace_step(_config_with_depths(spec, depths), traced_settings(settings), depths)
    label = label or spec.name
    if settings.zero_stage:
        label += f" (one device, before ZeRO-{settings.zero_stage} sharding)"
    return build_timeline(trace.tracker, label, samples)


def build_timeline(tracker, label: str, samples: int = 1500) -> Timeline:
    end_clock = tracker.clock
    deltas = {c: [0] * (end_clock + 2) for c in CATEGORIES}
    for record in tracker.allocations:
        deltas[record.category][record.start] += record.nbytes
        if record.end is not None:
            deltas[record.category][record.end] -= record.nbytes
    # Keep, from every bucket of `stride` events, the one with the most live bytes,
    # so that short spikes (the peak among them) survive the down-sampling.
    running = dict.fromkeys(CATEGORIES, 0)
    stride = max(1, end_clock // samples)
    clock, series = [], {c: [] for c in CATEGORIES}
    best_t, best_total, best_values = 0, -1, None
    for t in range(end_clock + 1):
        for c in CATEGORIES:
            running[c] += deltas[c][t]
        total = sum(running.values())
        if total > best_total:
            best_t, best_total, best_values = t, total, dict(running)
        if t % stride == stride - 1 or t == end_clock:
            clock.append(best_t)
            for c in CATEGORIES:
                series[c].append(best_values[c])
            best_total = -1
    phases = _phases(tracker)
    modules, groups = _top_modules(tracker)
    return Timeline(label, clock, series, phases, tracker.peak_bytes, tracker.peak_clock,
                    tracker.breakdown_at(tracker.peak_clock), modules, groups)


def _phases(tracker) -> list[Phase]:
    """Every marked stretch of the trace ("step 2 forward", "step 2 backward", ...), with its peak."""
    markers = tracker.markers
    phases = []
    for (start, name), (end, _) in zip(markers, markers[1:]):
        phases.append(Phase(name.replace("optimizer", "optimizer step"), start, end, _max_live(tracker, start, end)))
    return phases


def _max_live(tracker, start: int, end: int) -> int:
    live, best = 0, 0
    changes: dict[int, int] = {}
    for record in tracker.allocations:
        if record.start <= start and (record.end is None or record.end > start):
            live += record.nbytes
        if start < record.start <= end:
            changes[record.start] = changes.get(record.start, 0) + record.nbytes
        if record.end is not None and start < record.end <= end:
            changes[record.end] = changes.get(record.end, 0) - record.nbytes
    best = live
    for t in sorted(changes):
        live += changes[t]
        best = max(best, live)
    return best


_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")


def _top_modules(tracker, top: int = 10) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    at_peak: dict[str, int] = {}
    for record in tracker.allocations:
        if record.category == "activations" and record.start <= tracker.peak_clock \
                and (record.end is None or record.end > tracker.peak_clock):
            at_peak[record.module or "(outside modules: inputs, loss)"] = at_peak.get(record.module or "(outside modules: inputs, loss)", 0) + record.nbytes
    groups: dict[str, int] = {}
    for module, nbytes in at_peak.items():
        folded = _LAYER_INDEX.sub(".*", module)
        groups[folded] = groups.get(folded, 0) + nbytes
    ordered = sorted(at_peak.items(), key=lambda kv: -kv[1])[:top]
    return ordered, sorted(groups.items(), key=lambda kv: -kv[1])[:top]

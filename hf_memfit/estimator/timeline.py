"""Where the memory goes: a traced step's timeline by category, its phases, and what is live at the peak.

Built from an exact-mode trace at full depth (no extrapolation), so every
layer is there to see and the peak equals the exact estimate of the same
settings on one device. Plain data; `plot.py` draws it and `report.py` prints it.
"""

from dataclasses import dataclass
import re

from hf_memfit.estimator.breakdown import CATEGORIES
from hf_memfit.settings import TrainSettings


@dataclass
class Phase:
    name: str  # "forward", "backward", "optimizer step"
    start: int  # clock
    end: int
    peak_bytes: int


@dataclass
class Timeline:
    """Live bytes by category over the step's clock (one tick per allocation or release), on one rank."""

    label: str
    clock: list[int]
    by_category: dict[str, list[int]]  # category -> live bytes at each clock sample
    phases: list[Phase]
    peak_bytes: int  # the drawn peak: the estimate's peak allocated (torch.cuda.max_memory_allocated)
    peak_clock: int
    peak_breakdown: dict[str, int]
    top_modules: list[tuple[str, int]]  # module -> activation bytes live at the peak
    top_module_groups: list[tuple[str, int]]  # the same with layer indices folded ("h.*.mlp")
    device_total_bytes: int = 0  # what nvidia-smi shows at the peak (reserved + CUDA context + NCCL)
    layout: str = ""  # how the rank's model states are laid out, when they are not simply the traced ones

    @property
    def total(self) -> list[int]:
        return [sum(values) for values in zip(*self.by_category.values())]


def trace_timeline(spec, settings: TrainSettings, label: str = "", samples: int = 1500) -> Timeline:
    """Trace one configuration at full depth and summarise it as one rank holds it (CUDA semantics follow `settings.device`).

    The step is traced as the device runs it (under ZeRO in the compute dtype, see
    `estimator.traced_settings`), and every sample of it then goes through what
    the estimator does to its peak candidates: `sharding.shard` (DDP buckets,
    ZeRO partitions and buckets, offload, 4-bit packing, paging) and, on CUDA,
    the cuBLAS workspaces. So the drawn peak is the estimate's peak allocated for
    the same trace, and `device_total_bytes` its nvidia-smi total.
    """
    from hf_memfit.estimator.assemble import assemble, traced_settings
    from hf_memfit.estimator.sequence import local_step_settings, with_sequence_terms
    from hf_memfit.estimator.exact import full_depth_step_memory
    from hf_memfit.estimator.trace import trace_step
    from hf_memfit.models.depths import config_with_depths, real_depths

    depths = real_depths(spec)
    local = local_step_settings(traced_settings(settings))  # a sequence-parallel rank's share of each row
    trace = trace_step(config_with_depths(spec, depths), local, depths, short_warm_up=False)  # step 1 drawn as it runs
    step = full_depth_step_memory(trace, local)
    estimate = assemble(spec, settings, with_sequence_terms(spec, traced_settings(settings), step))
    rank = _RankLayout(spec, settings, step)
    timeline = build_timeline(trace.tracker, label or spec.name, samples, per_rank=rank)
    timeline.device_total_bytes = estimate.device_total_bytes
    timeline.layout = rank.description()
    if timeline.layout:
        timeline.label += f" (per rank: {timeline.layout})"
    return timeline


class _RankLayout:
    """What the estimator adds to a single-device candidate to get one rank's memory, applied to timeline samples."""

    def __init__(self, spec, settings: TrainSettings, step):
        self.spec, self.settings, self.step = spec, settings, step
        self.workspace = 0
        if settings.device == "cuda":
            from hf_memfit.estimator import cuda_overhead
            from hf_memfit.estimator.assemble import _gpu

            self.workspace = cuda_overhead.cublas_workspace_bytes(_gpu(settings))

    def __call__(self, samples: list[tuple[str, dict[str, int]]]) -> list[dict[str, int]]:
        """Shard (region, breakdown) samples with the estimator's own candidates beside them (for its maxima)."""
        from dataclasses import replace

        from hf_memfit.estimator.sharding import shard

        candidates = {f"estimate#{region}": dict(b) for region, b in self.step.candidates.items()}
        candidates.update({f"{i}#{region}": dict(b) for i, (region, b) in enumerate(samples)})
        rank = shard(replace(self.step, candidates=candidates), self.settings, self.spec.hidden_size)
        out = []
        for i, (region, _) in enumerate(samples):
            b = rank.candidates[f"{i}#{region}"]
            out.append({**b, "overhead": b["overhead"] + self.workspace})
        return out

    def description(self) -> str:
        s = self.settings
        parts = []
        if s.zero_stage:
            parts.append(f"ZeRO-{s.zero_stage} over {s.world_size} GPU{'s' if s.world_size > 1 else ''}")
            offload = [f"{what} to {where}" for what, where in (("optimizer", s.offload_optimizer),
                                                                  ("params", s.offload_param)) if where != "none"]
            parts += offload
        elif s.world_size > 1:
            parts.append(f"DDP over {s.world_size} GPUs, gradient buckets")
        if s.seq_shards > 1:
            parts.append(f"{'Ulysses SP' if s.sp_size > 1 else 'context parallel'} {s.seq_shards}: the traced step is "
                         f"{s.local_seq_len} tokens per row; the attention exchange buffers are in the estimate, "
                         "not drawn")
        if s.load_in_4bit:
            parts.append("4-bit base")
        if s.optim.startswith("paged_") and s.device == "cuda":
            parts.append("paged optimizer states on the host")
        return ", ".join(parts)


def build_timeline(tracker, label: str, samples: int = 1500, per_rank=None) -> Timeline:
    """Down-sample a trace to about `samples` points by category; `per_rank` maps samples to one rank's memory.

    Kept: the event with the most live bytes in every stretch of `stride` events
    (so short spikes survive), the peak of every phase and of every region (the
    estimator's candidates), each with the region it belongs to. `per_rank`
    (`_RankLayout`) then turns them into what one rank holds, and the peaks are
    taken after it.
    """
    end_clock = tracker.clock
    deltas = {c: [0] * (end_clock + 2) for c in CATEGORIES}
    for record in tracker.allocations:
        deltas[record.category][record.start] += record.nbytes
        if record.end is not None:
            deltas[record.category][record.end] -= record.nbytes
    starts = tracker.region_starts
    # The estimator's candidates: each region's peak, sharded as that region (one event can close one
    # region and open the next, so a clock may appear under two regions).
    wanted: dict[int, list[str]] = {}
    for name, (_, at) in tracker.region_peaks.items():
        wanted.setdefault(at, []).append(name)
    boundaries = [clock for clock, _ in tracker.markers]
    kept: dict[tuple[int, str], dict[str, int]] = {}
    running = dict.fromkeys(CATEGORIES, 0)
    stride = max(1, end_clock // samples)
    region, next_start = "build", 0
    best = (-1, 0, None, "")  # (total, clock, values, region) of the current stretch
    phase_best = (-1, 0, None, "")
    phase_index = 0
    for t in range(end_clock + 1):
        for c in CATEGORIES:
            running[c] += deltas[c][t]
        while next_start < len(starts) and starts[next_start][0] <= t:
            region = starts[next_start][1]
            next_start += 1
        total = sum(running.values())
        if total > best[0]:
            best = (total, t, dict(running), region)
        if total > phase_best[0]:
            phase_best = (total, t, dict(running), region)
        for name in wanted.get(t, ()):
            kept[(t, name)] = dict(running)
        if t % stride == stride - 1 or t == end_clock:
            kept.setdefault((best[1], best[3]), best[2])
            best = (-1, 0, None, "")
        while phase_index < len(boundaries) and boundaries[phase_index] <= t:
            kept.setdefault((phase_best[1], phase_best[3]), phase_best[2])  # the peak of the phase ending here
            phase_best = (total, t, dict(running), region)
            phase_index += 1
    kept.setdefault((phase_best[1], phase_best[3]), phase_best[2])
    keys = sorted(kept)
    clock = [t for t, _ in keys]
    values = [kept[key] for key in keys]
    if per_rank is not None:
        values = per_rank([(name, kept[(t, name)]) for t, name in keys])
    series = {c: [v[c] for v in values] for c in CATEGORIES}
    totals = [sum(v.values()) for v in values]
    peak = max(range(len(clock)), key=totals.__getitem__)
    phases = _phases(tracker, clock, totals)
    modules, groups = _top_modules(tracker, clock[peak])
    return Timeline(label, clock, series, phases, totals[peak], clock[peak], dict(values[peak]), modules, groups)


def _phases(tracker, clock: list[int], totals: list[int]) -> list[Phase]:
    """Every marked stretch of the trace ("step 2 forward", "step 2 backward", ...), with its peak among the samples.

    The samples hold each phase's own peak event, so for an unsharded step this is the phase's exact peak.
    """
    markers = tracker.markers
    phases = []
    for (start, name), (end, _) in zip(markers, markers[1:]):
        inside = [total for t, total in zip(clock, totals) if start <= t <= end]
        phases.append(Phase(name.replace("optimizer", "optimizer step"), start, end, max(inside, default=0)))
    return phases


_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")


def _top_modules(tracker, peak_clock: int, top: int = 10) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    at_peak: dict[str, int] = {}
    for record in tracker.allocations:
        if record.category == "activations" and record.start <= peak_clock \
                and (record.end is None or record.end > peak_clock):
            at_peak[record.module or "(outside modules: inputs, loss)"] = at_peak.get(record.module or "(outside modules: inputs, loss)", 0) + record.nbytes
    groups: dict[str, int] = {}
    for module, nbytes in at_peak.items():
        folded = _LAYER_INDEX.sub(".*", module)
        groups[folded] = groups.get(folded, 0) + nbytes
    ordered = sorted(at_peak.items(), key=lambda kv: -kv[1])[:top]
    return ordered, sorted(groups.items(), key=lambda kv: -kv[1])[:top]

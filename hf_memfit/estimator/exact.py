"""Exact mode: the training step traced at reduced depths (`trace.trace_step`) and each region extrapolated
linearly to the model's real depth; a model without repeated layers, or asked for it, at its full depth."""

from hf_memfit.estimator.breakdown import StepMemory
from hf_memfit.estimator.regions import by_class
from hf_memfit.estimator.trace import TraceResult, progress, trace_step
from hf_memfit.models.depths import config_with_depths, depth_plan, region_period
from hf_memfit.settings import TrainSettings


def exact_candidates(spec, settings: TrainSettings, *, extrapolate: bool = True) -> StepMemory:
    """Trace at small depths and extrapolate each region linearly to the model's real depth.

    A model whose forward has shapes that depend on the data (a mixture-of-experts layer that loops over the
    experts a batch hits) cannot run on fake tensors; that is reported in one line, not as a traceback.
    """
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        return _exact_candidates(spec, settings, extrapolate=extrapolate)
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        from hf_memfit.errors import CannotEstimate

        raise CannotEstimate(f"exact mode cannot trace model_type `{spec.model_type}`: its forward has shapes that "
                          f"depend on the data ({type(exc).__name__} in {exc.func if hasattr(exc, 'func') else exc}),"
                          " which fake tensors do not have; for mixture-of-experts models use transformers' "
                          "grouped_mm experts (its default where the model supports it)") from None


def _exact_candidates(spec, settings: TrainSettings, *, extrapolate: bool = True) -> StepMemory:
    plan = depth_plan(spec, extrapolate)
    real = plan.real
    if not plan.reduced:
        progress.info("exact mode: tracing %s at its full depth %s", spec.name, _depth_text(real))
        return full_depth_step_memory(trace_step(config_with_depths(spec, real), settings, real), settings,
                                      spec)

    period = region_period(spec)
    # The depths' traces are independent: side by side in forked children where CPUs are idle (`forked.py`), or
    # read from a child `speculate_deepest_trace` started before this was asked for.
    from hf_memfit.estimator.forked import forking_pays, run_side_by_side, speculated

    jobs = depth_trace_jobs(spec, settings, plan)
    keys = [depth_trace_key(job) for job in jobs]
    side_by_side = any(map(speculated, keys)) or forking_pays()
    if side_by_side:  # announced here: a forked child's progress would not reach the parent's stream
        for job in jobs:
            _announce(*job)
    traces = run_side_by_side(_depth_trace, [job + (not side_by_side,) for job in jobs], keys)
    base_classes = by_class(traces[0], period)  # the first and last period of each stack (`regions.py`)
    grown_classes = [by_class(t, period) for t in traces[1:]]
    candidates = {}
    for cls, (_, base_breakdown) in base_classes.items():
        extrapolated = dict(base_breakdown)
        for steps, classes in zip(plan.steps, grown_classes):
            if cls not in classes:
                continue
            grown_breakdown = classes[cls][1]
            for key in extrapolated:
                extrapolated[key] += steps * (grown_breakdown[key] - base_breakdown[key])
        candidates[cls] = non_negative_breakdown(extrapolated)
    result = _exact_result(candidates, traces[0], settings, spec)

    def grow(attr):  # parameter counts grow linearly with depth too
        base_value = getattr(traces[0], attr)
        # `steps` periods are added per axis; a depth that is not a whole number of periods (Gemma-3: 26
        # layers, period 6) adds a fraction of one, which is what it adds on average.
        return base_value + int(round(sum(steps * (getattr(t, attr) - base_value)
                                          for steps, t in zip(plan.steps, traces[1:]))))
    result.trainable_params = grow("trainable_params")
    result.total_params = grow("total_params")
    result.quantizable_linear_params = grow("quantizable_linear_params")
    result.host_bytes = grow("host_bytes")
    return result


def depth_trace_jobs(spec, settings: TrainSettings, plan=None) -> list[tuple]:
    """`_depth_trace`'s jobs (less `announce`) for exact mode's traces of these traced settings at reduced
    depths, the shallowest first."""
    plan = plan or depth_plan(spec, True)
    return [(spec, settings, depths, number, len(plan.depth_sets), plan.real)
            for number, depths in enumerate(plan.depth_sets, 1)]


def depth_trace_key(job: tuple) -> tuple:
    """What makes one `_depth_trace` job's result: the model, the traced settings and the depths."""
    spec, settings, depths = job[:3]
    return spec.name, spec.model_type, settings, depths


def speculate_deepest_trace(spec, traced: TrainSettings) -> bool:
    """Start, in a forked child, the deepest of the traces `exact_candidates(spec, traced)` will run, so that it
    reads that trace instead of running it (`forked.speculate`; `assemble.speculate_exact` makes `traced` as an
    estimate does). Whether one started: not where the model is traced at its full depth, or no CPU is idle.
    `forked.discard_speculations` ends it if nothing asks for it."""
    from hf_memfit.estimator.forked import speculate

    plan = depth_plan(spec, True)
    if not plan.reduced:
        return False
    deepest = depth_trace_jobs(spec, traced, plan)[-1]
    return speculate(_depth_trace, deepest + (False,), depth_trace_key(deepest))


def _announce(spec, settings, depths, number: int, count: int, real) -> None:
    progress.info("exact mode: tracing %s at depth %s (%d of %d), extrapolated to %s", spec.name,
                  _depth_text(depths), number, count, _depth_text(real))


def non_negative_breakdown(extrapolated: dict) -> dict:
    """An extrapolated region's categories as bytes, none negative, summing to the extrapolated total.

    Each depth's breakdown is read at its region's peak, and the peak can fall at another moment of the region at
    another depth. Whisper-large-v3's region after the decoder at batch 8 peaks on the loss's activations at
    depth 2+2 and on the autocast copies of the weights at 3+2 and 2+3: category by category, 30 layers' steps
    give weights +18.0 GiB and activations -9.7 GiB. Clamping the activations to zero alone made the region
    30.2 GiB, over the optimizer step's 28.7 GiB, and put exact mode 5% over fast mode and 3.4% over an H200's
    measured peak. The total is what the traces say grows linearly; a category that would go below zero is
    taken as zero and the others are scaled down to keep that total.
    """
    total = sum(extrapolated.values())
    positive = {k: v for k, v in extrapolated.items() if v > 0}
    if len(positive) == len(extrapolated):
        return {k: int(round(v)) for k, v in extrapolated.items()}
    scale = max(0.0, total) / sum(positive.values()) if positive else 0.0
    return {k: int(round(positive.get(k, 0.0) * scale)) for k in extrapolated}


def _depth_trace(spec, settings: TrainSettings, depths: tuple[int, ...], number: int, count: int,
                 real: tuple[int, ...], announce: bool = True) -> TraceResult:
    """One trace of `_exact_candidates`, without its per-allocation records (what extrapolation reads is small
    enough to send back from a forked child)."""
    if announce:
        _announce(spec, settings, depths, number, count, real)
    trace = trace_step(config_with_depths(spec, depths), settings, depths)
    trace.tracker = None
    return trace


def full_depth_step_memory(trace: TraceResult, settings: TrainSettings, spec=None) -> StepMemory:
    """Exact mode's candidates from a trace at the model's real depth (nothing to extrapolate)."""
    candidates = {r: b for r, (_, b) in by_class(trace).items()}  # every layer a class (`regions.py`)
    return _exact_result(candidates, trace, settings, spec)


def _exact_result(candidates, trace: TraceResult, settings: TrainSettings, spec=None) -> StepMemory:
    """The candidates with `trace`'s parameter facts (the shallowest trace's, where depths were extrapolated)."""
    step = StepMemory(candidates, trace.trainable_params, trace.total_params, trace.largest_param_numel,
                      trace.quantizable_linear_params, trace.largest_linear_numel, host_bytes=trace.host_bytes)
    moe = getattr(spec, "moe", None)
    if moe:
        from hf_memfit.models.generic import moe_note

        step.notes.append(moe_note(moe, settings))
    return step


def _depth_text(depths: tuple[int, ...]) -> str:
    return "+".join(map(str, depths))

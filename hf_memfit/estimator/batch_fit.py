"""Fast mode for image, audio, speech and vision-language steps: a line in the micro-batch, fitted to traces.

These steps have no free sequence length: their inputs are fixed by the settings (an image size, an audio
window, the text and image tokens of a VLM row), so `parametric.py`'s polynomial in (batch, seq) has
nothing to vary. At a fixed input shape every live byte is a model state (independent of the batch) or
belongs to one row (pixels, patches, frames, tokens and their activations), so region by region and
category by category the bytes are

    c0 + c1*b,

from batch 2 on: at batch 1 a gradient that needs no reduction over the rows can change category (`_fit_lines`),
so batch 1 keeps candidates of its own.

The reduced-depth copies exact mode traces are stepped at batch 1 and at batch 2 with two micro-batches (the
line, and a later micro-batch's constant offset, as in parametric.py), and the base depth also at batch 3 (the
first micro-batch's line from batch 2 on goes through 2 and 3 there; the totals' line through 1 and 2 is checked
at 3, a check of the first micro-batch and the optimizer step, whose miss goes in the notes). A step's first
micro-batch is the same whether more follow it (byte for byte on ViT, Whisper, wav2vec2, LLaVA and Qwen2.5-VL,
with and without checkpointing), so batch 2 is traced once for both: four forward and backward passes at the
base depth and three at the others (the warm-up is the optimizer step alone, `warm_up.py`), where a step of its
own at batch 2, a check at every depth and a warm-up pass made seven. The coefficients are extrapolated to the
real depth as exact mode extrapolates its bytes, and the optimizer is moved by formula as in parametric.py. One
calibration per input shape, precision and lever serves every micro-batch and accumulation the planner searches.
"""

from __future__ import annotations

import time

from hf_memfit.cache import cache_dir, config_key, read_cache, write_cache
from hf_memfit.estimator.breakdown import CATEGORIES, StepMemory
from hf_memfit.estimator.parametric import (_FACTS, _LAYOUT_FIELDS, _OPTIMIZER_FIELDS, _extrapolate,
                                            _move_optimizer, _optimizer_formula_exact, _optimizer_of, _swappable)
from hf_memfit.estimator.parametric_fit import later_micro_batch
from hf_memfit.estimator.pinned_host import fit_offloaded_tensors, offloaded_bytes

BATCH_FIT_VERSION = 8
CACHE_KIND = "batch-fit"
#: (batch, seq placeholder, micro-batches): the line's first point; its second with a later micro-batch; the check.
POINTS = ((1, 0, 1), (2, 0, 2), (3, 0, 1))
CHECK_TOLERANCE = 0.01


def _key(spec, settings, by_optimizer: bool) -> str:
    key = {k: v for k, v in settings.to_dict().items()
           if k not in _LAYOUT_FIELDS + ("gradient_accumulation_steps",)}
    if _swappable(settings) and not by_optimizer:
        for name in _OPTIMIZER_FIELDS:
            key.pop(name)
    key["batch_fit"] = BATCH_FIT_VERSION
    return config_key(spec.config, key)


# Fits already read in this process, by cache key: the planner evaluates one fit for dozens of candidates.
_fits: dict[str, dict] = {}


def _read(key: str) -> dict | None:
    if key not in _fits:
        fit = read_cache(CACHE_KIND, key)
        if not isinstance(fit, dict) or fit.get("version") != BATCH_FIT_VERSION:
            return None
        _fits[key] = fit
    return _fits[key]


def batch_fit_step_memory(spec, settings) -> StepMemory:
    """Single-device peak candidates for `settings`, from a cached line in the micro-batch (fitted now if missing)."""
    key = _key(spec, settings, by_optimizer=False)
    fit = _read(key)
    if fit is not None and _optimizer_of(settings) != fit["optimizer"] and not fit["optimizer_formula_exact"]:
        key = _key(spec, settings, by_optimizer=True)  # the formula missed the traced optimizer: its own fit
        fit = _read(key)
    paid = None
    if fit is None:
        from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

        from hf_memfit.errors import CannotEstimate

        started = time.perf_counter()
        try:
            fit = calibrate(spec, settings)
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            raise CannotEstimate(f"`{spec.name}` cannot be traced for {settings.task}: its step has shapes or "
                                 f"branches that depend on the data ({type(exc).__name__}), which fake tensors do "
                                 "not have") from None
        paid = time.perf_counter() - started
        write_cache(CACHE_KIND, key, fit)
        _fits[key] = fit
    step = evaluate(fit, settings)
    text = (f"fast mode for {settings.task} inputs: a line in the micro-batch fitted to {fit['traces']} traces "
            f"(depth {fit['depths']}) at batch 1, 2 and 3, checked at batch 3 at depth {fit['depths'].split(',')[0]} "
            f"({100 * fit['check_miss']:.2f}% off)")
    text += f"; this first call paid {paid:.1f} s for it" if paid is not None else ""
    step.notes.append(text + f", cached in {cache_dir() / CACHE_KIND}")
    return step


def evaluate(fit: dict, settings) -> StepMemory:
    b = settings.batch_size
    accumulating = settings.gradient_accumulation_steps > 1
    candidates = {}
    for region, clocks in fit["batch_1" if b == 1 else "candidates"].items():
        if region.startswith("1.1|") and not accumulating:
            continue
        if region == "1.0|opt" and accumulating:
            region = "1.1|opt"
        at = [{k: max(0, int(round(c0 + c1 * b))) for k, (c0, c1) in clock.items()} for clock in clocks]
        candidates[region] = max(at, key=lambda values: sum(values.values()))
    if _optimizer_of(settings) != fit["optimizer"]:
        _move_optimizer(candidates, fit, settings)
    step = StepMemory(candidates, **fit["facts"])
    if fit["host_tensors"] is not None:
        step.host_bytes = offloaded_bytes(fit["host_tensors"], lambda c: int(round(c[0] + c[1] * b)))
    elif fit["host"]:
        step.host_bytes = max(0, int(round(fit["host"][0] + fit["host"][1] * b)))
    if fit["check_miss"] > CHECK_TOLERANCE:
        step.notes.append(f"batch fit: at its check point it missed the trace by {100 * fit['check_miss']:.1f}% of "
                          f"the peak (region {fit['check_region']}); `--mode exact` traces these settings")
    return step


def fit_group(spec, settings) -> str:
    """A label that the settings reading one line share: its first cache key (as `batch_fit_step_memory` reads it)."""
    return _key(spec, settings, by_optimizer=False)


def prepare_batch_fits(spec, many) -> int:
    """Make the lines that the settings in `many` will read and that are not cached, their traces side by
    side (`forked.run_jobs`): the planner's grid asks for one per precision and lever. Returns how many.
    A model that cannot be traced is left to the estimate that reports it."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    missing = {}
    for settings in many:
        key = _key(spec, settings, by_optimizer=False)
        if key not in missing and _read(key) is None:
            missing[key] = settings
    if not missing:
        return 0
    try:
        fits = calibrate_many(spec, list(missing.values()))
    except (DataDependentOutputException, DynamicOutputShapeException):
        return 0
    for key, fit in zip(missing, fits):
        write_cache(CACHE_KIND, key, fit)
        _fits[key] = fit
    return len(fits)


def calibrate(spec, settings) -> dict:
    """Trace the reduced-depth copies at the points and fit every region's clocks as lines in the batch."""
    return calibrate_many(spec, [settings])[0]


def calibrate_many(spec, many: list) -> list[dict]:
    """`calibrate` for each settings, every depth's trace of every one side by side (`forked.run_jobs`)."""
    from hf_memfit.estimator.forked import run_jobs
    from hf_memfit.estimator.parametric import _import_for_traces, _trace_summary
    from hf_memfit.models.depths import depth_plan

    plan = depth_plan(spec)  # the model's, whatever the settings
    apart = check_apart(len(plan.depth_sets))
    jobs = []
    for settings in many:
        micro = 1 if settings.optimizer.layerwise else 2  # layerwise optimizers step inside backward: no accumulation
        points = tuple((b, settings.seq_len, min(m, micro)) for b, _, m in POINTS)
        traced = settings.replace(mode="exact", batch_size=1, gradient_accumulation_steps=micro)
        # The check point at the base depth only: it has every kind of layer, and a grown depth adds one more of a
        # kind it has (one pass fewer). parametric.py checks the same way (`_calibration_plan`).
        jobs += [(spec, traced, depths, points if i == 0 and not apart else points[:2])
                 for i, depths in enumerate(plan.depth_sets)]
        if apart:  # the check point's step in a build of its own (`check_apart`)
            jobs.append((spec, traced, plan.depth_sets[0], points[2:]))
    _import_for_traces(many)
    summaries = run_jobs(_trace_summary, jobs)
    count = len(plan.depth_sets) + apart
    fits = []
    for settings, at in zip(many, range(0, len(jobs), count)):
        traced_depths = summaries[at:at + count]
        if apart:  # the base depth's summary, its check point's step after its own two
            base, check = traced_depths[0], traced_depths[-1]
            traced_depths = [dict(base, series=base["series"] + check["series"],
                                  host_peaks=base["host_peaks"] + check["host_peaks"][1:],
                                  host_held=base["host_held"] + check["host_held"][1:])] + traced_depths[1:-1]
        fits.append(_fit(settings, plan, traced_depths))
    return fits


def check_apart(depth_sets: int) -> bool:
    """Whether the base depth's check point is traced in a build of its own, a fit's jobs then one more than its
    depth sets: where that makes whole rounds on the CPUs that trace them (1 or 3 depth sets on 2 CPUs). Inside the
    base trace, the check point's step makes that trace the longest, and the last round waits for it while a CPU
    is idle. The step is the same in its own build: each traced step starts from the warm-up's state (`trace.py`)."""
    from hf_memfit.estimator.forked import slots

    cpus = slots()
    return cpus > 1 and depth_sets % cpus != 0 and (depth_sets + 1) % cpus == 0


def _fit(settings, plan, summaries: list[dict]) -> dict:
    """The calibration from its traced depths' summaries (`parametric._trace_summary`)."""
    depth_sets, steps = plan.depth_sets, plan.steps
    series = [t["series"] for t in summaries]
    fitted = [_fit_lines(s) for s in series]
    # Batches of 2 or more: the base depth's line through batches 2 and 3, where batch 1 is a regime of its own
    # (`_fit_lines`); the depths' differences (a layer's bytes, `steps`) are read from the lines of batches 1 and 2.
    base = _fit_lines(series[0], at=(2, 3)) if len(series[0]) > 2 else {}
    candidates, batch_1 = {}, {}
    for region in set.intersection(*(set(f) for f in fitted)):
        per_depth = [f[region] for f in fitted]
        base_line, base_at = (base[region], (2, 3)) if region in base else (per_depth[0], (1, 2))
        if len({p.shape for p in per_depth}) > 1:  # clocks not aligned across depths: by the maxima
            per_depth = [_maxima(p) for p in per_depth]
            base_line = _maxima(base_line, at=base_at)
        # What the grown depths add: the bytes of the layers the real depth has more of. Its lines have batch 2's
        # clocks, or one clock where batch 1's differ (SigLIP's pooling head runs other ops at batch 1), and so has
        # the base line: one clock's layers broadcast over the base's clocks, which they are all live beside (the
        # maxima there put SigLIP's fast mode 0.7% under exact at batch 64).
        layers = sum(step * (grown - per_depth[0]) for step, grown in zip(steps, per_depth[1:]))
        candidates[region] = _prune(base_line + layers)
        batch_1[region] = _prune(per_depth[0] + layers, batches=(1,))
    check_miss, check_region = _check(series, fitted)
    host = host_tensors = None
    if any(any(t["host_peaks"]) for t in summaries):  # offloaded activations: each tensor's size on a line
        import numpy as np

        host_tensors = fit_offloaded_tensors([t["host_held"][1:3] for t in summaries], steps,
                                             lambda sizes: [2 * sizes[0] - sizes[1], sizes[1] - sizes[0]])
        if host_tensors is None:  # the points do not offload the same tensors: their sums, on a line
            lines = [np.array([2 * t["host_peaks"][1] - t["host_peaks"][2], t["host_peaks"][2] - t["host_peaks"][1]],
                              dtype=float) for t in summaries]
            host = [float(c) for c in _extrapolate(lines, steps)]
    facts = {k: int(round(_extrapolate([t["facts"][k] for t in summaries], steps))) for k in _FACTS}
    facts["largest_param_numel"] = summaries[0]["facts"]["largest_param_numel"]
    facts["largest_linear_numel"] = summaries[0]["facts"]["largest_linear_numel"]
    tensors = {"lists": [t["trainable_tensors"] for t in summaries], "steps": steps}
    return {"version": BATCH_FIT_VERSION, "depths": ", ".join("+".join(map(str, d)) for d in depth_sets),
            "traces": len(summaries), "candidates": candidates, "batch_1": batch_1, "host": host,
            "host_tensors": host_tensors,
            "facts": facts,
            "optimizer": _optimizer_of(settings), "tensors": tensors, "check_miss": check_miss,
            "check_region": check_region,
            "optimizer_formula_exact": _optimizer_formula_exact(series, tensors, settings)}


def _fit_lines(points: list[dict], at: tuple[int, int] = (1, 2)) -> dict:
    """Region class -> array (2, clocks, categories): intercept and slope in the batch, clock by clock, through
    the points at the batches `at` (`POINTS`: 1, 2 and, at the base depth, 3).

    Batch 1 can be a regime of its own, where a step's total is on the line and its split is not: autograd hands a
    gradient that needs no reduction over the batch to the parameter as its `.grad` (ViT's `position_embeddings`,
    [1, patches, hidden], added to every row), so at batch 1 a hidden state's bytes are a gradient, and from batch
    2 on a temporary reduced into a new one. A line through batches 1 and 2 then runs the gradients down and the
    temporaries up, and a category cut at zero over-counts: a tiny ViT's fast mode read +1.2% at batch 8, ViT-B/16
    +0.6% at 64. The first micro-batch's fwd / bwd regions are the same steps at every batch (2 ran two micro-batches,
    3 one), so those lines can go through 2 and 3; the optimizer step's and later micro-batches' stay on 1 and 2.
    """
    import numpy as np

    first, second = (points[b - 1] for b in at)
    later = points[1]  # batch 2 ran two micro-batches: the first one's regions are the line's, the second's are later
    out = {}
    for region in set(first) & set(second):
        if at != (1, 2) and not (region.startswith("1.0|") and region != "1.0|opt"):
            continue
        a, c = first[region], second[region]
        if a.shape != c.shape:
            a, c = _top(a)[None], _top(c)[None]
        slope = (c - a) / (at[1] - at[0])
        out[region] = np.stack([a - at[0] * slope, slope])
    for region, values in later.items():  # a later micro-batch: the first one's line plus what is live beside it
        first_region = "1.0|" + region[4:]
        if region.startswith("1.1|") and first_region in out:
            out[region] = later_micro_batch(out[first_region], values, later.get(first_region),
                                            lambda line: line[0] + 2 * line[1])
    return out


def _top(values):
    """The clock (row) of a region with the most live bytes."""
    return values[values.sum(axis=1).argmax()]


def _maxima(line, at: tuple[int, int] = (1, 2)):
    """A clock-by-clock line refitted through its maxima at the batches `at` (one clock)."""
    import numpy as np

    first, second = (_top(line[0] + b * line[1]) for b in at)
    slope = (second - first) / (at[1] - at[0])
    return np.stack([first - at[0] * slope, slope])[:, None, :]


def _prune(line, batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)) -> list[dict]:
    """The clocks that are the region's maximum at one of `batches` (micro-batches), as {category: [c0, c1]}."""
    import numpy as np

    totals = line.sum(axis=2)  # (2, clocks)
    keep = sorted({int(np.argmax(totals[0] + b * totals[1])) for b in batches})
    return [{k: [float(line[0, clock, i]), float(line[1, clock, i])] for i, k in enumerate(CATEGORIES)}
            for clock in keep]


def _check(series, fitted) -> tuple[float, str]:
    worst, where = 0.0, ""
    for points, fit in zip(series, fitted):
        if len(points) < 3:  # a grown depth: no check point
            continue
        seen = points[2]
        peak = max(float(v.sum(axis=1).max()) for v in seen.values())
        for region, values in seen.items():
            if region not in fit:
                continue
            predicted = float((fit[region][0] + 3 * fit[region][1]).sum(axis=1).max())
            miss = abs(predicted - float(values.sum(axis=1).max())) / max(peak, 1.0)
            if miss > worst:
                worst, where = miss, region
    return worst, where

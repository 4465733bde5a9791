"""Fast mode for families without hand-written formulas: a parametric step fitted to a few traces.

Every live byte of a training step is a model state (weights, gradients,
optimizer states: independent of the data), a per-sequence tensor shared by
the batch (rotary tables: `s`; a mask shared by the rows: `s^2`), a per-row
tensor, a per-token tensor (hidden states, the logits and the loss: `b*s`)
or a per-score tensor (eager attention probabilities, padded masks:
`b*s^2`). So while the same tensors are live, the bytes of a region of the
step, category by category, are

    c0 + c1*s + c2*s^2 + c3*b*s + c4*b*s^2.

Per-row tensors (a classifier's pooled output and logits, `b`) are left out:
they are a row's hidden size at most, against a row's thousands of tokens.

The reduced-depth copy exact mode traces (2p and 3p layers) is built once
per depth and stepped at the `len(TERMS)` (batch, seq) points that determine
the coefficients; the base depth also at a check point, whose miss is reported
in the notes, not hidden (a grown depth runs the same ops and one more layer's:
`_calibration_plan`). The coefficients are then extrapolated to the real depth
region by region, as exact mode extrapolates its bytes. One
calibration thus serves every micro-batch and sequence length.

Gradient accumulation: a later micro-batch runs the same forward and
backward with every gradient already live, so its regions are the first
micro-batch's plus bytes that do not depend on the shape. The last fit point
and the check point run two micro-batches; the first gives that offset, the
check tests it. One calibration serves steps with and without accumulation.

A region's maximum is a maximum of such polynomials (which tensors are live
at its peak can change with the shape), so the fit is exact where one set of
tensors dominates the points; the points are taken long (`_points`) so that
the one that dominates long sequences is the one fitted, and the check point
says when that did not hold.

The optimizer is moved by formula: the states and the step's temporaries of
the traced optimizer and of the asked one are computed by `optimizers.py`
(the one optimizer model, as hand-written fast mode uses it) over the traced
trainable tensors, and the difference is added. This is exact where those
formulas are (they are checked against the trace at calibration; a miss keys
the calibration by optimizer instead). GaLore / APOLLO (their projections run
in the backward, layerwise ones step inside it) are always keyed by optimizer.

What a fit is keyed by is what changes the traced step: the config and the
settings that change the model or its step (checkpointing, offload, LoRA,
4-bit, task, trainer), and of the GPU only whether it is sm80+ (`_gpu_key`).
bf16-mixed and fp16-mixed share a fit where their steps agree: a mixed
calibration traces its check point at the other autocast dtype (same build),
and serves both when the fit predicts that too (`precisions`); otherwise it
is calibrated again with its own check and serves its own precision only.

Calibration traces run side by side (`forked.py`, one per CPU): the two
depths of one calibration, and, through `prepare_fits`, every calibration a
planner's grid will read (checkpointing on and off, offloaded checkpoints).

Imports no torch unless it calibrates.
"""

from __future__ import annotations

import functools
import math
import time

from hf_memfit.cache import cache_dir, config_key, read_cache, write_cache
from hf_memfit.estimator.breakdown import CATEGORIES, StepMemory
from hf_memfit.estimator.parametric_fit import (
    TERMS,
    TERMS_IN_SEQ,
    _as_maxima,
    _batch_regimes_differ,
    _check,
    _fit_depth,
    _point_series,
    _prune,
    _solve_all,
    _value,
)
from hf_memfit.estimator.pinned_host import fit_offloaded_tensors, offloaded_bytes
from hf_memfit.estimator.traced_shapes import TracedShapes
from hf_memfit.models.generic import moe_note

#: Bumped whenever what a cached fit means changes (part of the cache key, beside generic.CACHE_VERSION).
PARAMETRIC_VERSION = 7
CACHE_KIND = "parametric"

#: The shortest sequence the fit is traced at, for models with room for it. Long enough that per-token
#: tensors (KiB per token) outweigh a layer's gradients and the step's fixed temporaries (MiB), so the
#: tensors that are live at a region's maximum are those that are live at long sequences; fake tensors cost
#: the same at any length. Every traced length is a multiple of 128 (`_round_to`): the flash kernels' 128-row
#: padding then adds nothing, and a per-token tensor of 4 bytes or more per token is a whole number of CUDA's
#: 512-byte blocks, so the allocator's rounding adds nothing that is not a polynomial in b and s.
BASE_SEQ = 2048

# The relative miss at the check point above which the fit is reported as approximate.
CHECK_TOLERANCE = 0.01

# The other 16-bit autocast dtype: a mixed-precision fit is checked at it, and serves both where they agree.
_SIBLING_PRECISION = {"bf16-mixed": "fp16-mixed", "fp16-mixed": "bf16-mixed"}

# Settings that do not change the single-device step (sharding.shard and the planner apply them afterwards).
# FSDP's step is the configured autocast step (`assemble.traced_settings`), laid out by `sharding._fsdp`: no trace
# reads the FSDP fields, and the 4-bit preparation they decide is resolved into the key first. Jamba's plan on
# 8 GPUs traced six FSDP fits that were the plain mixed-precision ones again.
_LAYOUT_FIELDS = ("batch_size", "mode", "num_gpus", "num_nodes", "zero_stage", "offload_optimizer", "offload_param",
                  "fsdp", "fsdp_version", "fsdp_offload",
                  "expandable_segments", "gpu")  # the GPU: by what the step reads of it (`_gpu_key`)
# What the fit serves without a new calibration.
_FITTED_FIELDS = ("seq_len", "gradient_accumulation_steps")
_OPTIMIZER_FIELDS = ("optim", "optim_args")

_FACTS = ("trainable_params", "total_params", "largest_param_numel", "quantizable_linear_params",
          "largest_linear_numel")


# --- keys ------------------------------------------------------------------------------------------------

def _swappable(settings) -> bool:
    """Whether the optimizer can be moved by formula (not GaLore / APOLLO, whose projection runs in backward)."""
    return not settings.optimizer.low_rank


def _points(spec, settings, batches: str = "") -> tuple[tuple[int, int, int], ...]:
    """The (batch, seq, micro-batches) points: three lengths at batch 1, the shortest and the longest at
    batch 2 (which determine the b*s and b*s^2 terms), then a check point beyond both batches.

    `batches` fits one batch regime alone, for a step whose ops differ between batch 1 and larger batches
    (`parametric_fit._batch_regimes_differ`: Jamba's mixer projects a transposed activation, and `F.linear`'s
    reshape of it is a view at batch 1 and a copy from batch 2 on, as on a GPU): "1" is three lengths and
    a check at batch 1 (a polynomial in s: `TERMS_IN_SEQ`), "2+" three lengths at batch 2 and two at batch 4.
    A fit by regime is made after the whole fit missed its check (`calibrate_many`), so "2+" is laid out to
    read what that fit traced (`traced_shapes.py`): its first batch-2 shape, its two micro-batches at batch 2
    as the last fit point, and its check point, where a layout of its own at batches 2, 4 and 8 traced five
    shapes and seven micro-batches afresh (three and three now).

    The lengths stay within `max_position_embeddings` (learned positions index a table) and on the
    side of the sliding window the asked length is on: below it transformers skips the sliding mask,
    above it builds one, and the two sides are different polynomials. They are multiples of the chunk a
    state-space scan tiles the sequence by (`ssm.sequence_chunk`: ceil(s / chunk) is polynomial only there;
    Jamba's kernel-path fit missed its check point by 1.3% at lengths between them).
    """
    from hf_memfit.models.ssm import sequence_chunk

    step = math.lcm(_STEP, sequence_chunk(spec.ssm_mixers, settings))
    _round = functools.partial(_round_to, step=step)
    shortest = _round(BASE_SEQ, up=True)
    limit = spec.max_position_embeddings or 0
    window = spec.sliding_window or 0
    if window and settings.seq_len <= window:  # strictly inside: whether the window's own length masks is not ours to guess
        limit = min(limit, window - 1) if limit else window - 1
    elif window and (not limit or limit > window):
        shortest = max(shortest, _round(window + 1, up=True))
    longest = 4 * shortest
    if limit and longest > limit:  # as long as the model takes
        longest = _round(limit) or limit
        beyond = window and settings.seq_len > window
        if not beyond or shortest >= longest:  # no window to stay above (or no room above it): a 4x range
            shortest = _round(longest // 4) or max(longest // 4, 1)
    middle = _round((shortest + longest) // 2) or (shortest + longest) // 2
    check = _round((middle + longest) // 2) or (middle + longest) // 2
    micro = 1 if settings.optimizer.layerwise else 2  # layerwise optimizers step inside backward: no accumulation
    if batches == "1":
        return (1, shortest, 1), (1, middle, 1), (1, longest, micro), (1, check, micro)
    whole = (1, shortest, 1), (1, middle, 1), (1, longest, 1), (2, shortest, 1), (2, longest, micro), (4, check, micro)
    if batches == "2+":  # the whole fit's batch-2 shapes and check point, and three of its own
        return whole[3], (2, middle, 1), (4, shortest, 1), (4, longest, 1), whole[4], whole[5]
    return whole


_STEP = 128  # every traced length is a multiple of it (see BASE_SEQ)


def _round_to(seq: int, up: bool = False, step: int = _STEP) -> int:
    """A multiple of `step`: the nearest below, or above with `up`; 0 when there is none below."""
    return -(-seq // step) * step if up else seq // step * step


def _regime(spec, settings) -> str:
    """Which side of the sliding window the asked length is on (one calibration per side)."""
    window = spec.sliding_window
    return "" if not window else ("within-window" if settings.seq_len <= window else "beyond-window")


def _settings_key(spec, settings, by_optimizer: bool, by_precision: bool = False) -> dict:
    key = {k: v for k, v in settings.to_dict().items() if k not in _LAYOUT_FIELDS + _FITTED_FIELDS}
    if _swappable(settings) and not by_optimizer:
        for name in _OPTIMIZER_FIELDS:
            key.pop(name)
    elif settings.optimizer_family == "adam8bit":
        key["optim"] = "adam8bit"  # one traced state layout for every bitsandbytes 8-bit AdamW; paging is applied later
    if not by_precision and _sibling(settings):
        key["precision"] = "16-bit mixed"  # one fit for both autocast dtypes where its check shows they agree
    key["gpu"] = _gpu_key(settings)
    key["ssm_kernels"] = settings.ssm_path if spec.ssm_mixers else None  # models/ssm.py: the path the trace ran
    key["regime"] = _regime(spec, settings)
    key["parametric"] = PARAMETRIC_VERSION
    return key


def _sibling(settings) -> str | None:
    """The other 16-bit autocast dtype, where the two can share a fit: the same build, another autocast.

    Not with 4-bit weights: their base is built in the compute dtype (`step._build_model`), so the
    two precisions build different models. Elsewhere the check point says whether the steps agree.
    """
    return None if settings.load_in_kbit else _SIBLING_PRECISION.get(settings.precision)


def _gpu_key(settings):
    """What the traced step reads of the GPU: only whether it is sm80+ (SDPA's flash backend, Liger's in-place
    accumulation: `trace._flash_supported`, `step_levers.liger_in_place_accumulation`), which is
    `supports_flash_attention` in the GPU table. No GPU named: a current one, as the trace assumes."""
    if settings.device != "cuda":
        return None
    if settings.gpu is None:
        return True
    from hf_memfit.hardware import find_gpu

    return find_gpu(settings.gpu).supports_flash_attention


def _lookup(spec, settings) -> tuple[str, dict | None, bool]:
    """The cache key a fit for `settings` is under, the fit if cached, and whether a new one may be shared.

    First the shared key (both 16-bit autocast dtypes, any optimizer moved by formula); then, where the
    fit under it does not serve these settings, the key of their own precision and / or optimizer.
    """
    by_precision = by_optimizer = False
    while True:
        key = config_key(spec.config, _settings_key(spec, settings, by_optimizer, by_precision))
        fit = _read(key)
        if fit is None:
            return key, None, not (by_precision or by_optimizer)
        if settings.precision not in fit["precisions"] and not by_precision:
            by_precision = True
        elif _optimizer_of(settings) != fit["optimizer"] and not fit["optimizer_formula_exact"] and not by_optimizer:
            by_optimizer = True  # the formula missed the traced optimizer: a different one is calibrated on its own
        else:
            return key, fit, False


def fit_group(spec, settings) -> str:
    """A label that the settings reading one fit share: its first cache key (`_lookup` may go on to a key of their
    own precision or optimizer once that fit is read, which only splits a group)."""
    return config_key(spec.config, _settings_key(spec, settings, by_optimizer=False))


def prepare_fits(spec, many) -> int:
    """Make the fits that the settings in `many` will read and that are not cached, side by side.

    For a caller that knows what it will ask (the planner's grid): their traces then share the CPUs
    (`forked.run_jobs`) instead of running one calibration after another. Returns how many were made.
    """
    missing = {}
    for settings in many:
        key, fit, shared = _lookup(spec, settings)
        if fit is None and key not in missing:
            missing[key] = (settings, shared)
    if not missing:
        return 0
    fits = calibrate_many(spec, [s for s, _ in missing.values()], [shared for _, shared in missing.values()])
    for key, fit in zip(missing, fits):
        write_cache(CACHE_KIND, key, fit)
    return len(fits)


# --- evaluation ----------------------------------------------------------------------------------------

def parametric_step_memory(spec, settings) -> StepMemory:
    """Single-device peak candidates for `settings`, from a cached parametric fit (made now if missing)."""
    key, fit, shared = _lookup(spec, settings)
    paid = None
    if fit is None:
        started = time.perf_counter()
        fit = calibrate_many(spec, [settings], [shared])[0]
        paid = time.perf_counter() - started
        write_cache(CACHE_KIND, key, fit)
    by_regime = "batch_1" in fit
    fit = _for_batch(fit, settings)
    if fit["check_miss"] > CHECK_TOLERANCE:
        return _traced_instead(spec, settings, fit)
    step = evaluate(fit, settings)
    if spec.moe:
        step.notes.append(moe_note(spec.moe, settings))
    points = ", ".join(f"{b}x{s}" for b, s, _ in fit["points"])
    if spec.hand_written:
        from hf_memfit.estimator.fast_params import formulas_miss

        why = formulas_miss(settings)
    else:
        why = "no hand-written formulas"
    text = (f"fast mode for model type `{spec.model_type}` ({why}): parametric fit from "
            f"{fit['traces']} traces (depth {fit['depths']}), each stepped at batch x seq {points} (the last, "
            "at the first depth only, checks the fit)")
    if by_regime:
        text += "; batch 1 and larger batches are fitted apart (the step runs other ops at batch 1)"
    if paid is not None:
        text += f"; this first call paid {paid:.1f} s for it, cached in {cache_dir() / CACHE_KIND}"
    else:
        text += f" (cached in {cache_dir() / CACHE_KIND})"
    step.notes.append(text)
    return step


def _traced_instead(spec, settings, fit: dict) -> StepMemory:
    """Exact mode at the asked settings (cached per shape), for settings whose fit missed its check point.

    Some steps are not polynomials in b and s (TRL's fused LM head works in fixed-size chunks of the
    tokens); their fit misses the held-out point by more than `CHECK_TOLERANCE`, and a fit that is known
    to be off is not used: these settings are traced as they are, and the notes say why.
    """
    from hf_memfit.estimator.breakdown import StepMemory as Step

    key = config_key(spec.config, _settings_key(spec, settings, by_optimizer=True, by_precision=True),
                     [settings.batch_size, settings.seq_len, min(settings.gradient_accumulation_steps, 2)])
    cached = read_cache(CACHE_KIND + "-traced", key)
    paid = None
    if not isinstance(cached, dict) or "candidates" not in cached:
        from hf_memfit.estimator.exact import exact_candidates

        started = time.perf_counter()
        traced = exact_candidates(spec, settings.replace(mode="exact"))
        paid = time.perf_counter() - started
        cached = {"candidates": traced.candidates, "host_bytes": traced.host_bytes,
                  "facts": {k: getattr(traced, k) for k in _FACTS}}
        write_cache(CACHE_KIND + "-traced", key, cached)
    step = Step(cached["candidates"], **cached["facts"], host_bytes=cached["host_bytes"])
    if spec.moe:
        step.notes.append(moe_note(spec.moe, settings))
    step.notes.append(f"fast mode for model type `{spec.model_type}`: the parametric fit of these settings missed "
                      f"its check point by {100 * fit['check_miss']:.1f}% of the peak (region {fit['check_region']}), "
                      "so this shape was traced in exact mode instead"
                      + (f" ({paid:.1f} s, cached)" if paid is not None else " (cached)"))
    return step


# Fits already parsed in this process, by file and its (mtime, size): the planner evaluates one fit for
# dozens of candidates; a stat is all a repeat costs, and a file replaced or damaged since is read again.
_read_fits: dict[tuple, dict] = {}


def _file_id(key: str) -> tuple | None:
    path = cache_dir() / CACHE_KIND / f"{key}.json"
    try:
        stat = path.stat()
    except OSError:
        return None
    return str(path), stat.st_mtime_ns, stat.st_size


def _read(key: str) -> dict | None:
    """A cached fit, or None when missing, unreadable or not one of ours (then it is made afresh)."""
    memo = _file_id(key)
    if memo is None:
        return None
    if memo in _read_fits:
        return _read_fits[memo]
    fit = read_cache(CACHE_KIND, key)
    needed = ("version", "points", "precisions", "candidates", "facts", "optimizer", "optimizer_formula_exact", "tensors",
              "host", "host_tensors", "check_miss", "check_region", "traces", "depths")
    if not isinstance(fit, dict) or fit.get("version") != PARAMETRIC_VERSION or any(k not in fit for k in needed):
        return None
    _read_fits[memo] = fit
    return fit


def _optimizer_of(settings) -> list:
    return [settings.optim, settings.optim_args]


def evaluate(fit: dict, settings) -> StepMemory:
    """The fitted candidates at the settings' micro-batch and sequence length, with their optimizer."""
    fit = _for_batch(fit, settings)
    b, s = settings.batch_size, settings.seq_len
    accumulating = settings.gradient_accumulation_steps > 1
    candidates = {}
    for region, clocks in fit["candidates"].items():
        if region.startswith("1.1|") and not accumulating:
            continue  # a later micro-batch, which a step without accumulation does not run
        if region == "1.0|opt" and accumulating:
            region = "1.1|opt"  # as exact mode names it: the step after the last micro-batch
        at_clocks = [{k: _value(c, b, s) for k, c in by_category.items()} for by_category in clocks]
        candidates[region] = max(at_clocks, key=lambda values: sum(values.values()))
    if _optimizer_of(settings) != fit["optimizer"]:
        _move_optimizer(candidates, fit, settings)
    step = StepMemory(candidates, **fit["facts"])
    if fit["host_tensors"] is not None:
        step.host_bytes = offloaded_bytes(fit["host_tensors"], lambda c: _value(c, b, s))
    elif fit["host"]:
        step.host_bytes = _value(fit["host"], b, s)
    if fit["check_miss"] > CHECK_TOLERANCE:
        step.notes.append(f"parametric fit: at its check point it missed the trace by {100 * fit['check_miss']:.1f}% "
                          f"of the peak (region {fit['check_region']}); the estimate is approximate (`--mode exact` "
                          "traces these settings)")
    return step


def _move_optimizer(candidates: dict, fit: dict, settings) -> None:
    """Replace the traced optimizer's states and step temporaries by the asked one's, by formula."""
    traced_optim, traced_args = fit["optimizer"]
    states_was, temps_was = _optimizer_bytes(fit["tensors"], traced_optim, traced_args, settings.device)
    states, temps = _optimizer_bytes(fit["tensors"], settings.optim, settings.optim_args, settings.device)
    for region, values in candidates.items():
        if region == "build":
            continue
        values["optimizer"] = max(0, values.get("optimizer", 0) + states - states_was)
        if region.endswith("|opt"):
            values["temporary"] = max(0, values.get("temporary", 0) + temps - temps_was)


def _optimizer_bytes(tensors: dict, optim: str, optim_args, device: str) -> tuple[int, int]:
    """States and step temporaries of `optim` at the real depth: computed at each traced depth, extrapolated."""
    from hf_memfit import optimizers

    cuda = device == "cuda"
    per_depth = []
    for listed in tensors["lists"]:
        groups = [optimizers.TensorGroup(tuple(shape), 1, size, decay, embedding=embedding)
                  for shape, size, decay, embedding in listed]
        states = sum(optimizers.state_bytes(t, optim, cuda, optim_args=optim_args) for t in groups)
        temps = optimizers.tensors_step_temporary_bytes(groups, optim, device, optim_args=optim_args)
        per_depth.append((states, temps))
    return tuple(int(round(_extrapolate([p[i] for p in per_depth], tensors["steps"]))) for i in (0, 1))


def _extrapolate(values: list[float], steps: list[float]) -> float:
    """Exact mode's depth extrapolation: the base value plus, per stack, the growth times the periods added."""
    return values[0] + sum(step * (grown - values[0]) for step, grown in zip(steps, values[1:]))


# --- calibration ---------------------------------------------------------------------------------------

def calibrate(spec, settings) -> dict:
    """Trace the reduced-depth model at the points, fit every region's bytes, extrapolate to the real depth."""
    return calibrate_many(spec, [settings])[0]


def calibrate_many(spec, many: list, shared: list | None = None) -> list[dict]:
    """`calibrate` for each settings, their traces (two depths each) run side by side (`forked.run_jobs`).

    A mixed-precision calibration traces its check point at the other 16-bit autocast dtype: when the
    fit predicts that too, it serves both (`precisions`); when it misses, the calibration is made again
    with the check at its own precision, and serves only that one. A fit that misses its check where the
    step's ops differ between batch 1 and larger batches (`parametric_fit._batch_regimes_differ`: most
    steps differ in a region or two and still fit) is made again as two fits, one per batch regime
    (`_points`), before that; the fit of batches of 2 or more holds the batch-1 one (`batch_1`). Each round
    traces every calibration still to be made side by side, and only the shapes no earlier round traced of the
    same step at the same depths (`traced_shapes.py`): a fit made again by regime keeps two of its batch-1 lengths
    and its first batch-2 shape, and one made again at its own precision all but its check point.
    """
    from hf_memfit.estimator.forked import run_jobs

    _import_for_traces(many)
    # Per settings: (whether its check point is at the sibling precision, whether it is fitted by batch regime)
    how = [(sibling, False) for sibling in (shared or [True] * len(many))]
    fits: list = [None] * len(many)
    pending = list(range(len(many)))
    traced = TracedShapes()
    while pending:
        plans = {i: [_calibration_plan(spec, many[i], how[i][0], batches)
                     for batches in (("1", "2+") if how[i][1] else ("",))] for i in pending}
        jobs, keys = traced.jobs(spec, [plan for i in pending for plan in plans[i]])
        traced.add(jobs, keys, run_jobs(_trace_summary, jobs))
        again = []
        for i in pending:
            parts = [_fit(many[i], plan, [traced.summary(plan, depths) for depths in plan["depth_sets"]])
                     for plan in plans[i]]
            fits[i] = parts[0] if len(parts) == 1 else _by_batch_regime(*parts)
            sibling, by_regime = how[i]
            if max(p["check_miss"] for p in parts) <= CHECK_TOLERANCE:
                continue
            if not by_regime and fits[i]["batch_regimes_differ"]:  # most steps differ a little, and still fit
                how[i] = (sibling, True)
                again.append(i)
            elif sibling:  # the sibling differs, or the fit misses
                how[i] = (False, by_regime)
                again.append(i)
        pending = again
    return fits


def _by_batch_regime(single: dict, several: dict) -> dict:
    """One fit of two batch regimes: the fit of batches of 2 or more, holding the batch-1 fit (`_for_batch`)."""
    fit = dict(several, batch_1=single)
    fit["optimizer_formula_exact"] = single["optimizer_formula_exact"] and several["optimizer_formula_exact"]
    return fit


def _for_batch(fit: dict, settings) -> dict:
    """The fit of the settings' batch regime: the batch-1 fit a fit by regime holds, or the fit itself."""
    return fit["batch_1"] if settings.batch_size == 1 and "batch_1" in fit else fit


def _import_for_traces(many) -> None:
    """Import here what the traces import on their way (the Trainer's optimizer table, peft, bitsandbytes),
    so that forked children start with it instead of each importing it again."""
    import importlib

    from hf_memfit.estimator.step import heavy_step_imports

    for name in dict.fromkeys(name for s in many for name in heavy_step_imports(s)):
        try:
            importlib.import_module(name)
        except ImportError:  # the trace that needs it reports it
            pass


def _calibration_plan(spec, settings, sibling: bool = True, batches: str = "") -> dict:
    """The points, the traced settings, the depths and the extrapolation steps of one calibration."""
    from hf_memfit.models.depths import depth_plan

    points = _points(spec, settings, batches)
    other = _sibling(settings) if sibling else None
    shapes = tuple(p + ((other,) if other and i == len(points) - 1 else ()) for i, p in enumerate(points))
    traced = settings.replace(mode="exact", batch_size=points[0][0], seq_len=points[0][1],
                              gradient_accumulation_steps=max(p[2] for p in points))
    plan = depth_plan(spec)
    depth_sets, steps = plan.depth_sets, plan.steps
    # The check point at the base depth only, as batch_fit.py checks: the fit points determine every depth's
    # coefficients, and a grown depth runs the base's ops and those of one more layer (or period) of a kind it has.
    # A check at every depth did not hold the extrapolated miss to the tolerance either (the depths' misses differ,
    # times the layers a grown one stands for), and in the 60 fits measured it never decided otherwise than the
    # base's alone (docs/benchmarks.md, section 15, *The check point at the base depth only*).
    depth_shapes = {tuple(d): shapes if i == 0 else shapes[:-1] for i, d in enumerate(depth_sets)}
    return {"points": points, "shapes": shapes, "depth_shapes": depth_shapes, "traced": traced,
            "depth_sets": depth_sets, "steps": steps, "sibling": other, "batches": batches,
            "terms": TERMS_IN_SEQ if batches == "1" else None}


def _trace_summary(spec, traced, depths, shapes) -> dict:
    """One traced depth, reduced to what the fit reads (small and picklable: it may come from a child)."""
    from hf_memfit.estimator.trace import progress, trace_step
    from hf_memfit.models.depths import config_with_depths, real_depths, region_period

    progress.info("fast mode: tracing %s at depth %s at %d shapes", spec.name, "+".join(map(str, depths)),
                  len(shapes))
    trace = trace_step(config_with_depths(spec, depths), traced, depths, shapes=shapes)
    # A reduced copy stands for the stack by its first and last period; the real depth by every layer
    period = None if tuple(depths) == real_depths(spec) else region_period(spec)
    return {"series": _point_series(trace, len(shapes), period), "host_peaks": list(trace.host_peaks),
            "host_held": list(trace.host_peak_tensors),
            "facts": {k: getattr(trace, k) for k in _FACTS}, "trainable_tensors": trace.trainable_tensors}


def _fit(settings, plan: dict, summaries: list[dict]) -> dict:
    """The calibration from its traced depths' summaries."""
    import numpy as np

    points, steps, depth_sets, terms = plan["points"], plan["steps"], plan["depth_sets"], plan["terms"]
    n = len(terms or TERMS)
    series = [t["series"] for t in summaries]  # [depth][point] -> class -> (clocks, categories)
    fitted = [_fit_depth(d, points, terms) for d in series]  # [depth] -> class -> (TERMS, clocks, categories)
    candidates = {}
    for region in set.intersection(*(set(f) for f in fitted)):
        shapes_seen = {f[region].shape for f in fitted}
        per_depth = [f[region] for f in fitted] if len(shapes_seen) == 1 else \
            [_as_maxima(f[region], points, terms) for f in fitted]  # clocks not aligned across depths
        real_depth = per_depth[0] + sum(step * (grown - per_depth[0]) for step, grown in zip(steps, per_depth[1:]))
        candidates[region] = _prune(real_depth)
    check_miss, check_region = _check(series[:1], fitted[:1], points)  # traced at the base depth only
    host = host_tensors = None
    if any(any(t["host_peaks"]) for t in summaries):  # offloaded activations: each tensor's size fitted as the
        host_tensors = fit_offloaded_tensors(   # region bytes are, rounded by the host allocator when evaluated
            [t["host_held"][1:n + 1] for t in summaries], steps,
            lambda sizes: [float(c) for c in _solve_all(points, np.array(sizes, dtype=float), terms)])
        if host_tensors is None:  # the points do not offload the same tensors: their sums, fitted
            host_coefficients = [_solve_all(points, np.array(t["host_peaks"][1:n + 1], dtype=float), terms)
                                 for t in summaries]
            host = [float(c) for c in _extrapolate(host_coefficients, steps)]
    facts = {k: int(round(_extrapolate([t["facts"][k] for t in summaries], steps))) for k in _FACTS}
    facts["largest_param_numel"] = summaries[0]["facts"]["largest_param_numel"]
    facts["largest_linear_numel"] = summaries[0]["facts"]["largest_linear_numel"]
    tensors = {"lists": [t["trainable_tensors"] for t in summaries], "steps": steps}
    return {
        "version": PARAMETRIC_VERSION,
        "points": [list(p) for p in points],
        "precisions": [settings.precision] + ([plan["sibling"]] if plan["sibling"] else []),
        "depths": ", ".join("+".join(map(str, d)) for d in depth_sets),
        "traces": len(summaries),
        "candidates": candidates,
        "host": host,
        "host_tensors": host_tensors,
        "facts": facts,
        "optimizer": _optimizer_of(settings),
        "optimizer_formula_exact": _optimizer_formula_exact(series, tensors, settings),
        "tensors": tensors,
        "check_miss": check_miss,
        "check_region": check_region,
        "batch_regimes_differ": bool(plan["batches"]) or _batch_regimes_differ(series, points),
    }


def _optimizer_formula_exact(per_depth, tensors, settings) -> bool:
    """Whether optimizers.py gives the traced optimizer's states (in a steady forward region) at every depth."""
    if not _swappable(settings):
        return False
    from hf_memfit import optimizers

    cuda = settings.device == "cuda"
    for listed, points in zip(tensors["lists"], per_depth):
        groups = [optimizers.TensorGroup(tuple(shape), 1, size, decay, embedding=embedding)
                  for shape, size, decay, embedding in listed]
        states = sum(optimizers.state_bytes(t, settings.optim, cuda, optim_args=settings.optim_args)
                     for t in groups)
        region = points[0].get("1.0|fwd|pre")
        traced = int(region[0][CATEGORIES.index("optimizer")]) if region is not None else 0
        if abs(states - traced) > max(0.005 * traced, 4096):  # a few scalars' rounding aside
            return False
    return True



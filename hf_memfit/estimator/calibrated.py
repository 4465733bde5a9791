"""Fast mode for families without hand-written formulas: calibrated from exact traces, cached on disk.

Every live byte of a training step is either a model state (weights,
gradients, optimizer states: independent of the batch) or made from the
batch (activations and temporaries: proportional to the micro-batch size, at
a fixed sequence length). So at every instant of the step the live bytes are
`a + b * batch_size`, and a region's maximum is the largest of such lines.
Exact mode is run at two micro-batch sizes (`CALIBRATION_BATCHES`), and every
region's bytes by category are interpolated (or extrapolated) linearly in the
batch size. The two traced sizes come out exactly as exact mode gives them;
between them the line lies on or above the true maximum (a maximum of lines
is convex), and beyond the larger one it follows the region's steepest
traced line.

A calibration is keyed by the model config and every setting but the batch
size and the multi-GPU layout (which `sharding.shard` applies afterwards), and
stored under `generic.cache_dir()`. The first call for a key pays for the
traces and says so in the notes; later calls read one small JSON file and
import neither torch nor transformers.
"""

from __future__ import annotations

import time

from hf_memfit.estimator.breakdown import StepMemory
from hf_memfit.cache import cache_dir, config_key, read_cache, write_cache
from hf_memfit.models.generic import moe_note

#: The micro-batch sizes exact mode is traced at.
CALIBRATION_BATCHES = (1, 4)

# Settings that do not change the single-device step (sharding.shard and the
# planner apply them afterwards), so one calibration serves them all.
_LAYOUT_FIELDS = ("batch_size", "mode", "num_gpus", "num_nodes", "zero_stage", "offload_optimizer", "offload_param",
                  "expandable_segments")

_FACTS = ("trainable_params", "total_params", "largest_param_numel", "quantizable_linear_params",
          "largest_linear_numel")


def _settings_key(settings) -> dict:
    """The settings one calibration stands for, reduced to what changes the traced step."""
    key = {k: v for k, v in settings.to_dict().items() if k not in _LAYOUT_FIELDS}
    # Exact mode traces two micro-batches at most (a later one repeats the second), so every
    # accumulation of 2 or more traces the same step.
    key["gradient_accumulation_steps"] = min(settings.gradient_accumulation_steps, 2)
    if settings.optimizer_family == "adam8bit":
        key["optim"] = "adam8bit"  # one traced state layout for every bitsandbytes 8-bit AdamW; paging is applied later
    return key


def calibrated_step_memory(spec, settings) -> StepMemory:
    """Single-device peak candidates for `settings`, from a cached calibration (made now if missing)."""
    key = config_key(spec.config, _settings_key(settings))
    calibration = read_cache("calibrations", key)
    paid = None
    if calibration is None:
        started = time.perf_counter()
        calibration = calibrate(spec, settings)
        paid = time.perf_counter() - started
        write_cache("calibrations", key, calibration)
    step = evaluate(calibration, settings.batch_size)
    if spec.moe:
        step.notes.append(moe_note(spec.moe, settings))
    where = cache_dir() / "calibrations"
    lo, hi = calibration["batches"]
    if paid is not None:
        step.notes.append(f"fast mode for model type `{spec.model_type}` (no hand-written formulas) is calibrated "
                          f"from exact traces at micro-batch {lo} and {hi}; this first call paid {paid:.1f} s for "
                          f"the calibration, cached in {where}")
    else:
        step.notes.append(f"fast mode for model type `{spec.model_type}`: calibrated from exact traces at micro-batch "
                          f"{lo} and {hi} (cached in {where})")
    return step


def calibrate(spec, settings) -> dict:
    """Trace exact mode at the calibration batch sizes; keep every region's bytes by category."""
    from hf_memfit.estimator.trace import exact_candidates

    lo, hi = CALIBRATION_BATCHES
    steps = [exact_candidates(spec, settings.replace(batch_size=b, mode="exact")) for b in (lo, hi)]
    regions = [r for r in steps[0].candidates if r in steps[1].candidates]
    return {
        "batches": [lo, hi],
        "candidates": {r: [steps[0].candidates[r], steps[1].candidates[r]] for r in regions},
        "facts": {k: getattr(steps[1], k) for k in _FACTS},
    }


def _line(lo_value: float, hi_value: float, lo: int, hi: int, b: int) -> int:
    return max(0, int(round(lo_value + (hi_value - lo_value) * (b - lo) / (hi - lo))))


def evaluate(calibration: dict, batch_size: int) -> StepMemory:
    """The calibrated candidates at `batch_size` (linear in the batch size, region by region)."""
    lo, hi = calibration["batches"]
    candidates = {}
    for region, (at_lo, at_hi) in calibration["candidates"].items():
        candidates[region] = {k: _line(at_lo.get(k, 0), at_hi.get(k, 0), lo, hi, batch_size)
                              for k in set(at_lo) | set(at_hi)}
    step = StepMemory(candidates, **calibration["facts"])
    return step


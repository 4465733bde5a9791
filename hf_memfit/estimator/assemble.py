"""`estimate()`: the peak memory of one training step, from a model name and settings.

The layers, bottom up:
- `fast.fast_step_memory` (fast mode, closed form, no torch) or
  `exact.exact_candidates` (exact mode, the real step on fake tensors) give
  single-device peak candidates, one per region of the step;
- `sharding.shard` applies 4-bit packing, paging and ZeRO/DDP to each;
- this module adds what a GPU holds beyond live tensors (cuBLAS workspaces,
  allocator slack, the CUDA context) and picks the peak.

The result is plain data (`MemoryEstimate`); printing lives in `report.py`.
"""

from dataclasses import dataclass, field

from hf_memfit.errors import MemFitError
from hf_memfit.estimator.breakdown import CATEGORIES, StepMemory
from hf_memfit.estimator.fast_params import formulas_miss
from hf_memfit.estimator.worker_pool import keeps_workers
from hf_memfit.settings import TrainSettings, beyond_positions_note
from hf_memfit.models.inputs import input_note
from hf_memfit.models.spec import ModelSpec, resolve_model
from hf_memfit.models.ssm import path_note
from hf_memfit.tasks import MEDIA_TASKS


@dataclass
class MemoryEstimate:
    """Peak memory of one training step on one rank.

    `peak_allocated_bytes` is live tensors, as `torch.cuda.max_memory_allocated`;
    `peak_reserved_bytes` adds the caching allocator's cached segments;
    `device_total_bytes` is what nvidia-smi shows: reserved plus the CUDA context
    and NCCL buffers. `breakdown` sums to `device_total_bytes`. On the CPU the
    three peaks are equal.
    """

    model: str
    settings: TrainSettings
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_total_bytes: int
    cpu_bytes: int
    nvme_bytes: int
    breakdown: dict[str, int]
    peak_region: str
    total_params: int
    trainable_params: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "mode": self.settings.mode,
            "device": self.settings.device,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "device_total_bytes": self.device_total_bytes,
            "cpu_bytes": self.cpu_bytes,
            "nvme_bytes": self.nvme_bytes,
            "breakdown": dict(self.breakdown),
            "peak_phase": describe_region(self.peak_region),
            "total_params": self.total_params,
            "trainable_params": self.trainable_params,
            "settings": self.settings.to_dict(),
            "notes": list(self.notes),
        }


# What a run's logs show beside this step's peak (docs/benchmarks.md section 19, the third GPU session): on an H200,
# 64 micro-batches of varying lengths reserved 1.12-2.24x what one step at the largest shape did, with the same
# allocated peak; capped at that step's reserved memory, the same runs fit in two of three.
RUN_OF_SHAPES_NOTE = ("peak reserved is one step at this shape; a run whose batches vary in shape (dynamic padding, "
                      "image sizes) reserves more on a card with room (1.1-2.2x measured), cached blocks the allocator "
                      "frees before it raises an OOM: `--vary-seq-len MIN` simulates such a run, and expandable "
                      "segments keep it down (`--expandable-segments`)")


@keeps_workers  # a fit's depths trace on workers whose caches stay warm from one depth to the next
def estimate(model: str | ModelSpec, **settings) -> MemoryEstimate:
    """Predict the peak memory of one training step.

    `model` is a catalogue name (`"gpt2-xl"`, `"meta-llama/Llama-3.1-8B"`), a
    local directory or config.json path, or a `ModelSpec`. Keyword arguments
    are `TrainSettings` fields, e.g. `batch_size=8, seq_len=1024,
    precision="bf16-mixed", optim="adamw_bnb_8bit", gradient_checkpointing=True,
    mode="exact"`. Raises `MemFitError` on bad input.
    """
    spec = model if isinstance(model, ModelSpec) else resolve_model(model)
    if isinstance(settings.get("lora_target_modules"), (list, str)):
        targets = settings["lora_target_modules"]
        settings["lora_target_modules"] = tuple(targets.split(",") if isinstance(targets, str) else targets)
    return estimate_settings(spec, TrainSettings(**settings))


def estimate_settings(spec: ModelSpec, settings: TrainSettings) -> MemoryEstimate:
    """`estimate` for an already-built spec and settings (the planner's entry point)."""
    validated = settings.validate(spec)
    return assemble(spec, validated, step_memory(spec, validated))


def speculate_exact(spec: ModelSpec, settings: TrainSettings) -> bool:
    """Start the deepest trace an exact estimate of `settings` will run, in a forked child, before it is asked
    for (`exact.speculate_deepest_trace`; `--seq-len max` does this beside its last fast plan). Whether one
    started."""
    from hf_memfit.estimator.exact import speculate_deepest_trace
    from hf_memfit.estimator.sequence import local_step_settings

    validated = settings.replace(mode="exact").validate(spec)
    return speculate_deepest_trace(spec, local_step_settings(traced_settings(validated)))


def step_memory(spec: ModelSpec, settings: TrainSettings) -> StepMemory:
    """Single-device peak candidates from the mode the settings ask for.

    Under sequence or context parallelism the step is one rank's: the model at seq_len / (sp x cp) tokens
    (traced so in exact mode), plus what the attention exchange adds (`sequence.with_sequence_terms`).
    """
    from hf_memfit.estimator.sequence import local_step_settings, with_sequence_terms

    traced = local_step_settings(traced_settings(settings))
    return with_sequence_terms(spec, traced_settings(settings), _mode_step_memory(spec, settings, traced))


def _mode_step_memory(spec: ModelSpec, settings: TrainSettings, traced: TrainSettings) -> StepMemory:
    if settings.mode == "exact" and settings.task not in MEDIA_TASKS:
        from hf_memfit.estimator.exact import exact_candidates  # imports torch; fast mode never does

        return exact_candidates(spec, traced)
    if settings.task in MEDIA_TASKS:
        if settings.mode == "exact":
            from hf_memfit.estimator.exact import exact_candidates

            return held_batches(spec, settings, exact_candidates(spec, traced))
        from hf_memfit.estimator.batch_fit import batch_fit_step_memory  # no free sequence length to fit over

        return held_batches(spec, settings, batch_fit_step_memory(spec, traced))
    if not spec.hand_written or formulas_miss(settings):
        # A step the hand-written formulas do not cover is fitted to traces of itself.
        from hf_memfit.estimator.parametric import parametric_step_memory  # imports torch only to fit

        return parametric_step_memory(spec, traced)
    from hf_memfit.estimator.fast import fast_step_memory

    return fast_step_memory(spec, traced)


def held_batches(spec: ModelSpec, settings: TrainSettings, step: StepMemory) -> StepMemory:
    """The micro-batches the Trainer holds beside the one a step traces (image, audio and VLM inputs).

    `Trainer.get_batch_samples` fetches all `gradient_accumulation_steps` micro-batches of an optimizer step
    before its first forward and keeps them until the next step's are fetched; the traced step holds its
    own micro-batch through its forward and backward only. So forward and backward regions hold the other
    accumulation - 1, and the optimizer step all of them. On the CPU they also hold the next step's first
    micro-batch: accelerate's `DataLoaderShard` fetches one batch ahead (to know which is the last) and keeps it
    until its turn, on the host, which on a GPU is not the device's memory (it is sent to the device when
    yielded). The last step of an epoch has none ahead. Token ids are bytes per token against kilobytes of
    activations, so text batches are left as traced.
    """
    from hf_memfit.models.inputs import batch_bytes

    one = batch_bytes(spec.config, settings)
    held = settings.gradient_accumulation_steps
    ahead = bytes_fetched_ahead(spec, settings)
    for region, values in step.candidates.items():
        if region != "build":
            extra = held if region.endswith("|opt") else held - 1
            values["activations"] = values.get("activations", 0) + extra * one + ahead
    return step


def bytes_fetched_ahead(spec: ModelSpec, settings: TrainSettings) -> int:
    """The batch accelerate's `DataLoaderShard` holds fetched ahead through a step, in the step's memory: an image,
    audio or VLM batch on the CPU (`held_batches`); on a GPU it waits on the host. The trainer's CPU check reads it
    off where the epoch ends, with none ahead."""
    from hf_memfit.models.inputs import batch_bytes

    if settings.task not in MEDIA_TASKS or settings.device != "cpu":
        return 0
    return batch_bytes(spec.config, settings)


def prepare(spec: ModelSpec, many) -> None:
    """Make ahead, side by side, what fast mode will read for each of these settings (the planner's grid).

    Only the fitted fast modes cost anything to make: the parametric fits of families without formulas,
    and the batch fits of image, audio and VLM inputs; the planner would otherwise make them one after
    another as it meets them. Settings that do not validate are left to
    the estimate that reports them.
    """
    fitted = [f for f in (_fitted(spec, s) for s in many) if f is not None]
    media = [traced for kind, traced in fitted if kind == "batch"]
    if media:
        from hf_memfit.estimator.batch_fit import prepare_batch_fits

        prepare_batch_fits(spec, media)
    text = [traced for kind, traced in fitted if kind == "parametric"]
    if text:
        from hf_memfit.estimator.parametric import prepare_fits

        prepare_fits(spec, text)


def fit_group(spec: ModelSpec, settings: TrainSettings) -> str | None:
    """Which traced fit fast mode reads for `settings`, as a label the settings reading the same fit share; None
    where it reads formulas (nothing to trace) or the settings do not validate. The planner makes fits a few
    groups at a time (`planner/lazy_grid.py`)."""
    fitted = _fitted(spec, settings)
    if fitted is None:
        return None
    kind, traced = fitted
    if kind == "batch":
        from hf_memfit.estimator.batch_fit import fit_group as batch_fit_group

        return "batch:" + batch_fit_group(spec, traced)
    from hf_memfit.estimator.parametric import fit_group as parametric_fit_group

    return "parametric:" + parametric_fit_group(spec, traced)


def _fitted(spec: ModelSpec, settings: TrainSettings) -> tuple[str, TrainSettings] | None:
    """("batch" or "parametric", the settings the fit is read for) where fast mode reads a traced fit for
    `settings`, routed as `_mode_step_memory` routes a step; None where it reads formulas or the settings do
    not validate (the estimate reports them)."""
    if settings.mode != "fast" or (spec.hand_written and not formulas_miss(settings)
                                   and settings.task not in MEDIA_TASKS):
        return None
    from hf_memfit.estimator.sequence import local_step_settings

    try:
        traced = local_step_settings(traced_settings(settings.validate(spec)))
    except MemFitError:
        return None
    return ("batch" if traced.task in MEDIA_TASKS else "parametric"), traced


def traced_settings(settings: TrainSettings) -> TrainSettings:
    """The step as the device really runs it.

    Under DeepSpeed the engine casts the model to the compute dtype and runs it
    without autocast (accelerate turns native AMP off for DeepSpeed), so a
    bf16-mixed ZeRO step is a pure-bf16 step: no fp32 weights, no autocast
    weight cache, half-precision activations. The model states are then laid
    out by `sharding.shard`. FSDP keeps the Trainer's autocast (accelerate leaves native AMP on
    and adds FSDP's mixed-precision policy), so its step is traced as configured.
    """
    settings = settings.replace(prepare_model_for_kbit_training=settings.kbit_prepared)  # resolved: a cache key reads it
    if settings.zero_stage and settings.autocast_dtype:
        return settings.replace(precision=settings.precision.removesuffix("-mixed"))
    return settings


def assemble(spec: ModelSpec, settings: TrainSettings, step: StepMemory) -> MemoryEstimate:
    """Shard the candidates, add the GPU's own overheads, and pick the peak."""
    from hf_memfit.estimator import cuda_overhead
    from hf_memfit.estimator.sharding import shard, wrap_units

    units = wrap_units(spec, settings, step) if settings.fsdp is not None else None
    rank = shard(step, settings, spec.hidden_size, units)
    peak_region = max(rank.candidates, key=lambda r: sum(rank.candidates[r].values()))
    breakdown = {k: int(rank.candidates[peak_region].get(k, 0)) for k in CATEGORIES}
    allocated = sum(breakdown.values())
    notes = list(step.notes) + list(rank.notes)
    beyond = beyond_positions_note(settings, spec)
    inputs = input_note(spec, settings)
    if inputs:
        notes.insert(0, inputs)
    if beyond:
        notes.insert(0, beyond)
    ssm_path = path_note(spec.ssm_mixers, settings)  # which state-space kernel path (models/ssm.py)
    if ssm_path:
        notes.insert(0, ssm_path)
    if settings.device == "cpu":
        reserved = total = allocated
    else:
        gpu = _gpu(settings)
        workspace = cuda_overhead.cublas_workspace_bytes(gpu)
        allocated += workspace
        # One slack model for both modes: a share of what churns (activations and temporaries).
        slack = cuda_overhead.allocator_slack_bytes(breakdown["activations"] + breakdown["temporary"],
                                                    expandable_segments=settings.expandable_segments)
        slack += rank.stream_cached.get(peak_region, 0)  # FSDP's collective streams keep their own blocks
        reserved = allocated + slack
        context = cuda_overhead.cuda_context_bytes(gpu)
        total = reserved + context + rank.outside_allocator_bytes
        breakdown["overhead"] += workspace + slack + context + rank.outside_allocator_bytes
        notes.append(f"CUDA overhead: cuBLAS workspaces {workspace / 2**20:.0f} MiB, allocator slack "
                     f"{slack / 2**20:.0f} MiB{' (expandable_segments)' if settings.expandable_segments else ''}, "
                     f"CUDA context {context / 2**20:.0f} MiB")
        if not settings.expandable_segments:
            notes.append(RUN_OF_SHAPES_NOTE)
    return MemoryEstimate(
        model=spec.name,
        settings=settings,
        peak_allocated_bytes=int(allocated),
        peak_reserved_bytes=int(reserved),
        device_total_bytes=int(total),
        cpu_bytes=int(rank.cpu_bytes),
        nvme_bytes=int(rank.nvme_bytes),
        breakdown=breakdown,
        peak_region=peak_region,
        total_params=step.total_params,
        trainable_params=step.trainable_params,
        notes=notes,
    )


def _gpu(settings: TrainSettings):
    from hf_memfit.hardware import named_gpu

    return named_gpu(settings.gpu)


def describe_region(region: str) -> str:
    """'1.0|bwd|s0.first' -> 'step 2, backward, first layer' for reports ('s0.last-1': '2nd-to-last layer')."""
    parts = region.split("|")
    if len(parts) == 2:  # "<step>.<micro>|opt"
        parts.append("")
    if len(parts) != 3:
        return {"build": "model creation"}.get(region, region)
    step, phase, where = parts
    step_index, micro = step.split(".")
    label = {"fwd": "forward", "bwd": "backward", "opt": "optimizer step"}.get(phase, phase)
    text = f"step {int(step_index) + 1}"
    if micro == "1":
        text += " (accumulating micro-batch)"
    text += f", {label}"
    if where and where != "opt":
        stack, _, position = where.partition(".")
        names = {"pre": "before the layers", "post": "after the layers", "first": "first layer", "last": "last layer"}
        end, sign, count = (position or stack).replace("+", "-").partition("-")  # `regions.py`: "first+1", "last-2"
        if sign and count.isdigit():  # counted in the order the phase runs the layers, as "first" and "last" are
            n = int(count) + 1
            nth = f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"
            text += f", {nth} layer" if end == "first" else f", {nth}-to-last layer"
        else:
            text += f", {names.get(position or stack, position or stack)}"
        if stack.startswith("s") and stack != "s0":
            text += f" (stack {stack[1:]})"
    return text

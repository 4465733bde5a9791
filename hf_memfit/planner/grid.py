"""The settings the planner searches: micro-batch x checkpointing x optimizer x layout, and the levers it adds."""

import importlib.util

from hf_memfit import optimizers
from hf_memfit.models.spec import ModelSpec
from hf_memfit.settings import TrainSettings

# The AdamW ladder, fastest first (`optimizers.ADAMW_LADDER`): 8-bit AdamW stores ~2 B/param of state
# instead of 8 (bitsandbytes), paged 8-bit lets the driver move it to the host, torchao's 8-bit and 4-bit
# AdamW (~2 and ~1 B/param) quantize the states the same way. On the CPU the ladder stops at bitsandbytes:
# torchao compiles one update per tensor shape with torch.compile (37 s for the first one on this 2-core
# machine, a C++ toolchain required), which no per-step speed figure can rank fairly.
ADAM_LADDER = optimizers.ADAMW_LADDER


CPU_ADAM_LADDER = ("adamw_torch_fused", "adamw_bnb_8bit", "paged_adamw_8bit")


def liger_searched(spec: ModelSpec, base: TrainSettings, use_liger_kernel: bool | None) -> bool:
    """Whether to search Liger's fused loss: a causal LM of a family it patches, installed or asked for, on a GPU."""
    from hf_memfit.settings import LIGER_MODEL_TYPES

    if use_liger_kernel is False or base.device != "cuda" or base.task != "causal-lm":
        return False
    if spec.model_type not in LIGER_MODEL_TYPES:
        return False
    return bool(use_liger_kernel) or importlib.util.find_spec("liger_kernel") is not None


def with_activation_offload(grid, searched: bool):
    """Each configuration, and (when searched) its checkpointed ones with the checkpoints offloaded to the host."""
    for settings in grid:
        yield settings
        if searched and settings.gradient_checkpointing and not settings.activation_offloading:
            yield settings.replace(offload_activations=True)


def tiled_mlp_searched(spec: ModelSpec, base: TrainSettings, tiled_mlp: bool | None) -> bool:
    """Whether to search ALST's TiledMLP: asked for, or (by default) on a GPU once a sequence spans two
    or more shards of `hidden_size` tokens, for a model whose layers have a dense MLP to tile."""
    if tiled_mlp is False or not spec.tileable_mlp or base.tiled_mlp:
        return False
    return bool(tiled_mlp) or (base.device == "cuda" and base.row_len >= 2 * spec.hidden_size)


def with_tiled_mlp(grid, searched: bool):
    """Each configuration, and (when searched) the same with every MLP computed in sequence shards."""
    for settings in grid:
        yield settings
        if searched:
            yield settings.replace(tiled_mlp=True)


def with_liger(grid, liger: bool):
    """Each configuration, and (when searched) the same with Liger's fused linear cross-entropy."""
    for settings in grid:
        yield settings
        if liger:
            yield settings.replace(use_liger_kernel=True)


def parse_target_modules(targets) -> tuple[str, ...] | None:
    """TrainingArguments.optim_target_modules ("all-linear", "q_proj,v_proj" or a list) as a tuple."""
    if not targets:
        return None
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    return tuple(targets)


def allowed_optimizers(base: TrainSettings, allowed: tuple[str, ...], keep_optimizer: bool) -> tuple[str, ...]:
    """The optimizers to search: the AdamW ladder (unless kept), plus those the user allowed."""
    if keep_optimizer:
        return (base.optim,)
    ladder = ADAM_LADDER if base.device == "cuda" else CPU_ADAM_LADDER
    optims = ladder if base.optim in ADAM_LADDER else (base.optim,)
    for name in allowed:
        o = optimizers.OPTIMIZERS[name]
        if o.low_rank and base.uses_lora:
            continue  # low-rank optimizers are for full fine-tuning
        if o.layerwise and base.world_size > 1:
            continue  # the Trainer refuses layerwise optimizers under DDP
        if name not in optims:
            optims += (name,)
    return optims


def low_rank_targets(spec: ModelSpec, base: TrainSettings) -> tuple[str, ...]:
    """GaLore / APOLLO's `optim_target_modules` when the planner picks one: the layers' linear modules (attention
    and MLP), as both papers apply them."""
    return tuple(sorted({m.name for m in spec.linear_modules(base.task, base.num_labels) if m.scope == "layer"}))


def pure_bf16_base(base: TrainSettings, gpu_info, fixed_layout) -> TrainSettings | None:
    """The base settings with bf16 weights, or None where pure bf16 cannot apply (LoRA, no bf16 GPU, ZeRO)."""
    if base.uses_lora or base.precision == "bf16" or fixed_layout is not None:
        return None
    if base.device == "cuda" and gpu_info is not None and not gpu_info.supports_bf16:
        return None
    return base.replace(precision="bf16", optim_args=optimizers.BF16_STOCHASTIC_ROUND_ARGS,
                        optim_target_modules=None)  # torchao's AdamW: a GaLore / APOLLO run's targets do not apply


def pure_bf16_grid(pure: TrainSettings, per_rank: int):
    """Pure bf16: torchao's low-bit AdamW with stochastic rounding, no ZeRO (DeepSpeed keeps an fp32 master)."""
    for micro in [m for m in range(1, per_rank + 1) if per_rank % m == 0]:
        for checkpointing in (False, True):
            for optim in optimizers.PURE_BF16_LADDER:
                yield pure.replace(batch_size=micro, gradient_accumulation_steps=per_rank // micro,
                                   gradient_checkpointing=checkpointing, optim=optim)


def settings_grid(base: TrainSettings, per_rank: int, allow_offload: str, keep_optimizer: bool, world: int,
          fixed_layout: dict | None = None, optims: tuple[str, ...] | None = None,
          low_rank_targets: tuple[str, ...] = ()):
    micro_batches = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
    if optims is None:
        optims = (base.optim,) if keep_optimizer or base.optim not in ADAM_LADDER else ADAM_LADDER
    if fixed_layout is not None:  # the user's own DeepSpeed or FSDP config: its optimizer section, if any, wins anyway
        for micro in micro_batches:
            for checkpointing in (False, True):
                yield base.replace(batch_size=micro, gradient_accumulation_steps=per_rank // micro,
                                   gradient_checkpointing=checkpointing, **fixed_layout)
        return
    for micro in micro_batches:
        for checkpointing in (False, True):
            for layout in layout_variants(base, allow_offload, world):
                for optim in optims:
                    if (layout.get("zero_stage") or layout.get("fsdp")) and optim != "adamw_torch_fused":
                        continue  # sharded layouts already split the states; 8-bit states stay a plain-torch knob
                    low_rank = optimizers.OPTIMIZERS[optim].low_rank
                    if optimizers.OPTIMIZERS[optim].layerwise and (per_rank // micro > 1 or world > 1):
                        continue  # stepped inside backward: the Trainer refuses accumulation and DDP with them
                    yield base.replace(batch_size=micro, gradient_accumulation_steps=per_rank // micro,
                                       gradient_checkpointing=checkpointing, optim=optim, **layout,
                                       optim_target_modules=(base.optim_target_modules or low_rank_targets)
                                       if low_rank else None)


def layout_variants(base: TrainSettings, allow_offload: str, world: int) -> list[dict]:
    """The data-parallel layouts the planner may choose from, as TrainSettings fields.

    Sharded layouts are GPU plans: on the CPU one process holds everything. FSDP runs
    as the Trainer runs it by default (FSDP2), under a distributed launch only (one
    GPU: DeepSpeed's offload covers it). DeepSpeed offload is not offered for 4-bit
    models; FSDP's CPU offload is (peft's "FSDP+QLoRA" recipe), and 4-bit weights are
    sharded with the quant storage in the compute dtype.
    """
    none = dict(zero_stage=0, offload_optimizer="none", offload_param="none", fsdp=None, fsdp_offload=False)
    if base.sp_size > 1 or base.cp_size > 1:
        return sequence_layout_variants(base, allow_offload, none)
    layouts = [none]
    if base.device != "cuda":
        return layouts
    if world > 1:
        layouts += [none | dict(zero_stage=stage) for stage in (1, 2, 3)]
        layouts += [none | dict(fsdp="full_shard", fsdp_version=2), none | dict(fsdp="shard_grad_op", fsdp_version=2)]
    if allow_offload in ("cpu", "nvme"):
        if not base.load_in_kbit:
            layouts += [none | dict(zero_stage=2, offload_optimizer="cpu"), none | dict(zero_stage=3, offload_optimizer="cpu"),
                        none | dict(zero_stage=3, offload_optimizer="cpu", offload_param="cpu")]
        if world > 1:
            layouts += [none | dict(fsdp="full_shard", fsdp_version=2, fsdp_offload=True)]
    if allow_offload == "nvme" and not base.load_in_kbit:
        layouts += [none | dict(zero_stage=3, offload_optimizer="nvme", offload_param="nvme")]
    return layouts


# Sequences at least this long make the planner weigh Ulysses SP (`--sp-size auto`) beside plain data
# parallelism even when the latter fits: at 32K tokens an 8B model's logits and their fp32 copies alone take
# ~31 GiB of an H100 (issue 17's example), and activations grow linearly from there. Below it SP is searched
# only when nothing else fits. A planning threshold, not a measured one.
LONG_SEQUENCE = 32768


def sequence_layout_variants(base: TrainSettings, allow_offload: str, none: dict) -> list[dict]:
    """The layouts a sequence-parallel rank can run: ZeRO-1/2/3 under Ulysses, FSDP2 full_shard under CP.

    Ulysses is DeepSpeed's (accelerate prepares it in its DeepSpeed path only); context parallelism is
    FSDP2's (accelerate builds it on the `dp_shard_cp` mesh), with SDPA attention.
    """
    if base.sp_size > 1:
        layouts = [none | dict(zero_stage=stage) for stage in (1, 2, 3)]
        if allow_offload in ("cpu", "nvme") and not base.load_in_kbit:
            layouts += [none | dict(zero_stage=2, offload_optimizer="cpu"), none | dict(zero_stage=3, offload_optimizer="cpu"),
                        none | dict(zero_stage=3, offload_optimizer="cpu", offload_param="cpu")]
        return layouts
    layouts = [none | dict(fsdp="full_shard", fsdp_version=2, attn_implementation="sdpa")]
    if allow_offload in ("cpu", "nvme"):
        layouts += [none | dict(fsdp="full_shard", fsdp_version=2, fsdp_offload=True, attn_implementation="sdpa")]
    return layouts


def sequence_splits(spec: ModelSpec, base: TrainSettings, sp_size, cp_size, global_batch: int,
                    nothing_fits_without: bool) -> list[tuple[int, int]]:
    """The (sp, cp) pairs to search: (1, 1) plus what `--sp-size` / `--cp-size` ask for.

    A number is taken as given (the settings' validation reports what is wrong with it); "auto" tries every
    divisor of the world above 1 that the model, the sequence and the global batch allow (heads and KV heads
    by sp, the sequence by sp or cp, the global batch by the data-parallel replicas left), when the sequence
    is long (`LONG_SEQUENCE`) or nothing fits without.
    """
    from hf_memfit.errors import MemFitError

    world = base.world_size
    fixed = [(int(sp_size) if str(sp_size) != "auto" else 1, int(cp_size) if str(cp_size) != "auto" else 1)]
    if fixed != [(1, 1)]:
        return fixed
    pairs = [(1, 1)]
    consider = base.device == "cuda" and world > 1 and (base.seq_len >= LONG_SEQUENCE or nothing_fits_without)
    if not consider:
        return pairs
    for name, auto in (("sp", str(sp_size) == "auto"), ("cp", str(cp_size) == "auto")):
        if not auto:
            continue
        for shards in (d for d in range(2, world + 1) if world % d == 0):
            if global_batch % (world // shards):
                continue
            pair = (shards, 1) if name == "sp" else (1, shards)
            layout = sequence_layout_variants(base.replace(sp_size=pair[0], cp_size=pair[1]), "none",
                                              dict(zero_stage=0, fsdp=None))[0]
            try:
                base.replace(sp_size=pair[0], cp_size=pair[1], **layout).validate(spec)
            except MemFitError:
                continue
            pairs.append(pair)
    return pairs

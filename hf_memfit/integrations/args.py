"""The memory-budget fields every MemFit trainer reads, and `MemFitArguments` (TrainingArguments + them).

The fields live in their own dataclass, `MemFitFields`, placed *after* the
arguments class in the bases: `class C(SFTConfig, MemFitFields)`. A dataclass
collects fields from the bases in reverse MRO order, so the last class to
define a field decides its default. `MemFitFields` defines only its own
fields, so SFTConfig's defaults (learning rate 2e-5, bf16 and gradient
checkpointing on, ...) stay SFT's. (`class C(MemFitArguments, SFTConfig)`
would reset them: MemFitArguments re-declares every TrainingArguments field
with TrainingArguments' default, and comes last.)
"""

import dataclasses
from dataclasses import dataclass, field

from transformers import TrainingArguments

from hf_memfit.errors import MemFitError, check_all


@dataclass
class MemFitFields:
    """The memory budget and how to plan for it. Mixed into a TrainingArguments subclass, after it."""

    memory_budget: str = field(
        default="auto",
        metadata={"help": "Memory per device to fit in: `auto` (the GPU's free memory) or a size such as 12GiB."},
    )
    global_batch_size: int | None = field(
        default=None,
        metadata={"help": "Samples per optimizer step over all devices. Default: per-device batch x accumulation x world size."},
    )
    memfit_mode: str = field(default="fast", metadata={"help": "Estimator mode for planning: fast or exact."})
    allow_offload: str = field(default="cpu", metadata={"help": "DeepSpeed offload the plan may use: none, cpu or nvme."})
    headroom: float = field(default=0.05, metadata={"help": "Fraction of the budget kept free."})
    keep_optimizer: bool = field(default=False, metadata={"help": "Never switch AdamW to its 8-bit variants."})
    allow_pure_bf16: bool = field(
        default=False,
        metadata={"help": "Let the plan train full bf16 weights with no fp32 master copy (torchao's low-bit AdamW "
                          "with bf16 stochastic rounding) when no mixed-precision plan fits. It changes the "
                          "numerics, so it is never chosen without this flag. A model loaded in bf16 for full "
                          "fine-tuning gets the stochastic-rounding optimizers too."},
    )
    allow_optimizers: str = field(
        default="",
        metadata={"help": "Comma-separated optimizers the plan may switch to beyond the AdamW ladder, because "
                          "they change the training dynamics: galore_adamw, galore_adamw_8bit, apollo_adamw, "
                          "adafactor, and the layerwise galore_adamw_layerwise, galore_adamw_8bit_layerwise, "
                          "apollo_adamw_layerwise (planned only with gradient accumulation 1 on one GPU)."},
    )
    allow_freeze: bool = field(
        default=False,
        metadata={"help": "Let the plan freeze the model's towers beside what it trains (a VLM's vision tower, a "
                          "wav2vec2 / HuBERT feature encoder, Whisper's encoder) when nothing fits with every "
                          "module trained. It changes what is trained, so it is never chosen without this flag; "
                          "the trainer then calls requires_grad_(False) on them before building the optimizer."},
    )
    memfit_max_recoveries: int = field(default=3, metadata={"help": "OOM recoveries before saving and stopping."})
    memfit_debug_memory: bool = field(
        default=False,
        metadata={"help": "Record PyTorch's CUDA memory history from the start and write a snapshot and a "
                          "predicted-vs-measured report to the output directory at the end (or at an OOM)."},
    )

    def check_memfit_fields(self) -> None:
        """Raise one `MemFitError` naming every bad memfit field."""
        problems = []
        if self.memfit_mode not in ("fast", "exact"):
            problems.append(f"`memfit_mode` must be fast or exact, got {self.memfit_mode!r}")
        if self.allow_offload not in ("none", "cpu", "nvme"):
            problems.append(f"`allow_offload` must be none, cpu or nvme, got {self.allow_offload!r}")
        if not 0 <= self.headroom < 1:
            problems.append(f"`headroom` must be in [0, 1), got {self.headroom}")
        from hf_memfit.optimizers import OPTIMIZERS

        unknown = [o for o in str(self.allow_optimizers or "").split(",") if o.strip() and o.strip() not in OPTIMIZERS]
        if unknown:
            problems.append(f"`allow_optimizers` {', '.join(unknown)} not modelled; use names from {', '.join(OPTIMIZERS)}")
        if self.global_batch_size is not None and self.global_batch_size <= 0:
            problems.append(f"`global_batch_size` must be positive, got {self.global_batch_size}")
        if str(self.memory_budget).strip().lower() != "auto":
            from hf_memfit.units import parse_bytes

            try:
                parse_bytes(self.memory_budget, "memory_budget")
            except ValueError as error:
                problems.append(str(error))
        check_all(problems)


MEMFIT_FIELDS = tuple(f.name for f in dataclasses.fields(MemFitFields))


def memfit_fields(args) -> MemFitFields:
    """The memfit fields of `args`, checked: its own where it has them, the defaults where it has not.

    Lets any trainer arguments class (a plain `TrainingArguments`, `DPOConfig`,
    a user's subclass) drive a MemFit trainer without being converted.
    """
    if args is None:
        raise MemFitError("`args` is required: pass e.g. MemFitArguments(output_dir=..., memory_budget=...)")
    fields = MemFitFields(**{name: getattr(args, name) for name in MEMFIT_FIELDS if hasattr(args, name)})
    fields.check_memfit_fields()
    return fields


@dataclass
class MemFitArguments(TrainingArguments, MemFitFields):
    """TrainingArguments with a memory budget; `MemFitTrainer` fills the memory knobs from a plan.

    The batch the user gives (per-device batch x accumulation x world size) is
    the global batch to keep, unless `global_batch_size` says otherwise.
    """

    def __post_init__(self):
        super().__post_init__()
        self.check_memfit_fields()

"""TRL's trainers fitted to a memory budget, following TRL's Config/Trainer pairs.

    from hf_memfit import MemFitSFTConfig, MemFitSFTTrainer

    args = MemFitSFTConfig(output_dir="out", memory_budget="24GiB", max_length=2048, packing=True)
    trainer = MemFitSFTTrainer(model=model, args=args, train_dataset=dataset, peft_config=lora)

Each config is TRL's own plus the memfit fields (`args.MemFitFields`), mixed in
after it so that TRL's defaults stay TRL's (SFT: learning rate 2e-5, bf16 and
gradient checkpointing on). Each trainer is TRL's own with `MemFitMixin` last:
it plans when TRL hands the prepared dataset and the wrapped model to
`Trainer.__init__`, so the plan sees the packed or padding-free rows, the
peft adapters, and the step TRL runs (its fused LM head, DPO's chosen +
rejected rows and reference forward), which `step.py` reproduces with TRL's
own code. Needs `pip install hf-memfit[trl]`.
"""

from dataclasses import dataclass

try:
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("hf-memfit's TRL trainers need TRL: pip install 'hf-memfit[trl]'") from error

from hf_memfit.integrations.args import MemFitFields
from hf_memfit.integrations.mixin import MemFitMixin


@dataclass
class MemFitSFTConfig(SFTConfig, MemFitFields):
    """`trl.SFTConfig` (with SFT's defaults) plus `memory_budget`, `global_batch_size`, `memfit_mode`, ..."""

    def __post_init__(self):
        super().__post_init__()
        self.check_memfit_fields()


class MemFitSFTTrainer(SFTTrainer, MemFitMixin):
    """`trl.SFTTrainer` fitted to `args.memory_budget`; takes the same arguments, by keyword or position."""


@dataclass
class MemFitDPOConfig(DPOConfig, MemFitFields):
    """`trl.DPOConfig` (with DPO's defaults) plus the memfit fields."""

    def __post_init__(self):
        super().__post_init__()
        self.check_memfit_fields()


class MemFitDPOTrainer(DPOTrainer, MemFitMixin):
    """`trl.DPOTrainer` fitted to `args.memory_budget`; `ref_model` stays its second parameter, as in TRL."""


__all__ = ["MemFitDPOConfig", "MemFitDPOTrainer", "MemFitSFTConfig", "MemFitSFTTrainer"]

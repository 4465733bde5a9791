"""What a plan is: the chosen settings with their estimate, reasons and runners-up (`Plan`, `PlanResult`)."""

from dataclasses import dataclass, field

from hf_memfit.estimator.assemble import MemoryEstimate
from hf_memfit.planner.candidates import Candidate
from hf_memfit.settings import TrainSettings

# What runs the step when ZeRO offloads the optimizer: deepspeed.py writes an
# `optimizer` section (AdamW), which DeepSpeed builds as DeepSpeedCPUAdam on the host.
OFFLOADED_OPTIMIZER = "DeepSpeedCPUAdam"


@dataclass
class Plan:
    """A training configuration, with the TrainingArguments it maps to and why."""

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    num_gpus: int
    num_nodes: int
    gradient_checkpointing: bool
    bf16: bool
    fp16: bool
    torch_dtype: str
    optim: str
    attn_implementation: str
    deepspeed: dict | None
    per_device_eval_batch_size: int
    reasons: list[str]
    predicted_tokens_per_second_relative: float
    predicted_step_seconds: float
    settings: TrainSettings = field(repr=False)
    budget_bytes: int = 0
    fsdp: dict | None = None  # TrainingArguments `fsdp` / `fsdp_config` when the plan shards with FSDP
    optim_args: str | None = None  # TrainingArguments.optim_args ("bf16_stochastic_round=True" for pure bf16)
    use_liger_kernel: bool = False
    offload_activations: bool = False  # gradient_checkpointing_kwargs={"offload": True}
    optim_target_modules: list[str] | None = None  # GaLore / APOLLO
    tiled_mlp: bool = False  # ALST's TiledMLP: not a TrainingArguments field; MemFitTrainer applies it
    # accelerate.ParallelismConfig keyword arguments (handlers as dicts) when the plan splits sequences
    parallelism_config: dict | None = None
    # Modules trained frozen (`requires_grad_(False)`; a tower the plan froze with `allow_freeze`, or the run's
    # own): not a TrainingArguments field; MemFitTrainer freezes them before it builds the optimizer
    frozen: list[str] | None = None

    def to_dict(self) -> dict:
        return {
            "per_device_train_batch_size": self.per_device_train_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "num_gpus": self.num_gpus,
            "num_nodes": self.num_nodes,
            "gradient_checkpointing": self.gradient_checkpointing,
            "bf16": self.bf16,
            "fp16": self.fp16,
            "torch_dtype": self.torch_dtype,
            "optim": self.optim,
            "optim_args": self.optim_args,
            "use_liger_kernel": self.use_liger_kernel,
            "offload_activations": self.offload_activations,
            "optim_target_modules": self.optim_target_modules,
            "tiled_mlp": self.tiled_mlp,
            "frozen": self.frozen,
            "attn_implementation": self.attn_implementation,
            "deepspeed": self.deepspeed,
            "fsdp": self.fsdp,
            "per_device_eval_batch_size": self.per_device_eval_batch_size,
            "zero_stage": self.settings.zero_stage,
            "offload_optimizer": self.settings.offload_optimizer,
            "offload_param": self.settings.offload_param,
            "fsdp_strategy": self.settings.fsdp,
            "fsdp_version": self.settings.fsdp_version if self.settings.fsdp else None,
            "fsdp_offload": self.settings.fsdp_offload,
            "sp_size": self.settings.sp_size,
            "cp_size": self.settings.cp_size,
            "parallelism_config": self.parallelism_config,
            "reasons": list(self.reasons),
            "predicted_tokens_per_second_relative": round(self.predicted_tokens_per_second_relative, 4),
            "budget_bytes": self.budget_bytes,
        }

    def training_arguments(self) -> dict:
        """The TrainingArguments fields this plan sets."""
        kwargs = {
            "per_device_train_batch_size": self.per_device_train_batch_size,
            "per_device_eval_batch_size": self.per_device_eval_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "gradient_checkpointing": self.gradient_checkpointing,
            "bf16": self.bf16,
            "fp16": self.fp16,
            "optim": self.optim,
        }
        if self.optim_args:
            kwargs["optim_args"] = self.optim_args
        if self.use_liger_kernel:
            kwargs["use_liger_kernel"] = True
        if self.optim_target_modules:
            # the Trainer reads "all-linear" only as a string (in a list it is a module name)
            targets = list(self.optim_target_modules)
            kwargs["optim_target_modules"] = "all-linear" if targets == ["all-linear"] else targets
        if self.gradient_checkpointing:
            kwargs["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
            if self.offload_activations:
                kwargs["gradient_checkpointing_kwargs"]["offload"] = True
        if self.fsdp is not None:
            kwargs.update(self.fsdp)
        if self.deepspeed is not None:  # the plan's peak depends on this layout (TrainingArguments takes a dict)
            kwargs["deepspeed"] = self.deepspeed
        return kwargs


@dataclass
class PlanResult:
    plan: Plan
    estimate: MemoryEstimate
    alternatives: list[Candidate]
    candidates_tried: int  # estimated (`lazy_grid.py` leaves out those that could not change the plan)
    candidates_searched: int = 0  # the settings of the grids searched

    def to_dict(self) -> dict:
        return {
            "plan": self.plan.to_dict(),
            "estimate": self.estimate.to_dict(),
            "alternatives": [alternative_dict(c, self.plan) for c in self.alternatives],
        }


def alternative_dict(c: Candidate, plan: Plan) -> dict:
    s = c.settings
    return {
        "per_device_train_batch_size": s.batch_size,
        "gradient_accumulation_steps": s.gradient_accumulation_steps,
        "gradient_checkpointing": s.gradient_checkpointing,
        "optim": s.optim,
        "zero_stage": s.zero_stage,
        "offload_optimizer": s.offload_optimizer,
        "offload_param": s.offload_param,
        "fsdp": s.fsdp,
        "fsdp_version": s.fsdp_version if s.fsdp else None,
        "fsdp_offload": s.fsdp_offload,
        "sp_size": s.sp_size,
        "cp_size": s.cp_size,
        "frozen": list(s.frozen) if s.frozen else None,
        "precision": s.precision,
        "offload_activations": s.offload_activations,
        "use_liger_kernel": s.use_liger_kernel,
        "tiled_mlp": s.tiled_mlp,
        "fits": c.fits,
        "device_total_bytes": c.estimate.device_total_bytes,
        "predicted_step_seconds": round(c.step_seconds, 4),
        "why_not": c.why_not,
    }

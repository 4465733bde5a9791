"""What is being estimated: one training step, described as the HF Trainer would run it.

`TrainSettings` is the input of both estimator modes and the unit the planner
searches over. It holds only plain values (no torch), so the fast path never
imports torch. `validate()` collects every problem and reports them at once.
"""

from dataclasses import asdict, dataclass, field, replace

from hf_memfit.errors import check_all
from hf_memfit.optimizers import OPTIMIZERS  # the one optimizer model: every optim name we plan

TASKS = ("causal-lm", "seq-cls", "seq2seq")
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp16")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")
OFFLOAD_TARGETS = ("none", "cpu", "nvme")
DEVICES = ("cuda", "cpu")
MODES = ("fast", "exact")
# The training step's loss: the HF Trainer's (the model's own loss over the full logits), or a TRL
# trainer's, which patches the model with a fused LM head (trl.trainer.utils.add_fused_lm_head) that
# never materializes the logits; DPO also runs chosen and rejected rows together and a reference forward.
TRAINERS = ("trainer", "sft", "dpo")
# DPO's reference log-probs: a separate frozen copy of the model, the same model with its LoRA adapters
# disabled, or precomputed over the dataset before training (no reference forward in the step).
REFERENCE_MODELS = ("copy", "adapters", "precomputed")

@dataclass(frozen=True)
class TrainSettings:
    """One training step: the data shape, the precision and every memory knob.

    Field names follow `TrainingArguments` / `from_pretrained` where one exists.
    """

    batch_size: int = 1  # per-device micro-batch
    seq_len: int = 512
    task: str | None = None  # None: the model's default task
    num_labels: int = 2
    precision: str = "fp32"
    optim: str = "adamw_torch"
    optim_args: str | None = None  # TrainingArguments.optim_args: "bf16_stochastic_round=True", "rank=64", ...
    optim_target_modules: tuple[str, ...] | None = None  # GaLore / APOLLO: module names, or ("all-linear",)
    gradient_checkpointing: bool = False
    attn_implementation: str | None = None  # None: transformers' default (sdpa)
    gradient_accumulation_steps: int = 1
    lora_r: int | None = None
    lora_alpha: int | None = None  # None: peft's default (8)
    lora_target_modules: tuple[str, ...] | None = None  # None: peft's default for the model type
    load_in_4bit: bool = False
    num_gpus: int = 1  # per node
    num_nodes: int = 1
    zero_stage: int = 0  # 0: plain DDP (or one GPU); 1/2/3: DeepSpeed ZeRO; FSDP full-shard ~ 3
    offload_optimizer: str = "none"
    offload_param: str = "none"
    device: str = "cuda"
    gpu: str | None = None  # a hardware.py name; decides flash support and CUDA overheads
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    mode: str = "fast"
    # What the trainer's step runs beyond the model (TRL); see TRAINERS and REFERENCE_MODELS.
    trainer: str = "trainer"
    padding_free: bool = False  # the micro-batch's rows are concatenated into one row (TRL padding_free / bfd packing)
    reference_model: str | None = None  # DPO only; None: "adapters" under LoRA, else "copy"
    decoder_seq_len: int | None = None  # seq2seq: the label / decoder length; None: seq_len

    @property
    def world_size(self) -> int:
        return self.num_gpus * self.num_nodes

    @property
    def uses_lora(self) -> bool:
        return self.lora_r is not None or self.load_in_4bit

    @property
    def optimizer_family(self) -> str:
        return OPTIMIZERS[self.optim].family

    @property
    def optimizer(self):
        """The `optimizers.Optimizer` model of `optim`."""
        return OPTIMIZERS[self.optim]

    @property
    def weights_dtype(self) -> str:
        """The dtype the weights are stored in ("float32", "bfloat16", "float16")."""
        return {"bf16": "bfloat16", "fp16": "float16"}.get(self.precision, "float32")

    @property
    def autocast_dtype(self) -> str | None:
        """The autocast dtype for the *-mixed precisions, else None."""
        return {"bf16-mixed": "bfloat16", "fp16-mixed": "float16"}.get(self.precision)

    @property
    def compute_dtype(self) -> str:
        return self.autocast_dtype or self.weights_dtype

    @property
    def reference(self) -> str | None:
        """DPO's reference model as it runs ("copy", "adapters", "precomputed"); None outside DPO."""
        if self.trainer != "dpo":
            return None
        return self.reference_model or ("adapters" if self.uses_lora else "copy")

    @property
    def rows(self) -> int:
        """Rows of the batch the model sees: DPO concatenates chosen and rejected; padding-free packs all in one."""
        if self.padding_free:
            return 1
        return self.batch_size * (2 if self.trainer == "dpo" else 1)

    @property
    def row_len(self) -> int:
        """Tokens per row of the batch the model sees."""
        if self.padding_free:
            return self.batch_size * (2 if self.trainer == "dpo" else 1) * self.seq_len
        return self.seq_len

    def replace(self, **changes) -> "TrainSettings":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("lora_target_modules", "optim_target_modules"):
            if d[name] is not None:
                d[name] = list(d[name])
        return d

    def validate(self, spec=None) -> "TrainSettings":
        """Check every field (and, given a ModelSpec, the model-dependent ones); raise all problems at once.

        Returns the settings with `task` resolved to the model's default when it was None.
        """
        problems = []
        for name in ("batch_size", "seq_len", "num_labels", "gradient_accumulation_steps", "num_gpus", "num_nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                problems.append(f"`--{name.replace('_', '-')}` must be a positive integer, got {value!r}")
        choices = {
            "precision": PRECISIONS, "device": DEVICES, "mode": MODES,
            "offload_optimizer": OFFLOAD_TARGETS, "offload_param": OFFLOAD_TARGETS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                problems.append(f"`--{name.replace('_', '-')}` must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if self.task is not None and self.task not in TASKS:
            problems.append(f"`--task` must be one of {', '.join(TASKS)}; got {self.task!r}")
        if self.attn_implementation is not None and self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            problems.append(f"`--attn-implementation` must be one of {', '.join(ATTN_IMPLEMENTATIONS)}; got {self.attn_implementation!r}")
        if self.optim not in OPTIMIZERS:
            problems.append(f"`--optim` {self.optim!r} is not modelled; use one of {', '.join(OPTIMIZERS)}")
        elif OPTIMIZERS[self.optim].low_rank:
            optimizer = OPTIMIZERS[self.optim]
            if not self.optim_target_modules:
                problems.append(f"`--optim {self.optim}` needs `--optim-target-modules` (module names such as "
                                "q_proj,v_proj, or all-linear), as the Trainer does")
            if optimizer.layerwise and self.gradient_accumulation_steps > 1:
                problems.append(f"`--optim {self.optim}` steps inside backward and cannot accumulate gradients: "
                                "use `--gradient-accumulation-steps 1`")
            if optimizer.layerwise and self.world_size > 1:
                problems.append(f"`--optim {self.optim}` does not support DDP (the Trainer refuses it): use one GPU")
            if self.zero_stage:
                problems.append(f"`--optim {self.optim}` projects 2-D gradients; ZeRO hands the optimizer a flat "
                                "partition: drop `--zero-stage`")
            if self.uses_lora:
                problems.append(f"`--optim {self.optim}` is a full fine-tuning optimizer: drop `--lora-r`")
        if self.optim_target_modules and (self.optim not in OPTIMIZERS or not OPTIMIZERS[self.optim].low_rank):
            problems.append("`--optim-target-modules` is for GaLore / APOLLO optimizers (`--optim galore_adamw`, ...)")
        if self.zero_stage not in (0, 1, 2, 3):
            problems.append(f"`--zero-stage` must be 0, 1, 2 or 3; got {self.zero_stage!r}")
        if self.lora_r is not None and (not isinstance(self.lora_r, int) or self.lora_r <= 0):
            problems.append(f"`--lora-r` must be a positive integer, got {self.lora_r!r}")
        if self.lora_alpha is not None and self.lora_r is None and not self.load_in_4bit:
            problems.append("`--lora-alpha` needs `--lora-r` (LoRA is off without it)")
        if self.lora_target_modules is not None and self.lora_r is None and not self.load_in_4bit:
            problems.append("`--lora-target-modules` needs `--lora-r` (LoRA is off without it)")
        if self.zero_stage == 0 and (self.offload_optimizer != "none" or self.offload_param != "none"):
            problems.append("offloading needs DeepSpeed: add `--zero-stage 2` (optimizer) or `--zero-stage 3` (parameters)")
        if self.offload_param != "none" and self.zero_stage != 3:
            problems.append("`--offload-param` needs `--zero-stage 3`: only ZeRO-3 partitions parameters")
        if self.offload_optimizer == "nvme" and self.zero_stage != 3:
            problems.append("`--offload-optimizer nvme` needs `--zero-stage 3` (ZeRO-Infinity)")
        if self.load_in_4bit and self.precision in ("fp32",):
            problems.append("`--load-in-4bit` computes in half precision: add `--precision bf16-mixed` or `--precision fp16-mixed`")
        if self.load_in_4bit and self.zero_stage == 3:
            problems.append("`--load-in-4bit` cannot be combined with `--zero-stage 3` (4-bit weights are not partitioned)")
        if self.device == "cpu" and self.zero_stage and self.world_size > 1:
            # DeepSpeed runs on the CPU in one process (its multi-process CPU launch is not supported
            # by the Trainer); DDP over CPU processes (gloo) is modelled per process.
            problems.append("`--device cpu` with `--zero-stage` estimates one DeepSpeed process: drop `--num-gpus/--num-nodes`")
        if self.trainer not in TRAINERS:
            problems.append(f"`--trainer` must be one of {', '.join(TRAINERS)}; got {self.trainer!r}")
        if self.reference_model is not None and self.reference_model not in REFERENCE_MODELS:
            problems.append(f"`--reference-model` must be one of {', '.join(REFERENCE_MODELS)}; got {self.reference_model!r}")
        if self.reference_model is not None and self.trainer != "dpo":
            problems.append("`--reference-model` is a DPO setting: add `--trainer dpo`")
        if self.reference_model == "adapters" and not self.uses_lora:
            problems.append("`--reference-model adapters` needs LoRA (`--lora-r`): a full fine-tune has no adapters to disable")
        if self.padding_free and self.trainer == "dpo":
            problems.append("`--padding-free` is not available for DPO in TRL 1.16 (DPOTrainer falls back to padding)")
        if self.decoder_seq_len is not None and (not isinstance(self.decoder_seq_len, int) or self.decoder_seq_len <= 0):
            problems.append(f"`--decoder-seq-len` must be a positive integer, got {self.decoder_seq_len!r}")
        if self.device == "cpu" and self.attn_implementation == "flash_attention_2":
            problems.append("`--attn-implementation flash_attention_2` needs `--device cuda`")
        if self.attn_implementation == "flash_attention_2" and self.compute_dtype == "float32":
            problems.append("`--attn-implementation flash_attention_2` runs in fp16/bf16 only: add `--precision "
                            "bf16-mixed` (or fp16-mixed), or use `--attn-implementation sdpa`")
        if self.load_in_4bit and self.lora_r is None:
            problems.append("`--load-in-4bit` trains LoRA adapters on the 4-bit base: add `--lora-r` (e.g. 16)")
        if self.gpu is not None and self.device == "cuda":
            problems += _gpu_problems(self)
        settings = self
        if spec is not None and not problems:
            settings, model_problems = _validate_against_model(self, spec)
            problems += model_problems
        check_all(problems)
        return settings


def _gpu_problems(settings: TrainSettings) -> list[str]:
    """What the named GPU cannot run: bf16 before Ampere, flash-attention-2 before sm80."""
    from hf_memfit.errors import MemFitError
    from hf_memfit.hardware import find_gpu

    try:
        gpu = find_gpu(settings.gpu)
    except MemFitError as error:
        return [str(error)]
    problems = []
    if settings.precision.startswith("bf16") and not gpu.supports_bf16:
        fix = settings.precision.replace("bf16", "fp16")
        problems.append(f"`--precision {settings.precision}`: the {gpu.name} has no bf16 support; use "
                        f"`--precision {fix}`")
    if settings.attn_implementation == "flash_attention_2" and not gpu.supports_flash_attention:
        problems.append(f"`--attn-implementation flash_attention_2` needs compute capability 8.0+, and the {gpu.name} "
                        f"is {gpu.compute_capability[0]}.{gpu.compute_capability[1]}; use `--attn-implementation sdpa`")
    return problems


def _validate_against_model(settings: TrainSettings, spec) -> tuple[TrainSettings, list[str]]:
    problems = []
    task = settings.task or spec.default_task
    if task not in spec.supported_tasks:
        problems.append(f"`--task {task}` is not available for {spec.model_type} models; use one of {', '.join(spec.supported_tasks)}")
    if settings.trainer != "trainer" and task != "causal-lm":
        problems.append(f"`--trainer {settings.trainer}` trains causal language models; {spec.name} is planned as {task}")
    if settings.decoder_seq_len is not None and task != "seq2seq":
        problems.append("`--decoder-seq-len` is for encoder-decoder (seq2seq) models")
    limit = spec.max_position_embeddings
    # (padding-free rows restart their position ids at every packed sequence: the limit is per sequence)
    if limit is not None and settings.seq_len > limit:
        problems.append(f"`--seq-len {settings.seq_len}` is over {spec.name}'s maximum of {limit} positions; use `--seq-len {limit}` or less")
    if settings.optim_target_modules and settings.optim_target_modules != ("all-linear",):
        known = sorted({m.name for m in spec.linear_modules()})
        missing = [m for m in settings.optim_target_modules if m not in known]
        if missing:
            problems.append(f"`--optim-target-modules` {', '.join(missing)} not found in {spec.name}; its linear "
                            f"modules are {', '.join(known)} (or use all-linear)")
    if settings.uses_lora and settings.lora_target_modules is not None:
        known = sorted({m.name for m in spec.linear_modules()})
        missing = [m for m in settings.lora_target_modules if m not in known]
        if missing:
            problems.append(f"`--lora-target-modules` {', '.join(missing)} not found in {spec.name}; its linear modules are {', '.join(known)}")
    return settings.replace(task=task), problems

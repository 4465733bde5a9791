"""What is being estimated: one training step, described as the HF Trainer would run it.

`TrainSettings` is the input of both estimator modes and the unit the planner
searches over. It holds only plain values (no torch), so the fast path never
imports torch. `validate()` collects every problem and reports them at once.
"""

from dataclasses import asdict, dataclass, field, replace

from hf_memfit.errors import MemFitError, check_all
from hf_memfit.tasks import MEDIA_TASKS, PIPELINE_TAGS, TASKS, task_named
from hf_memfit.optimizers import OPTIMIZERS, parse_optim_args  # the one optimizer model: every optim name we plan

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp16")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")
OFFLOAD_TARGETS = ("none", "cpu", "nvme")
# TrainingArguments `--fsdp` sharding strategies (accelerate's FSDP_SHARDING_STRATEGY, lower case). FSDP2
# (`fully_shard`) expresses full_shard / shard_grad_op as reshard_after_forward True / False; the Trainer
# accepts no_shard and hybrid_shard only with FSDP1 (`fsdp_config["version"] = 1`).
FSDP_STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")
FSDP_VERSIONS = (1, 2)
QUANT_STORAGE_DTYPES = ("uint8", "bfloat16", "float16", "float32")
DEVICES = ("cuda", "cpu")
# Model types whose causal-LM forward Liger replaces with its fused linear cross-entropy
# (liger_kernel/transformers/monkey_patch.py, MODEL_TYPE_TO_APPLY_LIGER_FN; transformers'
# `use_liger_kernel` calls `_apply_liger_kernel_to_instance`, a no-op for other types).
LIGER_MODEL_TYPES = frozenset({"llama", "mistral", "mixtral", "gemma", "gemma2", "qwen2", "qwen3", "phi3"})
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
    use_liger_kernel: bool = False  # TrainingArguments.use_liger_kernel: Liger's fused linear cross-entropy head
    # activation_checkpointing_kwargs={"offload": True}: each checkpointed layer's saved input goes to pinned host memory
    offload_activations: bool = False
    attn_implementation: str | None = None  # None: transformers' default (sdpa)
    gradient_accumulation_steps: int = 1
    lora_r: int | None = None
    lora_alpha: int | None = None  # None: peft's default (8)
    lora_target_modules: tuple[str, ...] | None = None  # None: peft's default for the model type
    # peft's `target_modules` given as one string: a regex each module's full name must match (peft's
    # `check_target_module_exists`), e.g. r".*language_model.*\.(q_proj|v_proj)" for a VLM's language model only.
    # Layers are traced at 2-3 per stack and extrapolated, so a pattern must treat every layer alike.
    lora_target_regex: str | None = None
    load_in_4bit: bool = False
    # LLM.int8() base weights (`BitsAndBytesConfig(load_in_8bit=True)`): int8 + per-row fp32 scales, LoRA on top
    # (estimator/int8.py).
    load_in_8bit: bool = False
    num_gpus: int = 1  # per node
    num_nodes: int = 1
    zero_stage: int = 0  # 0: plain DDP (or one GPU); 1/2/3: DeepSpeed ZeRO
    offload_optimizer: str = "none"
    offload_param: str = "none"
    fsdp: str | None = None  # a FSDP_STRATEGIES name: PyTorch FSDP as accelerate and the Trainer run it
    fsdp_version: int = 2  # 2 (fully_shard), the Trainer's default; 1: FullyShardedDataParallel
    fsdp_offload: bool = False  # CPUOffload: sharded parameters, gradients and the optimizer step on the host
    bnb_4bit_use_double_quant: bool = True  # the QLoRA recipe; BitsAndBytesConfig's own default is False
    bnb_4bit_quant_storage: str | None = None  # None: uint8 unsharded, the compute dtype when FSDP/ZeRO-3 shard it
    # peft's `prepare_model_for_kbit_training(model)` ran on the 4-bit model: every parameter bitsandbytes did
    # not pack (embeddings, LM head, norms) is upcast to fp32, and with an fp32 embedding the residual stream
    # stays fp32. None: as each stack does (`kbit_prepared`).
    prepare_model_for_kbit_training: bool | None = None
    device: str = "cuda"
    gpu: str | None = None  # a hardware.py name; decides flash support and CUDA overheads
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    mode: str = "fast"
    # What the trainer's step runs beyond the model (TRL); see TRAINERS and REFERENCE_MODELS.
    trainer: str = "trainer"
    padding_free: bool = False  # the micro-batch's rows are concatenated into one row (TRL padding_free / bfd packing)
    reference_model: str | None = None  # DPO only; None: "adapters" under LoRA, else "copy"
    decoder_seq_len: int | None = None  # seq2seq: the label / decoder length; None: seq_len
    # TRL's SFTConfig/DPOConfig `activation_offloading`: every tensor saved for backward in the training step
    # (>= 1 KiB, not a parameter) goes to pinned host memory and comes back in backward (TRL 1.16 OffloadActivations)
    activation_offloading: bool = False
    # ALST's TiledMLP (DeepSpeed ulysses_sp.TiledMLP, as Arctic Long Sequence Training, axolotl's `tiled_mlp`
    # and Liger's tiled MLPs apply it): each layer's MLP computed in sequence shards of about hidden_size tokens
    tiled_mlp: bool = False
    # Sequence parallelism (`estimator/sequence.py`): each of sp_size (or cp_size) ranks holds 1/sp of every
    # sequence. sp_size: Ulysses, DeepSpeed's all-to-all around attention (accelerate's
    # `ParallelismConfig(sp_size, sp_backend="deepspeed")`); cp_size: context parallelism, FSDP2 with torch's
    # ring attention (`ParallelismConfig(cp_size)`). accelerate 1.15 refuses both at once.
    sp_size: int = 1
    cp_size: int = 1
    # Image, audio and speech inputs (models/inputs.py): None takes the model's and its processor's own
    image_size: int | None = None  # pixels per side of an image as the processor feeds it
    images_per_sample: int | None = None  # vision-language rows: images per row (None: 1)
    audio_seconds: float | None = None  # the longest clip of a batch (Whisper pads to its 30 s window)
    label_len: int | None = None  # CTC / speech seq2seq labels: characters or tokens per row
    # Modules trained frozen (no gradients, no optimizer state): their names in the model, as named_modules()
    # gives them (`wav2vec2.feature_extractor` after freeze_feature_encoder(), `model.vision_tower`, ...)
    frozen: tuple[str, ...] | None = None
    # State-space mixers (models/ssm.py): "cuda", the mamba-ssm / causal-conv1d kernels a GPU user runs;
    # "torch", transformers' torch fallback (what a CPU runs); None: "cuda" on --device cuda, else "torch"
    ssm_kernels: str | None = None

    @property
    def ssm_path(self) -> str:
        """The state-space kernel path the estimate is for: "cuda" or "torch"."""
        return self.ssm_kernels or ("cuda" if self.device == "cuda" else "torch")

    @property
    def world_size(self) -> int:
        return self.num_gpus * self.num_nodes

    @property
    def seq_shards(self) -> int:
        """Ranks one sequence is split over: sp_size x cp_size (at most one of them is above 1)."""
        return self.sp_size * self.cp_size

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: the world over the sequence shards. The global batch is micro x dp x accumulation."""
        return max(1, self.world_size // self.seq_shards)

    @property
    def local_seq_len(self) -> int:
        """Tokens of each row one rank computes outside attention: seq_len / (sp x cp)."""
        return self.seq_len // self.seq_shards

    @property
    def uses_lora(self) -> bool:
        return self.lora_r is not None or self.load_in_4bit

    @property
    def shards_parameters(self) -> bool:
        """Whether each rank stores only a shard of the parameters (ZeRO-3, FSDP full/grad-op/hybrid shard)."""
        return self.zero_stage == 3 or (self.fsdp is not None and self.fsdp != "no_shard")

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
    def load_in_kbit(self) -> bool:
        """Whether bitsandbytes quantizes the base (4-bit NF4 or 8-bit LLM.int8())."""
        return self.load_in_4bit or self.load_in_8bit

    @property
    def kbit_stand_in_bytes(self) -> int:
        """Bytes per weight of a quantized layer's stand-in as the trace builds it (fp32 only for an fp32 model
        without autocast, else 2); the 4-bit and int8 packings replace them by formula."""
        return 4 if self.weights_dtype == "float32" and not self.autocast_dtype else 2

    @property
    def kbit_prepared(self) -> bool:
        """Whether the 4-bit model runs as `prepare_model_for_kbit_training` leaves it.

        Unset, as each stack does: peft's QLoRA recipe, which user scripts for the plain Trainer follow on one
        GPU or under DDP; not TRL 1.16's trainers (which no longer call it), nor DeepSpeed or FSDP (which
        run the model in one dtype, and TRL skips the preparation for sharded QLoRA).
        """
        if self.prepare_model_for_kbit_training is not None:
            return self.prepare_model_for_kbit_training and self.load_in_kbit
        return self.load_in_kbit and self.trainer == "trainer" and not self.zero_stage and self.fsdp is None

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
        for name in ("lora_target_modules", "optim_target_modules", "frozen"):
            if d[name] is not None:
                d[name] = list(d[name])
        return d

    def validate(self, spec=None) -> "TrainSettings":
        """Check every field (and, given a ModelSpec, the model-dependent ones); raise all problems at once.

        Returns the settings with `task` resolved to the model's default when it was None, and a Hub pipeline tag
        to the task it names (`tasks.task_named`).
        """
        task = task_named(self.task, spec.supported_tasks if spec is not None else None)
        if task != self.task:
            return self.replace(task=task).validate(spec)
        problems = []
        for name in ("batch_size", "seq_len", "num_labels", "gradient_accumulation_steps", "num_gpus", "num_nodes",
                     "sp_size", "cp_size"):
            value = getattr(self, name)
            if name == "seq_len" and value is None and spec is not None:
                continue  # an image or audio task derives it from its inputs (spec.resolve_inputs)
            if not isinstance(value, int) or value <= 0:
                problems.append(f"`--{name.replace('_', '-')}` must be a positive integer, got {value!r}")
        choices = {
            "precision": PRECISIONS, "device": DEVICES, "mode": MODES,
            "offload_optimizer": OFFLOAD_TARGETS, "offload_param": OFFLOAD_TARGETS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                problems.append(f"`--{name.replace('_', '-')}` must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if self.ssm_kernels is not None and self.ssm_kernels not in ("cuda", "torch"):
            problems.append(f"`--ssm-kernels` must be cuda or torch; got {self.ssm_kernels!r}")
        if self.task is not None and self.task not in TASKS and self.task not in PIPELINE_TAGS:
            problems.append(f"`--task` must be one of {', '.join(TASKS)} (or a Hub pipeline tag: "
                            f"{', '.join(PIPELINE_TAGS)}); got {self.task!r}")
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
        if self.offload_activations and not self.gradient_checkpointing:
            problems.append("`--offload-activations` moves the checkpoints' saved inputs to the host: add "
                            "`--gradient-checkpointing`")
        if self.offload_activations and self.device != "cuda":
            problems.append("`--offload-activations` copies activations from a GPU to the host: it needs `--device cuda`")
        if self.activation_offloading and self.trainer not in ("sft", "dpo"):
            problems.append("`--activation-offloading` is TRL's (SFTConfig / DPOConfig): add `--trainer sft` or "
                            "`--trainer dpo`, or use `--offload-activations` (transformers' checkpoint offload)")
        if self.activation_offloading and self.device != "cuda":
            # TRL 1.16 offloads only tensors on the accelerator, and its OffloadActivations reads
            # torch.accelerator.current_accelerator().type, which fails on a torch without one.
            problems.append("`--activation-offloading` copies activations from a GPU to the host: it needs "
                            "`--device cuda`")
        if self.activation_offloading and self.offload_activations:
            problems.append("`--activation-offloading` already offloads the checkpoints' saved inputs: drop "
                            "`--offload-activations`")
        if self.tiled_mlp and spec is not None and not spec.tileable_mlp:
            problems.append(f"`--tiled-mlp` tiles a dense per-layer MLP; {spec.name}'s layers have none it can "
                            "tile (a mixture of experts, or no `mlp` module): drop `--tiled-mlp`")
        if self.use_liger_kernel and self.task not in (None, "causal-lm"):
            problems.append("`--use-liger-kernel` fuses the causal-LM head and loss: it needs `--task causal-lm`")
        if self.optim_args is not None and parse_optim_args(self.optim_args) is None:
            problems.append("`--optim-args` is comma-separated key=value pairs, as TrainingArguments.optim_args "
                            f"(e.g. 'bf16_stochastic_round=True'); got {self.optim_args!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            problems.append(f"`--zero-stage` must be 0, 1, 2 or 3; got {self.zero_stage!r}")
        if self.lora_r is not None and (not isinstance(self.lora_r, int) or self.lora_r <= 0):
            problems.append(f"`--lora-r` must be a positive integer, got {self.lora_r!r}")
        if self.lora_alpha is not None and self.lora_r is None and not self.load_in_4bit:
            problems.append("`--lora-alpha` needs `--lora-r` (LoRA is off without it)")
        if self.lora_target_modules is not None and self.lora_r is None and not self.load_in_4bit:
            problems.append("`--lora-target-modules` needs `--lora-r` (LoRA is off without it)")
        if self.lora_target_regex is not None:
            problems += _regex_problems(self)
        if self.zero_stage == 0 and (self.offload_optimizer != "none" or self.offload_param != "none"):
            problems.append("offloading needs DeepSpeed: add `--zero-stage 2` (optimizer) or `--zero-stage 3` (parameters)")
        if self.offload_param != "none" and self.zero_stage != 3:
            problems.append("`--offload-param` needs `--zero-stage 3`: only ZeRO-3 partitions parameters")
        if self.offload_optimizer == "nvme" and self.zero_stage != 3:
            problems.append("`--offload-optimizer nvme` needs `--zero-stage 3` (ZeRO-Infinity)")
        if self.load_in_4bit and self.precision in ("fp32",):
            problems.append("`--load-in-4bit` computes in half precision: add `--precision bf16-mixed` or `--precision fp16-mixed`")
        problems += self._fsdp_problems()
        problems += self._sequence_problems()
        if self.device == "cpu" and self.zero_stage and self.world_size > 1 and self.sp_size == 1:
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
        problems += self._kbit_preparation_problems()
        problems += self._int8_problems()
        if self.gpu is not None and self.device == "cuda":
            problems += _gpu_problems(self)
        settings = self
        if spec is not None and not problems:
            settings, model_problems = _validate_against_model(settings, spec)
            problems += model_problems
        check_all(problems)
        return settings

    def _kbit_preparation_problems(self) -> list[str]:
        if not self.prepare_model_for_kbit_training:
            return []
        flag = "`--prepare-model-for-kbit-training yes`"
        if not self.load_in_kbit:
            return [f"{flag} upcasts what bitsandbytes left unpacked on a 4-bit or 8-bit model: add `--load-in-4bit` "
                    "or `--load-in-8bit`, or `--prepare-model-for-kbit-training no`"]
        if self.zero_stage or self.fsdp is not None:
            # DeepSpeed's engine casts the module to its compute dtype; FSDP flattens parameters of one dtype.
            return [f"{flag}: DeepSpeed and FSDP run the model in one dtype, so its fp32 parameters do not survive "
                    "(TRL skips it for sharded QLoRA): use `--prepare-model-for-kbit-training no`"]
        return []

    def _int8_problems(self) -> list[str]:
        if not self.load_in_8bit:
            return []
        if self.load_in_4bit:
            return ["`--load-in-8bit` and `--load-in-4bit` are two ways to quantize the base: pick one"]
        if self.lora_r is None:
            # transformers refuses to train a purely quantized model (Trainer: "You cannot perform fine-tuning on
            # purely quantized models. Please attach trainable adapters")
            return ["`--load-in-8bit` trains LoRA adapters on the int8 base: add `--lora-r` (e.g. 16)"]
        if self.shards_parameters:
            # bitsandbytes' Int8Params has no quant_storage (only Params4bit does): FSDP / ZeRO-3 cannot flatten it
            return ["`--load-in-8bit` with ZeRO-3 or FSDP sharding is not modelled (int8 weights cannot be sharded "
                    "like a 4-bit base stored in the compute dtype): use `--load-in-4bit`, or ZeRO-1/2 or DDP"]
        return []

    def _sequence_problems(self) -> list[str]:
        """What accelerate 1.15, DeepSpeed 0.19 and torch refuse about sp_size / cp_size (model-free checks)."""
        sp, cp = self.sp_size, self.cp_size
        if not all(isinstance(v, int) and v > 0 for v in (sp, cp)) or sp == cp == 1:
            return []
        problems = []
        if sp > 1 and cp > 1:  # accelerate ParallelismConfig.__post_init__
            return ["`--sp-size` and `--cp-size` are two ways to split the sequence (accelerate refuses both at once): "
                    "pick one"]
        if self.world_size % (sp * cp):
            flag = "--sp-size" if sp > 1 else "--cp-size"
            problems.append(f"`{flag} {sp * cp}` must divide the {self.world_size} GPU(s): use a divisor of "
                            f"{self.world_size} or `--num-gpus` a multiple of {sp * cp}")
        if sp > 1 and not self.zero_stage:
            # accelerate wraps attention for Ulysses only in its DeepSpeed prepare path (accelerator.py,
            # `_prepare_deepspeed`: UlyssesSPAttentionHF.register_with_transformers), and DeepSpeed's engine
            # is what averages gradients over the sequence-data-parallel group.
            problems.append(f"`--sp-size {sp}` is DeepSpeed's Ulysses: add `--zero-stage 1` (or 2, 3)")
        if sp > 1 and self.fsdp is not None:
            problems.append(f"`--sp-size {sp}` runs under DeepSpeed, not FSDP: drop `--fsdp`, or use `--cp-size`")
        if cp > 1 and (self.fsdp is None or self.fsdp_version != 2 or self.zero_stage):
            # accelerate builds context parallelism on FSDP2's device mesh (`dp_shard_cp`), and refuses it with
            # pure replication (ParallelismConfig: cp with dp_replicate > 1 and dp_shard == 1).
            problems.append(f"`--cp-size {cp}` is accelerate's FSDP2 context parallelism: use `--fsdp full_shard` "
                            "(FSDP2) and no `--zero-stage`")
        if self.seq_len % (sp * cp):
            # DeepSpeed's UlyssesSPDataLoaderAdapter: "batch's seqlen isn't divisible by sp-size"; torch's
            # context_parallel shards each buffer into cp equal chunks.
            flag = "--sp-size" if sp > 1 else "--cp-size"
            low = self.seq_len // (sp * cp) * sp * cp
            problems.append(f"`--seq-len {self.seq_len}` must be divisible by `{flag} {sp * cp}`: use "
                            f"{low or sp * cp} or {low + sp * cp}")
        if sp > 1 and self.attn_implementation == "eager":
            # accelerate DeepSpeedSequenceParallelConfig: 'eager' and 'flex_attention' are not supported
            problems.append(f"`--sp-size {sp}` wraps attention through transformers' attention interface, which "
                            "Ulysses supports for sdpa and flash_attention_2, not eager: use `--attn-implementation sdpa`")
        if cp > 1 and self.attn_implementation not in (None, "sdpa"):
            # transformers Trainer._prepare_context_parallel_inputs: "Context parallelism is supported only with SDPA"
            problems.append(f"`--cp-size {cp}` patches SDPA with ring attention (torch context_parallel): use "
                            "`--attn-implementation sdpa`")
        if self.padding_free:
            problems.append("`--padding-free` packs rows with their own position ids; hf-memfit plans sequence "
                            "parallelism for whole rows only: drop `--padding-free`")
        if self.device == "cpu" and cp > 1:
            problems.append(f"`--cp-size {cp}` needs `--device cuda`: torch's context parallel SDPA dispatches to "
                            "CUDA flash / efficient kernels (see docs/benchmarks.md, section 14)")
        return problems

    def _fsdp_problems(self) -> list[str]:
        problems = []
        if self.fsdp is not None and self.fsdp not in FSDP_STRATEGIES:
            problems.append(f"`--fsdp` must be one of {', '.join(FSDP_STRATEGIES)}; got {self.fsdp!r}")
        if self.fsdp_version not in FSDP_VERSIONS:
            problems.append(f"`--fsdp-version` must be 1 or 2; got {self.fsdp_version!r}")
        elif self.fsdp in ("no_shard", "hybrid_shard") and self.fsdp_version == 2:
            # transformers' TrainingArguments refuses these with FSDP2 (`_apply_legacy_fsdp_to_config`).
            problems.append(f"`--fsdp {self.fsdp}` is FSDP1 only (as in the Trainer): add `--fsdp-version 1`")
        if self.fsdp is not None and self.zero_stage:
            problems.append("`--fsdp` and `--zero-stage` are two ways to shard: pick one")
        if self.fsdp is not None and (self.offload_optimizer != "none" or self.offload_param != "none"):
            problems.append("`--offload-optimizer/--offload-param` are DeepSpeed's: with `--fsdp` use `--fsdp-offload`")
        if self.fsdp_offload and self.fsdp is None:
            problems.append("`--fsdp-offload` needs `--fsdp full_shard` (or another `--fsdp` strategy)")
        if self.fsdp_offload and self.fsdp == "no_shard":
            problems.append("`--fsdp-offload` with `--fsdp no_shard` offloads whole replicas: use `--fsdp full_shard`")
        if self.bnb_4bit_quant_storage is not None and self.bnb_4bit_quant_storage not in QUANT_STORAGE_DTYPES:
            problems.append(f"`--bnb-4bit-quant-storage` must be one of {', '.join(QUANT_STORAGE_DTYPES)}; "
                            f"got {self.bnb_4bit_quant_storage!r}")
        if self.load_in_4bit and self.shards_parameters and self.bnb_4bit_quant_storage == "uint8":
            # FSDP flattens / shards a unit's parameters in one dtype and ZeRO-3 partitions by dtype: the
            # packed weights must be stored in the dtype of the rest (peft docs, "FSDP+QLoRA").
            problems.append(f"sharded 4-bit weights need `--bnb-4bit-quant-storage {self.compute_dtype}` "
                            "(the compute dtype), not uint8")
        return problems


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
    supported = task in spec.supported_tasks
    if not supported:
        problems.append(f"`--task {task}` is not available for {spec.model_type} models; use one of {', '.join(spec.supported_tasks)}")
    if settings.use_liger_kernel and spec.model_type not in LIGER_MODEL_TYPES:
        problems.append(f"`--use-liger-kernel` does nothing for {spec.model_type} models: Liger patches "
                        f"{', '.join(sorted(LIGER_MODEL_TYPES))}")
    if settings.use_liger_kernel and task != "causal-lm":
        problems.append("`--use-liger-kernel` fuses the causal-LM head and loss: it needs `--task causal-lm`")
    if settings.trainer != "trainer" and task not in ("causal-lm", "image-text-to-text"):
        problems.append(f"`--trainer {settings.trainer}` trains causal language models; {spec.name} is planned as {task}")
    if settings.decoder_seq_len is not None and task != "seq2seq":
        problems.append("`--decoder-seq-len` is for encoder-decoder (seq2seq) models")
    limit = spec.max_position_embeddings
    # A learned position table has `limit` rows, so no sequence can be longer; rotary and other positions have
    # no table and train past the configured length (the estimate notes it: `beyond_positions_note`).
    # (padding-free rows restart their position ids at every packed sequence: the limit is per sequence)
    if limit is not None and spec.learned_positions and task not in MEDIA_TASKS and (settings.seq_len or 0) > limit:
        problems.append(f"`--seq-len {settings.seq_len}` is over {spec.name}'s maximum of {limit} positions; use `--seq-len {limit}` or less")
    problems += _sequence_model_problems(settings, spec, task)
    problems += spec.ssm_kernel_problems(settings)  # models/ssm.py: what mamba-ssm / causal-conv1d refuse
    if settings.optim_target_modules and settings.optim_target_modules != ("all-linear",):
        known = sorted({m.name for m in spec.linear_modules()})
        missing = [m for m in settings.optim_target_modules if m not in known]
        if missing:
            problems.append(f"`--optim-target-modules` {', '.join(missing)} not found in {spec.name}; its linear "
                            f"modules are {', '.join(known)} (or use all-linear)")
    if settings.uses_lora and settings.lora_target_modules is None and settings.lora_target_regex is None:
        try:  # peft raises (a traceback, mid-trace) for a model type it has no default targets for: say so here
            spec.default_lora_target_modules()
        except MemFitError as exc:
            problems.append(str(exc))
    if settings.uses_lora and settings.lora_target_modules is not None:
        known = sorted({m.name for m in spec.linear_modules()})
        missing = [m for m in settings.lora_target_modules if m not in known and m != "all-linear"]
        if missing:
            problems.append(f"`--lora-target-modules` {', '.join(missing)} not found in {spec.name}; its linear modules are {', '.join(known)}")
    if not supported:  # the inputs of a task the model does not do: asking for them misleads
        return settings, problems
    settings, input_problems = spec.resolve_inputs(settings.replace(task=task))
    return settings, problems + input_problems



def _regex_problems(settings: TrainSettings) -> list[str]:
    """`--lora-target-regex`: LoRA on, one way of naming the targets, and a pattern Python's `re` compiles."""
    import re

    if settings.lora_r is None and not settings.load_in_4bit:
        return ["`--lora-target-regex` needs `--lora-r` (LoRA is off without it)"]
    if settings.lora_target_modules is not None:
        return ["`--lora-target-regex` and `--lora-target-modules` are two ways to name LoRA's targets: give one"]
    try:
        re.compile(settings.lora_target_regex)
    except re.error as exc:
        return [f"`--lora-target-regex {settings.lora_target_regex}` is not a regular expression ({exc}); peft "
                "matches it against each module's full name, e.g. '.*language_model.*\\.(q_proj|v_proj)'"]
    return []

def _sequence_model_problems(settings: TrainSettings, spec, task: str) -> list[str]:
    """What sp_size / cp_size need of the model: heads that split, and a model the libraries can shard."""
    sp, cp = settings.sp_size, settings.cp_size
    if sp == 1 and cp == 1:
        return []
    flag = f"--sp-size {sp}" if sp > 1 else f"--cp-size {cp}"
    problem = spec.sequence_shard_problem("ulysses" if sp > 1 else "ring")
    if problem is None and task != "causal-lm":
        problem = f"it is planned as {task}; sequence parallelism trains causal LMs (its loss reads `shift_labels`)"
    if problem is not None:
        return [f"`{flag}`: the installed libraries cannot shard {spec.name}'s sequence: {problem}; drop `{flag.split()[0]}`"]
    problems = []
    heads, kv = spec.num_attention_heads, spec.num_key_value_heads
    if sp > 1 and heads % sp:
        # deepspeed ulysses_sp.py UlyssesSPAttentionHF: "Attention head count ... is not divisible by SP size"
        fits = [d for d in range(2, sp) if heads % d == 0 and settings.world_size % d == 0]
        problems.append(f"`--sp-size {sp}` must divide {spec.name}'s {heads} attention heads"
                        + (f": use `--sp-size {fits[-1]}`" if fits else ""))
    elif sp > 1 and kv % sp and sp % kv:
        # UlyssesSPAttentionHF: KV heads divisible by sp, or sp by the KV heads (then they are replicated)
        problems.append(f"`--sp-size {sp}` and {spec.name}'s {kv} KV heads must divide one another (DeepSpeed "
                        "replicates KV heads only when sp is a multiple of them)")
    return problems


def beyond_positions_note(settings: TrainSettings, spec) -> str | None:
    """A note for a sequence longer than a rotary-position model's configured positions (memory is not limited)."""
    limit = spec.max_position_embeddings
    if limit is None or spec.learned_positions or settings.task in MEDIA_TASKS or settings.seq_len <= limit:
        return None
    return (f"`--seq-len {settings.seq_len}` is beyond {spec.name}'s max_position_embeddings of {limit}: it has no "
            "position table, so it trains at this length and the estimate is for it, but quality past the trained "
            "context usually needs RoPE scaling (`rope_scaling`) or long-context data")

"""What a live trainer will run, read off its model, its prepared data and its launcher.

The MemFit trainers plan from these facts rather than from what the user
passed: the model after any wrapping (peft adapters applied by a TRL trainer,
the attention implementation it was loaded with), the longest batch the
prepared dataset and the collator really produce (TRL's packing and
padding-free, DPO's chosen + rejected rows, a seq2seq model's label length),
and the sharding the launcher or a DeepSpeed / FSDP config already fixes.
Everything here reads; nothing changes the trainer.
"""

from __future__ import annotations

import heapq
import logging
import os
from dataclasses import dataclass, field

import torch

from hf_memfit.errors import CannotEstimate, MemFitError
from hf_memfit.tasks import MEDIA_TASKS

logger = logging.getLogger(__name__)

_TASK_BY_CLASS_SUFFIX = {"ForCausalLM": "causal-lm", "ForSequenceClassification": "seq-cls",
                         "ForConditionalGeneration": "seq2seq", "ForSeq2SeqLM": "seq2seq",
                         "ForTokenClassification": "token-cls"}

# A tokenizer with no length limit reports model_max_length = int(1e30); anything this large is not a limit.
_NO_LIMIT = 1_000_000
# Rows the longest-batch probe collates: the longest few by token count (and by each token column).
_PROBE_ROWS = 8


@dataclass
class DataShape:
    """The longest micro-batch row the trainer will see, and how it was found."""

    seq_len: int
    decoder_seq_len: int | None = None  # seq2seq: the labels' length
    padding_free: bool = False  # the collator concatenates the micro-batch into one row
    notes: list[str] = field(default_factory=list)


# --- the model ------------------------------------------------------------------------

def base_model(model):
    """The transformers model under any peft wrapping."""
    return getattr(model, "get_base_model", lambda: model)()


def model_task(model) -> str | None:
    """The task of the model's class: the hf-memfit task whose Auto class builds exactly this class, else by suffix."""
    from transformers.models.auto import modeling_auto

    from hf_memfit.tasks import TASK_TABLE

    base = base_model(model)
    name, model_type = type(base).__name__, getattr(base.config, "model_type", None)
    # image / audio tasks first: transformers maps Gemma-3's causal LM to its image-text class too
    for task in sorted(TASK_TABLE, key=lambda t: t not in MEDIA_TASKS):
        if getattr(modeling_auto, TASK_TABLE[task].mapping, {}).get(model_type) == name and task != "seq2seq":
            return task
    return next((task for suffix, task in _TASK_BY_CLASS_SUFFIX.items() if name.endswith(suffix)), None)


def lora_settings(model) -> dict:
    """r, lora_alpha and target_modules of the model's (first) peft adapter; {} without one."""
    config = getattr(model, "peft_config", None)
    if not config:
        return {}
    lora = next(iter(config.values()))
    targets = lora.target_modules
    return {"r": getattr(lora, "r", None), "lora_alpha": getattr(lora, "lora_alpha", None),
            "target_modules": tuple(sorted(targets)) if isinstance(targets, (set, list, tuple)) else None,
            # a string is a regex peft full-matched (or its "all-linear" shorthand)
            "target_regex": targets if isinstance(targets, str) and targets != "all-linear" else None,
            **({"target_modules": ("all-linear",)} if targets == "all-linear" else {})}


def attention_implementation(model) -> str | None:
    """The attention the model runs ("eager", "sdpa", "flash_attention_2"), or None for one we do not model."""
    value = getattr(base_model(model).config, "_attn_implementation", None)
    return value if value in ("eager", "sdpa", "flash_attention_2") else None


def model_precision(model, args, on_gpu: bool) -> str | None:
    """The precision the run trains in, from the loaded weights and the mixed-precision flags; None: let the plan pick."""
    base = base_model(model)
    dtype = next(base.parameters()).dtype
    if getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False):
        return "bf16-mixed" if args.bf16 or not args.fp16 else "fp16-mixed"
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if not on_gpu:
        return "bf16-mixed" if args.bf16 else "fp32"
    return None


def model_is_kbit_prepared(base) -> bool:
    """Whether a 4-bit model went through peft's `prepare_model_for_kbit_training`: its input embedding in fp32.

    The preparation casts every half-precision parameter bitsandbytes did not pack to fp32; a 4-bit model
    loaded as it is keeps its embedding in the compute dtype.
    """
    embedding = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    return embedding is not None and embedding.weight.dtype == torch.float32


# --- the launcher -----------------------------------------------------------------------

# The packages transformers' state-space mixers resolve their CUDA kernels from
# (`integrations/hub_kernels.use_kernel_func_from_hub_with_fallback`: the package if it imports, else torch).
SSM_KERNEL_PACKAGES = ("mamba_ssm", "causal_conv1d")


def ssm_kernel_path(spec, on_gpu: bool, notes: list[str]) -> str | None:
    """The path this run's state-space mixers take: "cuda" where both kernel packages are installed, else the
    torch fallback (on a GPU without them transformers falls back too); None for a model without mixers."""
    import importlib.util

    if not spec.ssm_mixers:
        return None
    if not on_gpu:
        return "torch"
    missing = [name for name in SSM_KERNEL_PACKAGES if importlib.util.find_spec(name) is None]
    if not missing:
        return "cuda"
    notes.append(f"state-space mixers: {' and '.join(missing)} not installed, so transformers runs its torch "
                 "fallback on the GPU (several times the kernels' activation memory); planned for that path. "
                 "`pip install mamba-ssm causal-conv1d` for the kernels")
    return "torch"


def on_cuda(args) -> bool:
    return torch.cuda.is_available() and not args.use_cpu


def uses_fsdp(args) -> bool:
    return bool(getattr(args, "fsdp", None)) or env_true("ACCELERATE_USE_FSDP")


def env_true(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def fsdp_layout(args) -> tuple[str, int, bool] | None:
    """(strategy, FSDP version, CPU offload) of the run's own FSDP, or None when it runs none.

    Read as the Trainer and accelerate read them: `TrainingArguments.fsdp` / `fsdp_config`
    (after `__post_init__`: `version` defaults to 2, `reshard_after_forward` a bool for FSDP2
    or a strategy name for FSDP1, `cpu_offload`), else accelerate's FSDP plugin environment
    (`accelerate launch` with an FSDP config sets ACCELERATE_USE_FSDP, FSDP_VERSION,
    FSDP_RESHARD_AFTER_FORWARD or FSDP_SHARDING_STRATEGY, FSDP_OFFLOAD_PARAMS).
    """
    if getattr(args, "fsdp", None):
        config = args.fsdp_config if isinstance(args.fsdp_config, dict) else {}
        version = int(config.get("version", 2))
        raw = config.get("reshard_after_forward", True if version == 2 else "full_shard")
        offload = str(config.get("cpu_offload", False)).lower() in ("1", "true", "yes")
    elif env_true("ACCELERATE_USE_FSDP"):
        version = int(os.environ.get("FSDP_VERSION", "1"))  # FullyShardedDataParallelPlugin's default when unset
        # As FullyShardedDataParallelPlugin reads them: FSDP1 takes FSDP_SHARDING_STRATEGY (which
        # `accelerate launch` always sets), FSDP2 FSDP_RESHARD_AFTER_FORWARD.
        raw = (os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true") if version == 2
               else os.environ.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD"))
        offload = env_true("FSDP_OFFLOAD_PARAMS")
    else:
        return None
    return _fsdp_strategy(raw, version), version, offload


def fsdp_layout_run(args, on_gpu: bool, notes: list[str]) -> tuple[str, int, bool] | None:
    """`fsdp_layout` as the run applies it: accelerate promotes only GPU-like multi-process runs to FSDP
    (`AcceleratorState.__init__`: MULTI_CPU is not among them), so a CPU run with FSDP set trains under
    DDP, and is planned as the DDP it runs (with a note saying so)."""
    layout = fsdp_layout(args)
    if layout is not None and not on_gpu:
        notes.append("FSDP is set but this run is on the CPU, where accelerate runs DDP instead; planned as DDP")
        return None
    return layout


def _fsdp_strategy(raw, version: int) -> str:
    from hf_memfit.settings import FSDP_STRATEGIES

    text = str(raw).strip().lower()
    if version == 2 or text in ("true", "false", "1", "0", "yes", "no"):
        return "full_shard" if text in ("true", "1", "yes") else "shard_grad_op"
    if text.isdigit():  # accelerate's FSDP_SHARDING_STRATEGY index, 1-based
        names = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2")
        text = names[int(text) - 1] if 1 <= int(text) <= len(names) else text
    text = text.removeprefix("shardingstrategy.")
    if text not in FSDP_STRATEGIES:
        raise MemFitError(f"FSDP sharding strategy {raw!r} is not modelled; use one of {', '.join(FSDP_STRATEGIES)}")
    return text


def fixed_layout(args) -> tuple[int, str, str] | None:
    """(ZeRO stage, optimizer offload, parameter offload) the run's own DeepSpeed config already fixes.

    A DeepSpeed config from `TrainingArguments.deepspeed` (parsed by the Trainer's
    integration) or from accelerate's DeepSpeed plugin (`accelerate launch` with a
    DeepSpeed config sets ACCELERATE_DEEPSPEED_*). FSDP runs: see `fsdp_layout`.
    None: the planner may choose a layout itself.
    """
    if uses_fsdp(args):
        return None
    hf_config = getattr(args, "hf_deepspeed_config", None)
    if hf_config is not None:
        zero = hf_config.config.get("zero_optimization", {})
        device = lambda key: str((zero.get(key) or {}).get("device", "none") or "none").lower()  # noqa: E731
        return int(zero.get("stage", 0)), device("offload_optimizer"), device("offload_param")
    if env_true("ACCELERATE_USE_DEEPSPEED"):
        return (int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2)),
                os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none"),
                os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none"))
    return None


def gpu_name(on_gpu: bool) -> str | None:
    """The local GPU's catalogue name, or None (no GPU, or one the catalogue does not know)."""
    if not on_gpu:
        return None
    from hf_memfit.hardware import find_gpu

    try:
        return find_gpu(torch.cuda.get_device_name()).name
    except MemFitError:
        return None


def processes(args) -> tuple[int, int]:
    """(processes per node, nodes). Launchers set LOCAL_WORLD_SIZE; the rest of the world is other nodes."""
    world = max(1, args.world_size)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) or world
    return per_node, max(1, world // per_node)


# --- the data ---------------------------------------------------------------------------

def longest_batch(spec, dataset, collator, tokenizer, max_length: int | None = None) -> DataShape:
    """The longest row of the micro-batches the trainer will build from `dataset` with `collator`.

    A map-style dataset is scanned once for the token count of every row; the
    longest few rows go through the real collator, one at a time, and the
    longest of them twice together, which shows whether the collator pads,
    truncates, stacks rows (DPO: chosen over rejected) or concatenates the
    micro-batch into one row (padding-free). An `IterableDataset` cannot be
    scanned: its length is `max_length` (the trainer's, the collator's or the
    tokenizer's `model_max_length`), else the model's maximum positions, and
    the plan says which it assumed.
    """
    rows = _longest_rows(dataset)
    if rows:
        return _collated_shape(rows, collator, max_length)
    limit = _first_limit(max_length, getattr(collator, "max_length", None),
                         getattr(tokenizer, "model_max_length", None))
    what = "an IterableDataset" if dataset is not None else "no train_dataset"
    if limit is not None:
        return DataShape(limit, notes=[f"sequence length {limit}: the max_length of {what}, whose rows cannot be "
                                       "scanned before training"])
    if spec.max_position_embeddings:
        length = spec.max_position_embeddings
        return DataShape(length, notes=[f"sequence length {length} assumed: the model's maximum positions, for {what} "
                                        "with no max_length (set `max_length` to plan for shorter rows)"])
    raise CannotEstimate("cannot tell the sequence length: give the trainer a `max_length`, or a map-style dataset "
                         "with `input_ids`")


def _first_limit(*values) -> int | None:
    return next((v for v in values if isinstance(v, int) and 0 < v < _NO_LIMIT), None)


def _is_iterable(dataset) -> bool:
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return True
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.IterableDataset)


def _token_lengths(row) -> dict[str, int]:
    """Lengths of the row's token sequences (lists or 1-d tensors of integers)."""
    if not isinstance(row, dict):
        return {}
    lengths = {}
    for key, value in row.items():
        if isinstance(value, torch.Tensor):
            if value.dim() in (1, 2) and not value.is_floating_point():  # 2-d: multiple choice's (choices, tokens)
                lengths[key] = value.shape[-1]
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], int):
            lengths[key] = len(value)
    return lengths


def _longest_rows(dataset) -> list:
    """The longest few rows of a map-style dataset (by total and by each token column), each read once."""
    if dataset is None or _is_iterable(dataset) or not hasattr(dataset, "__len__") or len(dataset) == 0:
        return []
    columns = _arrow_lengths(dataset)
    if columns is not None:
        totals = [sum(lengths) for lengths in zip(*columns.values())]
        chosen = set(heapq.nlargest(_PROBE_ROWS, range(len(totals)), key=totals.__getitem__))
        for lengths in columns.values():
            chosen |= set(heapq.nlargest(2, range(len(lengths)), key=lengths.__getitem__))
        return [dataset[int(i)] for i in sorted(chosen)]
    by_total, by_column = [], {}
    for index in range(len(dataset)):
        row = dataset[index]
        lengths = _token_lengths(row)
        if not lengths:
            return []
        item = (sum(lengths.values()), index, row)
        (heapq.heappush if len(by_total) < _PROBE_ROWS else heapq.heappushpop)(by_total, item)
        for key, length in lengths.items():
            heap = by_column.setdefault(key, [])
            (heapq.heappush if len(heap) < 2 else heapq.heappushpop)(heap, (length, index, row))
    chosen = {index: row for _, index, row in by_total}
    for heap in by_column.values():
        chosen.update({index: row for _, index, row in heap})
    return [chosen[i] for i in sorted(chosen)]


def _arrow_lengths(dataset) -> dict[str, list[int]] | None:
    """Per-column token counts of a `datasets.Dataset`, read from its Arrow columns without decoding rows."""
    try:
        import datasets
        import pyarrow as pa
        import pyarrow.compute as pc
    except ImportError:
        return None
    if not isinstance(dataset, datasets.Dataset):
        return None
    table = dataset.with_format("arrow")[:]
    columns = {}
    for name in table.column_names:
        column = table.column(name)
        kind = column.type
        if (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_integer(kind.value_type):
            columns[name] = pc.fill_null(pc.list_value_length(column), 0).to_pylist()
    return columns or None


def _collated_shape(rows: list, collator, max_length: int | None) -> DataShape:
    """Run the rows through the collator and read the shapes of what the model gets."""
    longest = decoder = 0
    longest_row = None
    for row in rows:
        batch = _collate(collator, [row])
        if batch is None:  # the collator cannot take this data alone: read the raw lengths
            lengths = _token_lengths(row)
            length = lengths.get("input_ids", max(lengths.values()))
            label = lengths.get("labels")
        else:
            ids = batch.get("input_ids")
            length = ids.shape[-1] if isinstance(ids, torch.Tensor) else 0
            labels = batch.get("decoder_input_ids", batch.get("labels"))
            label = labels.shape[-1] if isinstance(labels, torch.Tensor) and labels.dim() > 1 else None
        if length > longest:
            longest, longest_row = length, row
        if label is not None:
            decoder = max(decoder, label)
    if longest == 0:
        raise MemFitError("cannot tell the sequence length: the training rows have no `input_ids`")
    pair = _collate(collator, [longest_row, longest_row])
    ids = pair.get("input_ids") if pair is not None else None
    padding_free = isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] == 1 and \
        ids.shape[1] >= 2 * longest
    if max_length is not None and longest > max_length and not padding_free:
        longest = max_length  # a truncating collator we could not run
    return DataShape(longest, decoder_seq_len=decoder or None, padding_free=padding_free)


def _collate(collator, rows: list):
    if collator is None:
        from transformers import default_data_collator as collator
    try:
        batch = collator([dict(row) for row in rows])
    except Exception:  # noqa: BLE001 - a collator that needs more than a row or two; fall back to raw lengths
        return None
    return batch if isinstance(batch, dict) or hasattr(batch, "keys") else None


# --- the trainer's step -------------------------------------------------------------------

def trl_step(trainer, args, call_arguments: dict, model=None) -> dict:
    """The TRL knobs of the step `trainer` runs (`TrainSettings` fields), {} for a trainer that is not TRL's.

    Read from the trainer while `Trainer.__init__` runs, after TRL prepared the
    data: `padding_free` as SFTTrainer resolved it (bfd packing implies it), and
    for DPO where the reference log-probs come from (`ref_model` given or built
    from the model's path, the base model under peft, or precomputed).
    """
    import sys

    trl = sys.modules.get("trl")
    if trl is None:
        return {}
    if isinstance(trainer, trl.SFTTrainer):
        return {"trainer": "sft", "padding_free": bool(getattr(trainer, "padding_free", False))}
    if isinstance(trainer, trl.DPOTrainer):
        if getattr(args, "precompute_ref_log_probs", False) and not uses_fsdp(args):
            reference = "precomputed"
        elif call_arguments.get("ref_model") is None and lora_settings(model):  # the model as wrapped by DPOTrainer
            reference = "adapters"
        else:
            reference = "copy"  # the ref_model given, or the copy DPOTrainer loads from the model's path
        return {"trainer": "dpo", "reference_model": reference}
    return {}


def call_arguments(trainer) -> dict:
    """The arguments of the outermost constructor call, by name (`MemFitMixin.__new__` keeps them)."""
    import inspect

    args, kwargs = getattr(trainer, "_memfit_call", ((), {}))
    try:
        return inspect.signature(type(trainer).__init__).bind_partial(trainer, *args, **kwargs).arguments
    except TypeError:
        return dict(kwargs)


def plan_inputs(trainer, model, args, fields, train_dataset, collator, tokenizer) -> dict:
    """The `planner.plan` keyword arguments for what `trainer` will run, plus "notes" on what was assumed."""
    from hf_memfit.models.spec import ModelSpec

    base = base_model(model)
    config = base.config.to_dict()
    spec = ModelSpec.from_config(getattr(base.config, "_name_or_path", "") or base.config.model_type, config)
    on_gpu = on_cuda(args)
    per_node, nodes = processes(args)
    world = max(1, args.world_size)
    sp, cp = sequence_split(args)
    global_batch = fields.global_batch_size or \
        args.per_device_train_batch_size * args.gradient_accumulation_steps * max(1, world // (sp * cp))
    if str(fields.memory_budget).strip().lower() == "auto" and not on_gpu:
        raise MemFitError("`memory_budget='auto'` needs a CUDA GPU and none is in use; give a size such as "
                          "memory_budget='16GiB'")
    step = trl_step(trainer, args, call_arguments(trainer), model)
    task = model_task(model)
    if task is None:
        from hf_memfit.tasks import TASK_TABLE

        raise CannotEstimate(f"{type(base).__name__} trains a task hf-memfit does not model (it models "
                             f"{', '.join(TASK_TABLE)})")
    inputs, media_notes = {}, []
    if task in MEDIA_TASKS:  # images, audio, speech: the shapes are read from the collated rows
        from hf_memfit.integrations.media import frozen_modules, media_inputs, processor_dict

        processor = processor_dict(tokenizer)
        if processor:
            config["memfit_processor"] = processor
            spec = ModelSpec.from_config(spec.name, config)
        inputs, media_notes = media_inputs(task, config, train_dataset, collator)
        inputs["frozen"] = frozen_modules(model)
        shape = DataShape(inputs.pop("seq_len", None) or 1)
        if task != "image-text-to-text":
            shape.seq_len = None
    else:
        shape = longest_batch(spec, train_dataset, collator, tokenizer, getattr(args, "max_length", None))
    notes = list(shape.notes) + media_notes
    run_fsdp = fsdp_layout_run(args, on_gpu, notes)
    run_deepspeed = fixed_layout(args)
    padding_free = step.get("padding_free", False) or shape.padding_free
    if task == "seq2seq" and not spec.is_encoder_decoder:
        task = spec.default_task  # a decoder's *ForConditionalGeneration (Gemma-3 with vision) trains as a causal LM
    decoder = shape.decoder_seq_len if task == "seq2seq" and shape.decoder_seq_len != shape.seq_len else None
    attention = attention_implementation(model)
    if attention is None:
        notes.append(f"attention {base.config._attn_implementation!r} is not modelled; planned as sdpa")
    activation_offloading = False
    if getattr(args, "activation_offloading", False):
        if not on_gpu:
            notes.append("TRL's activation_offloading moves only tensors on an accelerator (and TRL 1.16 cannot build "
                         "it on a torch without one): planned without it")
        elif step.get("trainer", "trainer") not in ("sft", "dpo"):
            notes.append("TRL's activation_offloading is modelled for SFT and DPO only: the activations are planned "
                         "on the device, so the plan keeps more headroom than the run needs")
        else:
            activation_offloading = True
    lora = lora_settings(model)
    quantized = bool(getattr(base, "is_loaded_in_4bit", False))
    quant_config = getattr(base.config, "quantization_config", None) if quantized else None
    quant = quant_config.to_dict() if hasattr(quant_config, "to_dict") else dict(quant_config or {})
    quant_storage = str(quant.get("bnb_4bit_quant_storage") or "uint8").removeprefix("torch.")
    return dict(
        model=spec, seq_len=shape.seq_len, global_batch_size=global_batch, gpu_memory=fields.memory_budget,
        gpu=gpu_name(on_gpu), task=task, num_labels=getattr(base.config, "num_labels", 2), num_gpus=per_node,
        num_nodes=nodes, lora_r=lora.get("r"), lora_alpha=lora.get("lora_alpha"),
        lora_target_modules=lora.get("target_modules"), lora_target_regex=lora.get("target_regex"),
        load_in_4bit=quantized,
        # transformers sets it on a `load_in_8bit` model (Linear8bitLt layers): planned as LLM.int8() (estimator/int8.py)
        load_in_8bit=bool(getattr(base, "is_loaded_in_8bit", False)),
        allow_offload=fields.allow_offload if on_gpu else "none", headroom=fields.headroom,
        keep_optimizer=fields.keep_optimizer, optim=str(getattr(args.optim, "value", args.optim)),
        device="cuda" if on_gpu else "cpu", mode=fields.memfit_mode, precision=model_precision(model, args, on_gpu),
        deepspeed_layout=run_deepspeed, fsdp_layout=run_fsdp,
        bnb_4bit_use_double_quant=bool(quant.get("bnb_4bit_use_double_quant", True)),
        bnb_4bit_quant_storage=quant_storage if quantized else None,
        # (DeepSpeed and FSDP cast the model to one dtype when they wrap it, after this plan: left to `auto`)
        prepare_model_for_kbit_training=model_is_kbit_prepared(base) if quantized and not (run_deepspeed or run_fsdp)
        else None,
        cpu_memory="auto",  # the trainer runs on the machine it plans for: its RAM holds what is offloaded
        allow_pure_bf16=fields.allow_pure_bf16,
        allow_optimizers=fields.allow_optimizers, allow_freeze=fields.allow_freeze,
        attn_implementation=attention or "sdpa",
        trainer=step.get("trainer", "trainer"), padding_free=padding_free,
        reference_model=step.get("reference_model"), decoder_seq_len=decoder, notes=notes,
        activation_offloading=activation_offloading, sp_size=sp, cp_size=cp, inputs=inputs,
        ssm_kernels=ssm_kernel_path(spec, on_gpu, notes), **low_rank_arguments(args),
    )


def sequence_split(args) -> tuple[int, int]:
    """(sp_size, cp_size) of the run: `TrainingArguments.parallelism_config`, else what `accelerate launch` exported.

    The ranks of one sequence-parallel group see the same rows (the Trainer's data-parallel world is
    world / (tp x cp x sp)), so they are not data parallel; the plan keeps the run's split as it is, since
    the process groups already exist when the trainer plans.
    """
    config = getattr(args, "parallelism_config", None)
    if config is not None:
        return max(1, int(getattr(config, "sp_size", 1) or 1)), max(1, int(getattr(config, "cp_size", 1) or 1))
    if env_true("ACCELERATE_USE_PARALLELISM_CONFIG"):
        return (max(1, int(os.environ.get("PARALLELISM_CONFIG_SP_SIZE", "1") or 1)),
                max(1, int(os.environ.get("PARALLELISM_CONFIG_CP_SIZE", "1") or 1)))
    return 1, 1


def low_rank_arguments(args) -> dict:
    """`optim_target_modules` / `optim_args` of a GaLore / APOLLO run, for the planner; {} for other optimizers."""
    from hf_memfit.optimizers import OPTIMIZERS

    optim = OPTIMIZERS.get(str(getattr(args.optim, "value", args.optim)))
    if optim is None or not optim.low_rank:
        return {}
    targets = args.optim_target_modules
    return {"optim_target_modules": [targets] if isinstance(targets, str) else targets,
            "optim_args": args.optim_args}

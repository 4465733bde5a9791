"""`MemFitTrainer`: the HF Trainer that plans its memory knobs, checks the plan, and survives an OOM.

It overrides two methods: `__init__` (plan and apply the plan before the
optimizer and dataloaders exist) and `training_step` (OOM recovery). The rest
is the stock Trainer, so everything else (logging, checkpoints, resume,
accelerate and DeepSpeed) behaves as users know it.
"""

import dataclasses
import json
import logging
import os

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_memfit.args import MemFitArguments
from hf_memfit.errors import MemFitError

logger = logging.getLogger(__name__)

_TASK_BY_CLASS_SUFFIX = {"ForCausalLM": "causal-lm", "ForSequenceClassification": "seq-cls",
                         "ForConditionalGeneration": "seq2seq", "ForSeq2SeqLM": "seq2seq"}


def is_out_of_memory(error: BaseException) -> bool:
    """torch.OutOfMemoryError, or a RuntimeError that says out of memory (older torch, cuBLAS, DeepSpeed)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower())


class MemFitTrainer(Trainer):
    """A drop-in `Trainer` that fits the run to `args.memory_budget`.

    Accepts `MemFitArguments` or plain `TrainingArguments` (upcast with the
    default budget, "auto"). The plan is kept as `trainer.memfit_plan` and
    written to `<output_dir>/memfit_plan.json` when training starts.
    """

    def __init__(self, model=None, args: TrainingArguments | None = None, *positional, **kwargs):
        if args is None:
            raise MemFitError("`args` is required: pass MemFitArguments(output_dir=..., memory_budget=...)")
        if not isinstance(args, MemFitArguments):
            fields = {k: v for k, v in args.to_dict().items() if k in MemFitArguments.__dataclass_fields__}
            fields = {k: getattr(args, k) for k in fields if MemFitArguments.__dataclass_fields__[k].init}
            args = MemFitArguments(**fields)
        self.memfit_result = _plan_for(model, args, kwargs.get("train_dataset"), kwargs.get("data_collator"),
                                       kwargs.get("processing_class"))
        self.memfit_plan = self.memfit_result.plan
        args = _apply(self.memfit_plan, args)
        super().__init__(model, args, *positional, **kwargs)
        self.add_callback(MemoryCheckCallback(self))
        self._memfit_chunk: int | None = None  # micro-batch split after an OOM; None = whole micro-batch
        self._memfit_recoveries = 0
        self._memfit_step_inputs: list = []
        self._memfit_step_id = -1
        if self.args.process_index == 0:
            from hf_memfit.report import format_plan

            logger.info("hf-memfit plan:\n%s", format_plan(self.memfit_result))

    def train(self, *args, **kwargs):
        if self.args.should_save:
            os.makedirs(self.args.output_dir, exist_ok=True)
            path = os.path.join(self.args.output_dir, "memfit_plan.json")
            with open(path, "w") as handle:
                json.dump(self.memfit_result.to_dict(), handle, indent=2)
        recording = self.args.memfit_debug_memory and _on_cuda(self.args)
        if recording:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        try:
            output = super().train(*args, **kwargs)
        except Exception as error:
            if is_out_of_memory(error) or isinstance(error.__cause__, torch.OutOfMemoryError):
                self.write_postmortem(f"out of memory: {str(error).splitlines()[0]}")
            raise
        if self.args.memfit_debug_memory:
            self.write_postmortem("end of training (memfit_debug_memory=True)")
        return output

    def write_postmortem(self, reason: str) -> str | None:
        """Write the predicted breakdown beside what was measured, and on CUDA the allocator snapshot.

        The snapshot (`memfit_memory_snapshot.pickle`) opens in PyTorch's memory
        viewer (pytorch.org/memory_viz). Returns the report's path.
        """
        if not self.args.should_save:
            return None
        os.makedirs(self.args.output_dir, exist_ok=True)
        estimate = self.memfit_result.estimate
        report = {"reason": reason, "step": self.state.global_step, "predicted": estimate.to_dict(),
                  "measured": [h for h in self.state.log_history if any(k.startswith("memfit/") for k in h)]}
        if _on_cuda(self.args):
            report["measured_cuda"] = {"max_memory_allocated": torch.cuda.max_memory_allocated(),
                                       "max_memory_reserved": torch.cuda.max_memory_reserved()}
            if self.args.memfit_debug_memory:
                snapshot = os.path.join(self.args.output_dir, "memfit_memory_snapshot.pickle")
                torch.cuda.memory._dump_snapshot(snapshot)
                report["snapshot"] = snapshot
        path = os.path.join(self.args.output_dir, "memfit_postmortem.json")
        with open(path, "w") as handle:
            json.dump(report, handle, indent=2, default=str)
        lines = [f"hf-memfit post-mortem ({reason}), written to {path}"]
        lines += [f"  predicted {name:<12} {value / 2**30:8.2f} GiB" for name, value in estimate.breakdown.items()]
        lines.append(f"  predicted peak allocated {estimate.peak_allocated_bytes / 2**30:.2f} GiB")
        for key, value in report.get("measured_cuda", {}).items():
            lines.append(f"  measured {key} {value / 2**30:.2f} GiB")
        for entry in report["measured"]:
            if "memfit/measured_peak_bytes" in entry:
                lines.append(f"  measured peak over the first steps {entry['memfit/measured_peak_bytes'] / 2**30:.2f} GiB")
        logger.warning("\n".join(lines))
        return path

    # --- OOM recovery ------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One micro-batch; on OOM, move down the ladder and redo this optimizer step's micro-batches.

        The micro-batches already run for the current optimizer step are kept,
        so after an OOM the step's gradients are rebuilt from the same samples
        with the same global batch: nothing is skipped, nothing is counted twice.
        """
        if self.state.global_step != self._memfit_step_id:
            self._memfit_step_id, self._memfit_step_inputs = self.state.global_step, []
        self._memfit_step_inputs.append(inputs)
        replay: list = []
        while True:
            try:
                for earlier in replay:
                    self._chunked_step(model, earlier, num_items_in_batch)
                return self._chunked_step(model, inputs, num_items_in_batch)
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                self._step_down_the_ladder(model, inputs, error)
                model.zero_grad(set_to_none=True)
                replay = self._memfit_step_inputs[:-1]

    def _chunked_step(self, model, inputs, num_items_in_batch):
        size = _batch_size(inputs)
        if self._memfit_chunk is None or self._memfit_chunk >= size:
            return super().training_step(model, inputs, num_items_in_batch)
        chunks = [_slice(inputs, start, min(start + self._memfit_chunk, size)) for start in range(0, size, self._memfit_chunk)]
        saved = self.current_gradient_accumulation_steps
        total = None
        try:
            if num_items_in_batch is None:
                # Without a token count the loss is a per-micro-batch mean divided by the
                # accumulation steps; dividing by the chunk count as well keeps the sum equal.
                self.current_gradient_accumulation_steps = saved * len(chunks)
            for chunk in chunks:
                loss = super().training_step(model, chunk, num_items_in_batch)
                total = loss if total is None else total + loss
        finally:
            self.current_gradient_accumulation_steps = saved
        return total

    def _step_down_the_ladder(self, model, inputs, error):
        if self.is_deepspeed_enabled:
            raise MemFitError("out of memory under DeepSpeed; hf-memfit cannot split micro-batches inside the "
                              "DeepSpeed engine: lower `memory_budget` and plan again") from error
        self._memfit_recoveries += 1
        size = _batch_size(inputs)
        chunk = self._memfit_chunk or size
        if self._memfit_recoveries > self.args.memfit_max_recoveries:
            self._give_up(error)
        if chunk > 1:
            self._memfit_chunk = max(1, chunk // 2)
            change = f"micro-batch split into chunks of {self._memfit_chunk}"
        elif not self.args.gradient_checkpointing:
            self.args.gradient_checkpointing = True
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            change = "gradient checkpointing enabled"
        else:
            self._give_up(error)
        _free_cached_memory()
        message = f"hf-memfit: out of memory at step {self.state.global_step}; {change}; redoing this step's micro-batches"
        logger.warning(message)
        self.state.log_history.append({"memfit/oom_recovery": self._memfit_recoveries, "memfit/change": change,
                                       "step": self.state.global_step})

    def _give_up(self, error):
        if self.args.should_save:
            self._save_checkpoint(self.model, trial=None)
        raise MemFitError(
            f"out of memory at step {self.state.global_step} after {self._memfit_recoveries - 1} recoveries; a checkpoint "
            f"was saved in {self.args.output_dir}. Lower `memory_budget` (the plan predicted "
            f"{self.memfit_result.estimate.device_total_bytes / 2**30:.1f} GiB) or allow offload with "
            "`allow_offload='cpu'`, and resume") from error


def _on_cuda(args) -> bool:
    return torch.cuda.is_available() and not args.use_cpu


def _batch_size(inputs) -> int:
    for value in inputs.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    return 1


def _slice(inputs, start: int, end: int):
    size = _batch_size(inputs)
    return type(inputs)({k: v[start:end] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == size else v
                         for k, v in inputs.items()})


def _free_cached_memory():
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- planning for the real model and data -------------------------------------------

def _plan_for(model, args: MemFitArguments, train_dataset, data_collator, processing_class):
    from hf_memfit.planner import plan
    from hf_memfit.spec import ModelSpec

    if model is None:
        raise MemFitError("`model` is required: MemFitTrainer plans for the model it trains")
    base = getattr(model, "get_base_model", lambda: model)()
    config = base.config.to_dict()
    spec = ModelSpec.from_config(getattr(base.config, "_name_or_path", "") or base.config.model_type, config)
    task = next((t for suffix, t in _TASK_BY_CLASS_SUFFIX.items() if type(base).__name__.endswith(suffix)), None)
    lora = _lora_settings(model)
    on_gpu = _on_cuda(args)
    world = max(1, args.world_size)
    global_batch = args.global_batch_size or args.per_device_train_batch_size * args.gradient_accumulation_steps * world
    budget = args.memory_budget
    if str(budget).strip().lower() == "auto" and not on_gpu:
        raise MemFitError("`memory_budget='auto'` needs a CUDA GPU and none is in use; give a size such as "
                          "memory_budget='16GiB'")
    dtype = next(base.parameters()).dtype
    quantized = bool(getattr(base, "is_loaded_in_4bit", False))
    if quantized:
        precision = "bf16-mixed" if args.bf16 or not args.fp16 else "fp16-mixed"
    elif dtype == torch.bfloat16:
        precision = "bf16"
    elif dtype == torch.float16:
        precision = "fp16"
    elif not on_gpu:
        precision = "bf16-mixed" if args.bf16 else "fp32"
    else:
        precision = None  # let the planner pick bf16/fp16 mixed for the GPU
    gpu_name = torch.cuda.get_device_name() if on_gpu else None
    if gpu_name is not None:
        from hf_memfit.hardware import find_gpu

        try:
            gpu_name = find_gpu(gpu_name).name
        except MemFitError:
            gpu_name = None
    return plan(
        spec, seq_len=_longest_sequence(spec, train_dataset, data_collator, processing_class),
        global_batch_size=global_batch, gpu_memory=budget, gpu=gpu_name, task=task,
        num_labels=getattr(base.config, "num_labels", 2), num_gpus=max(1, world), num_nodes=1,
        lora_r=lora.get("r"), lora_alpha=lora.get("lora_alpha"), lora_target_modules=lora.get("target_modules"),
        load_in_4bit=quantized, allow_offload=args.allow_offload if on_gpu else "none",
        headroom=args.headroom, keep_optimizer=args.keep_optimizer, optim=str(getattr(args.optim, "value", args.optim)),
        device="cuda" if on_gpu else "cpu", mode=args.memfit_mode, precision=precision,
    )


def _lora_settings(model) -> dict:
    config = getattr(model, "peft_config", None)
    if not config:
        return {}
    lora = next(iter(config.values()))
    targets = lora.target_modules
    return {"r": lora.r, "lora_alpha": lora.lora_alpha,
            "target_modules": tuple(sorted(targets)) if isinstance(targets, (set, list, tuple)) else None}


def _longest_sequence(spec, dataset, collator, tokenizer) -> int:
    """The longest sequence the data can produce: the collator's or tokenizer's max length, or a scan."""
    for source in (collator, tokenizer):
        length = getattr(source, "max_length", None)
        if isinstance(length, int) and 0 < length < 1_000_000:
            return length
    if dataset is not None and hasattr(dataset, "__len__") and len(dataset) > 0:
        longest = 0
        for index in range(len(dataset)):
            ids = dataset[index].get("input_ids") if isinstance(dataset[index], dict) else None
            if ids is not None:
                longest = max(longest, len(ids))
        if longest:
            return longest
    if spec.max_position_embeddings:
        return spec.max_position_embeddings
    raise MemFitError("cannot tell the sequence length: give the collator a `max_length` or a dataset with `input_ids`")


def _apply(plan, args: MemFitArguments) -> MemFitArguments:
    """The arguments with the plan's knobs, before the Trainer builds the optimizer and dataloaders.

    Rebuilt with `dataclasses.replace` rather than set attribute by attribute, so
    that `TrainingArguments.__post_init__` runs again: it sets up mixed
    precision and, when the plan uses DeepSpeed, fills the config's "auto"
    values from the new batch sizes and prepares accelerate for it.
    """
    changes = plan.training_arguments()
    if plan.deepspeed is not None:
        changes["deepspeed"] = plan.deepspeed
    return dataclasses.replace(args, **changes)


# --- checking the prediction ------------------------------------------------------------

class MemoryCheckCallback(TrainerCallback):
    """Logs the measured peak of the first optimizer steps beside the prediction as `memfit/*` keys.

    On CUDA it reads the caching allocator's peak. On the CPU, where torch keeps
    no such counter, a `StorageTracker` counts live storages during the first
    two optimizer steps (the second is the steady state the estimate predicts),
    on top of the model states that already exist.
    """

    def __init__(self, trainer: MemFitTrainer, steps: int = 2):
        self.trainer = trainer
        self.steps = steps
        self.tracker = None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step != 0 or self.tracker is not None:
            return
        if _on_cuda(args):
            torch.cuda.reset_peak_memory_stats()
            self.tracker = "cuda"
            return
        from hf_memfit.trace import StorageTracker

        self.tracker = StorageTracker()
        self.tracker.live_bytes = _existing_state_bytes(self.trainer)
        self.tracker.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.tracker is None or state.global_step != min(self.steps, args.max_steps if args.max_steps > 0 else self.steps):
            return
        if self.tracker == "cuda":
            measured = torch.cuda.max_memory_allocated()
            predicted = self.trainer.memfit_result.estimate.peak_allocated_bytes
        else:
            self.tracker.__exit__(None, None, None)
            measured = self.tracker.peak_bytes
            predicted = self.trainer.memfit_result.estimate.peak_allocated_bytes
        self.tracker = "done"
        error = (predicted - measured) / measured if measured else 0.0
        state.log_history.append({"memfit/predicted_peak_bytes": predicted, "memfit/measured_peak_bytes": measured,
                                  "memfit/relative_error": round(error, 4), "step": state.global_step})
        if abs(error) > 0.10:
            logger.warning("hf-memfit: predicted peak %.2f GiB, measured %.2f GiB (%+.0f%%)",
                           predicted / 2**30, measured / 2**30, 100 * error)

    def on_train_end(self, args, state, control, **kwargs):
        if self.tracker not in (None, "cuda", "done"):
            self.tracker.__exit__(None, None, None)
            self.tracker = "done"


def _existing_state_bytes(trainer: MemFitTrainer) -> int:
    """Bytes of the distinct storages behind parameters, buffers, gradients and optimizer state."""
    seen, total = set(), 0
    tensors = list(trainer.model.parameters()) + list(trainer.model.buffers())
    tensors += [p.grad for p in trainer.model.parameters() if p.grad is not None]
    if trainer.optimizer is not None:
        for state in trainer.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            total += storage.nbytes()
    return total

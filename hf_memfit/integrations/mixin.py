"""`MemFitMixin`: fits any `transformers.Trainer` subclass to a memory budget, in one line.

    class MyTrainer(SomeTrainer, MemFitMixin):  # MemFitMixin last
        pass

The mixin is a `Trainer` subclass that places itself right before `Trainer` in
the MRO, so its `__init__` runs when the subclass calls `Trainer.__init__`:
after the subclass has prepared its data and wrapped its model (TRL tokenizes
and packs the dataset and applies `peft_config` there), and before the
Trainer builds the accelerator, the optimizer and the dataloaders. It plans
from what the trainer will really run (`introspect.py`, `trl.py`), applies the
plan to the arguments it passes on, and then:

- `train` writes the plan, restores the plan of a checkpoint it resumes, and
  always uninstalls its memory check;
- `training_step` recovers from an OOM (smaller chunks, then checkpointing),
  agreed across ranks;
- `log` adds the `memfit/*` metrics to the Trainer's own logs, so they reach
  every reporting integration (W&B, TensorBoard, ...).

The rest is the stock trainer, so everything else behaves as users know it.
"""

import contextlib
import dataclasses
import inspect
import json
import logging
import os

import torch
from transformers import Trainer, TrainerCallback
from transformers.training_args import OptimizerNames

from hf_memfit.integrations.args import memfit_fields
from hf_memfit.errors import MemFitError
from hf_memfit.integrations.introspect import on_cuda as _on_cuda, uses_fsdp
from hf_memfit.integrations.unplanned import train_unplanned
from hf_memfit.units import format_bytes

logger = logging.getLogger(__name__)

# Written into every checkpoint: the knobs the run was really trained with (the plan,
# plus any step down the OOM ladder), so that a resumed run keeps them.
STATE_FILE = "memfit_state.json"
_PLAN_KNOBS = ("per_device_train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing", "optim",
               "bf16", "fp16",
               # the optimizer's own arguments (bf16 stochastic rounding, GaLore's target modules) and the
               # checkpointing kwargs (activation offload): its saved state loads only into the same setup
               "optim_args", "optim_target_modules", "gradient_checkpointing_kwargs")


# transformers 5 renamed `gradient_checkpointing*` to `activation_checkpointing*`; the old names are
# deprecated aliases that `__post_init__` overwrites from the new ones, so setting only the old
# name (directly, or through `dataclasses.replace`) is silently undone. Set both.
_CHECKPOINTING_ALIASES = (("gradient_checkpointing", "activation_checkpointing"),
                          ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"))


def _with_checkpointing_aliases(args, changes: dict) -> dict:
    """`changes` with every checkpointing knob under both its old and its new name (where the field exists)."""
    changes = dict(changes)
    for old, new in _CHECKPOINTING_ALIASES:
        for name, twin in ((old, new), (new, old)):
            if name in changes and hasattr(args, twin):
                changes[twin] = changes[name]
    return changes


class PeerOutOfMemoryError(torch.OutOfMemoryError):
    """Another rank ran out of memory in this micro-batch; every rank steps down the ladder with it."""


def is_out_of_memory(error: BaseException) -> bool:
    """torch.OutOfMemoryError, or a RuntimeError that says out of memory (older torch, cuBLAS, DeepSpeed)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower())


class MemFitMixin(Trainer):
    """Fits a Trainer subclass to `args.memory_budget`: `class MyTrainer(SomeTrainer, MemFitMixin)`.

    The arguments may be any TrainingArguments subclass; the memfit fields
    (`memory_budget`, `memfit_mode`, ...) are read from them where they exist
    (`MemFitArguments`, `MemFitSFTConfig`, ...), else take their defaults
    (budget "auto": the free memory of the GPU). The plan is kept as
    `trainer.memfit_plan` (with the estimate, `trainer.memfit_result`), shown
    once on the main process, and written to `<output_dir>/memfit_plan.json`
    when training starts.
    """

    def __new__(cls, *args, **kwargs):
        # Keep the outermost call: the mixin's __init__ sees only what the subclass passes to
        # Trainer.__init__, and some facts are in the rest (DPO's `ref_model`).
        self = super().__new__(cls)
        self._memfit_call = (args, kwargs)
        return self

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        mro = cls.__mro__
        following = mro[mro.index(MemFitMixin) + 1]
        if following is not Trainer:
            raise TypeError(f"{cls.__name__}: put MemFitMixin last among the bases, e.g. "
                            f"`class {cls.__name__}({following.__name__}, MemFitMixin)`, so that it plans when "
                            f"{following.__name__} has prepared its data and model")

    def __init__(self, *args, **kwargs):
        bound = inspect.signature(Trainer.__init__).bind(self, *args, **kwargs).arguments
        bound.pop("self")
        train_args = bound.get("args")
        fields = memfit_fields(train_args)
        if bound.get("model") is None:
            raise MemFitError("`model` is required: a MemFit trainer plans for the model it trains (not `model_init`)")
        from hf_memfit.integrations.introspect import plan_inputs
        from hf_memfit.planner.search import plan

        try:
            self.memfit_inputs = plan_inputs(self, bound["model"], train_args, fields, bound.get("train_dataset"),
                                             bound.get("data_collator"), bound.get("processing_class"))
            self.memfit_result = plan(**{k: v for k, v in self.memfit_inputs.items() if k != "notes"})
        except Exception as error:  # noqa: BLE001 - what hf-memfit cannot model must not stop the run
            return train_unplanned(self, error, bound)  # re-raises the user's own errors (a budget nothing fits)
        self.memfit_plan = self.memfit_result.plan
        self.memfit_overrides = overridden_settings(train_args, self.memfit_plan)
        bound["args"] = apply_plan(self.memfit_plan, train_args)
        self.memfit_args = fields
        super().__init__(**bound)
        if self.memfit_result.estimate.settings.task != "causal-lm" and self.compute_loss_func is None:
            # The Trainer skips dividing the loss by the accumulation steps when the model's forward
            # takes **kwargs, trusting it to normalise by `num_items_in_batch`. In transformers 5 only
            # the token-level LM losses do; classification losses and T5's are means that ignore it,
            # so with the accumulation a plan adds, loss and gradients would grow with the steps.
            self.model_accepts_loss_kwargs = False
        self._memfit_check = MemoryCheckCallback(self)
        self.add_callback(self._memfit_check)
        self.add_callback(PlanCheckpointCallback(self))
        self._memfit_chunk: int | None = None  # micro-batch split after an OOM; None = whole micro-batch
        self._memfit_recoveries = 0
        self._memfit_step_inputs: list = []
        self._memfit_step_id = -1
        self._memfit_ranks_told = False  # this micro-batch's OOM was already shared with the other ranks
        self.memfit_backward_syncs = False  # whether the backward running now all-reduces gradients (DDP)
        self._memfit_forward_agreed = False  # the running forward reached the ranks' agreement
        self._memfit_hooked = False
        self._memfit_pending_logs: dict = {}
        if self.args.process_index == 0:
            logger.warning("%s", self.memfit_summary())

    def memfit_summary(self) -> str:
        """The plan as shown on the console: the plan report and every user setting it changed."""
        from hf_memfit.report.text import format_plan

        lines = [f"hf-memfit plan for {type(self).__name__}:", format_plan(self.memfit_result)]
        for note in self.memfit_inputs.get("notes", []):
            lines.append(f"  note: {note}")
        if self.memfit_overrides:
            lines.append("  overrides your settings: " + ", ".join(
                f"{name} {before!r} -> {after!r}" for name, (before, after) in self.memfit_overrides.items()))
        return "\n".join(lines)

    def log(self, logs: dict, *args, **kwargs) -> None:
        """The Trainer's log, with the `memfit/*` metrics gathered since the last one."""
        if self._memfit_pending_logs:
            logs = {**logs, **self._memfit_pending_logs}
            self._memfit_pending_logs = {}
        return super().log(logs, *args, **kwargs)

    def memfit_log(self, metrics: dict) -> None:
        """Queue `memfit/*` metrics for the next `log` call (the Trainer logs every `logging_steps`)."""
        self._memfit_pending_logs.update(metrics)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        if self.memfit_result is None:  # unplanned (`unplanned.py`): the plain trainer's train
            return Trainer.train(self, resume_from_checkpoint, *args, **kwargs)
        if resume_from_checkpoint:
            self._restore_plan(resume_from_checkpoint)
        if self.args.should_save:
            os.makedirs(self.args.output_dir, exist_ok=True)
            path = os.path.join(self.args.output_dir, "memfit_plan.json")
            with open(path, "w") as handle:
                json.dump(self.memfit_result.to_dict(), handle, indent=2)
        recording = self.memfit_args.memfit_debug_memory and _on_cuda(self.args)
        if recording:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        try:
            output = super().train(resume_from_checkpoint, *args, **kwargs)
        except Exception as error:
            if is_out_of_memory(error) or isinstance(error.__cause__, torch.OutOfMemoryError):
                self.write_postmortem(f"out of memory: {str(error).splitlines()[0]}")
            raise
        finally:
            self._memfit_check.close()  # a run that stops inside the checked steps leaves no dispatch mode behind
        if self._memfit_pending_logs:  # the check ended after the last regular log: log it now
            self.log({})
        if self.memfit_args.memfit_debug_memory:
            self.write_postmortem("end of training (memfit_debug_memory=True)")
        return output

    def memfit_state(self) -> dict:
        """The knobs this run trains with now: the plan's, after any step down the OOM ladder."""
        knobs = {name: getattr(self.args, name) for name in _PLAN_KNOBS if hasattr(self.args, name)}
        knobs["optim"] = str(getattr(knobs["optim"], "value", knobs["optim"]))
        return {"knobs": knobs, "micro_batch_chunk": self._memfit_chunk, "recoveries": self._memfit_recoveries}

    def write_memfit_state(self, step: int) -> None:
        """Record `memfit_state()` in the checkpoint of `step`, for `train(resume_from_checkpoint=...)`."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        if self.args.should_save and os.path.isdir(folder):
            with open(os.path.join(folder, STATE_FILE), "w") as handle:
                json.dump(self.memfit_state(), handle, indent=2)

    def _restore_plan(self, checkpoint: str | bool) -> None:
        """Train on with the knobs the checkpoint was trained with, whatever today's plan says.

        The optimizer state in the checkpoint only loads into the same optimizer, and
        the same micro-batch and accumulation keep the data order and the global batch.
        """
        if checkpoint is True:
            from transformers.trainer_utils import get_last_checkpoint

            checkpoint = get_last_checkpoint(self.args.output_dir)
        path = os.path.join(str(checkpoint), STATE_FILE) if checkpoint else None
        if path is None or not os.path.exists(path):
            return  # the Trainer reports a missing checkpoint; a checkpoint without hf-memfit keeps today's plan
        with open(path) as handle:
            saved = json.load(handle)
        knobs = saved["knobs"]
        if (knobs["bf16"], knobs["fp16"]) != (self.args.bf16, self.args.fp16):
            raise MemFitError(f"the checkpoint {checkpoint} was trained with bf16={knobs['bf16']}, fp16={knobs['fp16']} "
                              f"but this run plans bf16={self.args.bf16}, fp16={self.args.fp16}; resume on a GPU "
                              "with the same precision support or start a new run")
        current = self.memfit_state()["knobs"]
        changed = {name: value for name, value in knobs.items() if name in current and value != current[name]}
        for name, value in _with_checkpointing_aliases(self.args, changed).items():
            setattr(self.args, name, OptimizerNames(value) if name == "optim" else value)
        self._train_batch_size = self.args.train_batch_size
        self._memfit_chunk = saved.get("micro_batch_chunk")
        self._memfit_recoveries = saved.get("recoveries", 0)
        if changed and self.args.process_index == 0:
            logger.warning("hf-memfit: resuming with the plan saved in %s: %s", checkpoint,
                           ", ".join(f"{k}={v}" for k, v in changed.items()))

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
            if self.memfit_args.memfit_debug_memory:
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
        In a distributed run every rank learns of an OOM on any rank and steps
        down with it, so the ranks never disagree on the plan.
        """
        if self.memfit_result is None:
            return Trainer.training_step(self, model, inputs, num_items_in_batch)
        if self.state.global_step != self._memfit_step_id:
            self._memfit_step_id, self._memfit_step_inputs = self.state.global_step, []
        self._memfit_step_inputs.append(inputs)
        replay: list = []
        while True:
            try:
                for earlier in replay:
                    self._micro_batch(model, earlier, num_items_in_batch)
                return self._micro_batch(model, inputs, num_items_in_batch)
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                self._step_down_the_ladder(model, inputs, error)
                model.zero_grad(set_to_none=True)
                replay = self._memfit_step_inputs[:-1]

    def _micro_batch(self, model, inputs, num_items_in_batch):
        """One micro-batch (in chunks after an OOM), with the ranks agreeing on any OOM.

        In a distributed run every rank takes part in one agreement (a MAX all-reduce
        of an OOM flag) at the end of each forward and one after each micro-batch, and
        a rank that runs out of memory joins the agreement the others are waiting in.
        The forward's agreement runs in a hook at the end of the model's own forward,
        before DDP prepares its gradient reduction, so a forward abandoned because of
        another rank's OOM leaves DDP's reducer untouched.
        """
        self._memfit_ranks_told = False
        if self._distributed and not self._memfit_hooked:
            self.accelerator.unwrap_model(model).register_forward_hook(self._agree_after_forward)
            self._memfit_hooked = True
        try:
            loss = self._chunked_step(model, inputs, num_items_in_batch)
        except Exception as error:
            if is_out_of_memory(error) and self._distributed and not self._memfit_ranks_told:
                if self._memfit_forward_agreed and self.memfit_backward_syncs:
                    # DDP's all-reduce of this backward is already under way on the other ranks,
                    # which wait for this one: there is no collective left that all ranks can join.
                    raise MemFitError(
                        f"out of memory on rank {self.args.process_index} in the backward pass of a micro-batch that "
                        "synchronises gradients; the other ranks are inside DDP's all-reduce, so the step cannot be "
                        "redone in place. Resume from the last checkpoint with a lower `memory_budget` (the plan "
                        f"predicted {self.memfit_result.estimate.device_total_bytes / 2**30:.1f} GiB)") from error
                self._any_rank_out_of_memory(True)  # joins the others' forward or end-of-micro-batch agreement
            raise
        if self._any_rank_out_of_memory(False):
            raise PeerOutOfMemoryError("another rank ran out of memory in this micro-batch's backward")
        return loss

    def _agree_after_forward(self, module, args, output):
        """Forward hook on the unwrapped model: every rank learns whether any ran out of memory in its forward."""
        if not (module.training and torch.is_grad_enabled()):
            return None
        self._memfit_forward_agreed = True
        if self._any_rank_out_of_memory(False):
            self._memfit_ranks_told = True
            raise PeerOutOfMemoryError("another rank ran out of memory in this micro-batch's forward")
        return None

    @property
    def _distributed(self) -> bool:
        return self.args.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()

    def _any_rank_out_of_memory(self, here: bool) -> bool:
        """Whether any rank ran out of memory: a MAX all-reduce of one flag (just `here` on one process)."""
        if not self._distributed:
            return here
        flag = torch.tensor([1.0 if here else 0.0], device=self.args.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def _chunked_step(self, model, inputs, num_items_in_batch):
        """The micro-batch whole, or after an OOM in chunks whose gradients add up to the same.

        Under DDP only the last chunk of a synchronising micro-batch all-reduces; the
        others run under `no_sync`, like the Trainer's own accumulation steps, so an
        OOM in their backward can still be redone on every rank.
        """
        size = _batch_size(inputs)
        syncs = self.accelerator.sync_gradients
        if self._memfit_chunk is None or self._memfit_chunk >= size:
            self.memfit_backward_syncs, self._memfit_forward_agreed = syncs, False
            return super().training_step(model, inputs, num_items_in_batch)
        chunks = [_slice(inputs, start, min(start + self._memfit_chunk, size)) for start in range(0, size, self._memfit_chunk)]
        saved = self.current_gradient_accumulation_steps
        # The Trainer's own test: is the loss normalised by the token count of the whole batch?
        normalised = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
            self.compute_loss_func is not None
        total = None
        try:
            for index, chunk in enumerate(chunks):
                if not normalised:
                    # A mean over the micro-batch, divided by the accumulation steps: weight each
                    # chunk's mean by its share of the micro-batch, so that the sum is the same.
                    self.current_gradient_accumulation_steps = saved * size / _batch_size(chunk)
                last = index == len(chunks) - 1
                self.memfit_backward_syncs, self._memfit_forward_agreed = syncs and last, False
                hold = contextlib.nullcontext() if last or not self._distributed else self.accelerator.no_sync(model)
                with hold:
                    loss = super().training_step(model, chunk, num_items_in_batch)
                total = loss if total is None else total + loss
        finally:
            self.current_gradient_accumulation_steps = saved
        return total

    def _step_down_the_ladder(self, model, inputs, error):
        optim = str(getattr(self.args.optim, "value", self.args.optim))
        if optim.endswith("_layerwise"):
            # Each parameter was stepped by its hook as soon as its gradient was made: an OOM in backward
            # leaves part of this step's update applied, and chunks would each step every parameter.
            raise MemFitError(f"out of memory with `optim={optim}`, which updates each parameter inside backward: "
                              "part of this step is already applied, so it cannot be redone in place or in chunks; "
                              "lower `memory_budget` and plan again, resuming from the last checkpoint") from error
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            engine = "DeepSpeed" if self.is_deepspeed_enabled else "FSDP"
            raise MemFitError(f"out of memory under {engine}, whose forward and backward run collectives that cannot "
                              "be redone in place; lower `memory_budget` and plan again, resuming from the last "
                              "checkpoint") from error
        self._memfit_recoveries += 1
        size = _batch_size(inputs)
        chunk = self._memfit_chunk or size
        if self._memfit_recoveries > self.memfit_args.memfit_max_recoveries:
            self._give_up(error)
        if chunk > 1:
            self._memfit_chunk = max(1, chunk // 2)
            change = f"micro-batch split into chunks of {self._memfit_chunk}"
        elif not self.args.gradient_checkpointing:
            kwargs = {"use_reentrant": False}
            for name, value in _with_checkpointing_aliases(self.args, {"gradient_checkpointing": True,
                                                                     "gradient_checkpointing_kwargs": kwargs}).items():
                setattr(self.args, name, value)
            self.accelerator.unwrap_model(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            change = "gradient checkpointing enabled"
        else:
            self._give_up(error)
        _free_cached_memory()
        where = "another rank" if isinstance(error, PeerOutOfMemoryError) else f"rank {self.args.process_index}"
        if self.args.process_index == 0 or not isinstance(error, PeerOutOfMemoryError):
            logger.warning("hf-memfit: out of memory on %s at step %d; %s; redoing this step's micro-batches",
                           where, self.state.global_step, change)
        self.memfit_log({"memfit/oom_recovery": self._memfit_recoveries, "memfit/change": change})

    def _give_up(self, error):
        if self.args.should_save:
            self._save_checkpoint(self.model, trial=None)  # no on_save callback fires here: write the state too
            self.write_memfit_state(self.state.global_step)
        raise MemFitError(
            f"out of memory at step {self.state.global_step} after {self._memfit_recoveries - 1} recoveries; a checkpoint "
            f"was saved in {self.args.output_dir}. Lower `memory_budget` (the plan predicted "
            f"{self.memfit_result.estimate.device_total_bytes / 2**30:.1f} GiB) or allow offload with "
            "`allow_offload='cpu'`, and resume") from error



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




# --- applying the plan ------------------------------------------------------------------

def apply_plan(plan, args):
    """The arguments with the plan's knobs, before the Trainer builds the accelerator, optimizer and dataloaders.

    Rebuilt with `dataclasses.replace` rather than set attribute by attribute, so
    that `__post_init__` runs again: it sets up mixed precision and, when the
    plan uses DeepSpeed, fills the config's "auto" values from the new batch
    sizes and prepares accelerate for it. The arguments keep their class.
    """
    changes = _with_checkpointing_aliases(args, plan.training_arguments())
    changes.pop("deepspeed", None)
    for name in plan.fsdp or {}:
        changes.pop(name, None)
    if args.deepspeed is None and not uses_fsdp(args):  # the user's own sharding stays
        if plan.deepspeed is not None:
            changes["deepspeed"] = plan.deepspeed
        if plan.fsdp is not None:
            changes.update(plan.fsdp)
    return dataclasses.replace(args, **changes)


def overridden_settings(args, plan) -> dict:
    """{field: (the user's value, the plan's)} for every argument the plan changes."""
    changed = {}
    for name, value in plan.training_arguments().items():
        if name in ("gradient_checkpointing_kwargs", "deepspeed", *(plan.fsdp or {})) or not hasattr(args, name):
            continue
        before = getattr(args, name)
        before = str(getattr(before, "value", before))
        if before != str(value):
            changed[name] = (getattr(getattr(args, name), "value", getattr(args, name)), value)
    if plan.deepspeed is not None and args.deepspeed is None and not uses_fsdp(args):
        changed["deepspeed"] = (None, f"ZeRO-{plan.settings.zero_stage} config")
    if plan.fsdp is not None and args.deepspeed is None and not uses_fsdp(args):
        changed["fsdp"] = (None, f"FSDP{plan.settings.fsdp_version} {plan.settings.fsdp}")
    return changed

# --- checking the prediction ------------------------------------------------------------

class PlanCheckpointCallback(TrainerCallback):
    """Writes the knobs the run trains with into every checkpoint (`memfit_state.json`), for resume."""

    def __init__(self, trainer: MemFitMixin):
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        self.trainer.write_memfit_state(state.global_step)


class MemoryCheckCallback(TrainerCallback):
    """Logs the measured peak of the first optimizer steps beside the prediction as `memfit/*` keys.

    On CUDA it reads the caching allocator's peak. On the CPU, where torch keeps
    no such counter, a `StorageTracker` counts live storages during the first
    two optimizer steps (the second is the steady state the estimate predicts),
    on top of the model states that already exist.
    """

    def __init__(self, trainer: MemFitMixin, steps: int = 2):
        self.trainer = trainer
        self.steps = steps
        self.tracker = None
        self.first_step = 0
        self.recoveries_before = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.first_step = state.global_step  # 0, or the step a resumed run starts from
        self.recoveries_before = self.trainer._memfit_recoveries

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step != self.first_step or self.tracker is not None:
            return
        if _on_cuda(args):
            torch.cuda.reset_peak_memory_stats()
            self.tracker = "cuda"
            return
        from hf_memfit.estimator.trace import StorageTracker

        self.tracker = StorageTracker()
        # The model and optimizer states already exist: register their storages, so that
        # in-place ops on them (the optimizer's update, DeepSpeed's copies into its flat
        # buffers) are recognised rather than counted as new allocations.
        for tensor, category in _existing_state(self.trainer):
            self.tracker.track(tensor, category)
        self.tracker.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.tracker in (None, "done") or state.global_step < min(self.first_step + self.steps, state.max_steps):
            return
        if self.tracker == "cuda":
            measured = torch.cuda.max_memory_allocated()
            predicted = self.trainer.memfit_result.estimate.peak_allocated_bytes
        else:
            self.tracker.__exit__(None, None, None)
            measured = self.tracker.peak_bytes
            estimate = self.trainer.memfit_result.estimate
            # On the CPU, DeepSpeed's "offloaded" buffers live in the same memory as everything else.
            predicted = estimate.peak_allocated_bytes + estimate.cpu_bytes
        self.tracker = "done"
        error = (predicted - measured) / measured if measured else 0.0
        # A step that recovered from an OOM ran another plan (and the failed attempt): not comparable.
        recovered = self.trainer._memfit_recoveries > self.recoveries_before
        self.trainer.memfit_log({"memfit/predicted_peak_bytes": predicted, "memfit/measured_peak_bytes": measured,
                                 "memfit/relative_error": round(error, 4), "memfit/recovered_during_check": recovered})
        if abs(error) > 0.10 and not recovered:
            logger.warning("hf-memfit: predicted peak %s, measured %s (%+.0f%%) over the first %d step(s)",
                           format_bytes(predicted), format_bytes(measured), 100 * error,
                           state.global_step - self.first_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        """Uninstall the CPU tracker if it is still counting (training ended or stopped inside the checked steps)."""
        if self.tracker not in (None, "cuda", "done"):
            self.tracker.__exit__(None, None, None)
            self.tracker = "done"


def _existing_state(trainer: MemFitMixin):
    """(tensor, category) for parameters, buffers, gradients and optimizer state that exist now.

    The plan counts every model the trainer holds (DPO's reference model too), so
    every one of them is registered.

    Optimizers are followed through their wrappers (accelerate's, DeepSpeed's ZeRO
    optimizer and the one it wraps), so DeepSpeed's flat fp32 master partitions and
    their states count too.
    """
    # the model, and any other model the trainer keeps (TRL's reference model, a teacher, ...)
    models = [trainer.model] + [value for name, value in vars(trainer).items()
                                if isinstance(value, torch.nn.Module) and value is not trainer.model
                                and name not in ("model_wrapped",)]
    for model in models:
        for param in model.parameters():
            yield param, "weights"
            if param.grad is not None:
                yield param.grad, "gradients"
        for buffer in model.buffers():
            yield buffer, "weights"
    optimizer, visited = trainer.optimizer, set()
    while optimizer is not None and id(optimizer) not in visited:
        visited.add(id(optimizer))
        for group in getattr(optimizer, "param_groups", []):
            for param in group.get("params", []):
                yield param, "optimizer"  # a master copy, where the optimizer keeps one
                if param.grad is not None:
                    yield param.grad, "gradients"
        for state in getattr(optimizer, "state", {}).values():
            if isinstance(state, dict):
                yield from ((v, "optimizer") for v in state.values() if isinstance(v, torch.Tensor))
        optimizer = getattr(optimizer, "optimizer", None)

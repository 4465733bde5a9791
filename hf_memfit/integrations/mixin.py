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
  agreed across ranks, in place or by stopping at a checkpoint it can resume
  from (`recovery.py`, per layout);
- `log` adds the `memfit/*` metrics to the Trainer's own logs, so they reach
  every reporting integration (W&B, TensorBoard, ...).

The rest is the stock trainer, so everything else behaves as users know it.
"""

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
from hf_memfit.integrations.introspect import on_cuda as _on_cuda
from hf_memfit.integrations.introspect import uses_fsdp
from hf_memfit.integrations.recovery import (PeerOutOfMemoryError, OomRecoveryMixin,  # noqa: F401
                                             is_out_of_memory, with_checkpointing_aliases)
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


class MemFitMixin(OomRecoveryMixin):
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
        following = mro[mro.index(MemFitMixin) + 2]  # after MemFitMixin comes its OomRecoveryMixin
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
        if self.memfit_plan.tiled_mlp:
            from hf_memfit.integrations.tiled import apply_tiled_mlp

            apply_tiled_mlp(bound["model"])
        if self.memfit_plan.frozen:  # before the Trainer builds the optimizer: frozen parameters get no state
            from hf_memfit.integrations.media import freeze_planned

            froze = freeze_planned(bound["model"], self.memfit_plan.frozen)
            if froze:
                self.memfit_overrides["frozen modules"] = (None, ", ".join(froze))
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
        self._init_recovery()
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
        for name, value in with_checkpointing_aliases(self.args, changed).items():
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


# --- applying the plan ------------------------------------------------------------------

def apply_plan(plan, args):
    """The arguments with the plan's knobs, before the Trainer builds the accelerator, optimizer and dataloaders.

    Rebuilt with `dataclasses.replace` rather than set attribute by attribute, so
    that `__post_init__` runs again: it sets up mixed precision and, when the
    plan uses DeepSpeed, fills the config's "auto" values from the new batch
    sizes and prepares accelerate for it. The arguments keep their class.
    """
    changes = with_checkpointing_aliases(args, plan.training_arguments())
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
    on top of the model states that already exist. It starts with the epoch, before
    the Trainer fetches the first step's micro-batches, so that the batches the step
    holds (`assemble.held_batches`: the step's own, and the one accelerate's
    dataloader fetches ahead) are counted as the estimate counts them.
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

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._start(args, state)

    def on_step_begin(self, args, state, control, **kwargs):
        self._start(args, state)

    def _start(self, args, state) -> None:
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
            predicted = estimate.peak_allocated_bytes + estimate.cpu_bytes - self._no_batch_ahead(state, estimate)
        self.tracker = "done"
        error = (predicted - measured) / measured if measured else 0.0
        # A step that recovered from an OOM ran another plan (and the failed attempt), and a run resumed
        # with chunked micro-batches runs smaller steps than the plan's: not comparable.
        recovered = self.trainer._memfit_recoveries > self.recoveries_before or self.trainer._memfit_chunk is not None
        self.trainer.memfit_log({"memfit/predicted_peak_bytes": predicted, "memfit/measured_peak_bytes": measured,
                                 "memfit/relative_error": round(error, 4), "memfit/recovered_during_check": recovered})
        if abs(error) > 0.10 and not recovered:
            logger.warning("hf-memfit: predicted peak %s, measured %s (%+.0f%%) over the first %d step(s)",
                           format_bytes(predicted), format_bytes(measured), 100 * error,
                           state.global_step - self.first_step)

    def _no_batch_ahead(self, state, estimate) -> int:
        """The bytes of the batch the estimate holds fetched ahead (`assemble.held_batches`, image, audio and VLM
        steps on the CPU) where the last checked step ended an epoch: accelerate fetches none ahead of it. The
        estimate is the steady state; a run of an epoch or two of few steps (a quick try on a small dataset)
        would otherwise read a batch of pixels or audio over, which can be more than the 10% that warns."""
        from hf_memfit.estimator.assemble import bytes_fetched_ahead

        epoch_ended = state.epoch is not None and float(state.epoch).is_integer()
        return bytes_fetched_ahead(self.trainer.memfit_inputs["model"], estimate.settings) if epoch_ended else 0

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

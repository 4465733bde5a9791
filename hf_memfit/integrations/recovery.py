"""OOM recovery for `MemFitMixin`: the ranks agree, step down a ladder, and redo the step or stop to resume.

The ladder: the micro-batch in smaller chunks (the gradients add up to the same),
then gradient checkpointing. The next rung is re-planned from the measured peak:
the estimate scaled by how far the real step overshot it must fit the budget.

What an OOM leaves behind depends on the layout, read from each library's source:

- plain, DDP: only `param.grad`. The step's micro-batches are redone from zero
  gradients, in place.
- FSDP2 (`fully_shard`): iteration state in hooks (unsharded groups, in-flight
  all-gathers and reduce-scatters, post-forward order). torch's
  `FSDPModule.reset_iter_state()` on the root waits for them, reshards and
  discards the iteration's gradients; the step's micro-batches are then redone
  from zero gradients, in place.
- DeepSpeed ZeRO-1/2/3: the forward touches no gradient state (ZeRO-3 gathers
  parameters in hooks, released by its coordinator's `release_and_reset_all`),
  so an OOM in the forward redoes that micro-batch in chunks, in place, and the
  earlier micro-batches' gradients, already reduced into DeepSpeed's partitions,
  are kept. In the backward, the gradient hooks
  (`stage_1_and_2.reduce_independent_p_g_buckets_and_remove_grads`,
  `stage3.__reduce_and_partition_ipg_grads`) have already reduced part of this
  micro-batch into those partitions and DeepSpeed has no call to undo it, so the
  run stops: it saves a checkpoint at the start of the step (the optimizer has
  not stepped), records the next rung in it, and names the command that resumes.
- FSDP1: no reset of its flat-parameter state exists; the run stops with the
  last checkpoint.

The ranks agree through a MAX all-reduce of an OOM flag at the end of each
forward and of each micro-batch. A rank that runs out of memory joins the
agreement the others wait in; that is sound only where no collective lies
between its failure and that agreement on the other ranks (DDP and ZeRO-1/2
forwards; a sharded forward after its last all-gather). Where one does (a
ZeRO-3 or FSDP forward before a later all-gather, any sharded backward), the
failing rank stops: it cannot save a sharded checkpoint alone, so it names the
last one, and the launcher ends the ranks blocked in the collective.
"""

import contextlib
import json
import logging
import os
import re
import shlex
import sys

import torch
from transformers import Trainer

from hf_memfit.errors import MemFitError

logger = logging.getLogger(__name__)

RESUME_FILE = "memfit_resume.json"  # in the checkpoint a stopped run saved: the cause, the next rung, the command

# transformers 5 renamed `gradient_checkpointing*` to `activation_checkpointing*`; the old names are
# deprecated aliases that `__post_init__` overwrites from the new ones, so setting only the old
# name (directly, or through `dataclasses.replace`) is silently undone. Set both.
_CHECKPOINTING_ALIASES = (("gradient_checkpointing", "activation_checkpointing"),
                          ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"))


def with_checkpointing_aliases(args, changes: dict) -> dict:
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


class OomRecoveryMixin(Trainer):
    """`training_step` with OOM recovery; `MemFitMixin` builds on it (the state lives in `_memfit_*`)."""

    def _init_recovery(self) -> None:
        self._memfit_chunk: int | None = None  # micro-batch split after an OOM; None = whole micro-batch
        self._memfit_recoveries = 0
        self._memfit_step_inputs: list = []
        self._memfit_step_id = -1
        self._memfit_ranks_told = False  # this micro-batch's OOM was already shared with the other ranks
        self.memfit_backward_syncs = False  # whether the backward running now reduces gradients across ranks
        self._memfit_forward_agreed = False  # the running forward reached its end (and, on ranks, the agreement)
        self._memfit_hooked = False
        self._memfit_done = 0  # samples of the running micro-batch whose backward has finished

    @property
    def memfit_layout(self) -> str:
        """"deepspeed", "fsdp2", "fsdp1" or "replicated" (one process or DDP): what an OOM leaves behind."""
        if self.is_deepspeed_enabled:
            return "deepspeed"
        if self.is_fsdp_enabled:
            plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
            return "fsdp2" if getattr(plugin, "fsdp_version", 1) == 2 else "fsdp1"
        return "replicated"

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One micro-batch; on OOM, move down the ladder and redo what the OOM undid.

        The micro-batches already run for the current optimizer step are kept, so
        after an OOM the step's gradients are rebuilt from the same samples with
        the same global batch: nothing is skipped, nothing is counted twice. Every
        rank learns of an OOM on any rank and steps down with it.
        """
        if self.memfit_result is None:  # unplanned (`unplanned.py`): the plain trainer's step
            return Trainer.training_step(self, model, inputs, num_items_in_batch)
        if self.state.global_step != self._memfit_step_id:
            self._memfit_step_id, self._memfit_step_inputs = self.state.global_step, []
        self._memfit_step_inputs.append(inputs)
        replay: list = []
        start = 0  # samples of `inputs` whose gradients DeepSpeed already holds; only the rest is redone
        while True:
            try:
                for earlier in replay:
                    self._micro_batch(model, earlier, num_items_in_batch)
                return self._micro_batch(model, inputs, num_items_in_batch, start)
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                in_backward = self._memfit_forward_agreed
                if self.memfit_layout == "fsdp1":
                    self._stop_at_last_checkpoint(error, "FSDP1 has no reset of its flat parameters' state after an "
                                                         "interrupted step, so the step cannot be redone in place")
                self._reset_layout(model)
                if self.memfit_layout == "deepspeed" and in_backward:
                    self._stop_to_resume(model, inputs, error)
                self._step_down_the_ladder(model, inputs, error)
                if self.memfit_layout == "deepspeed":
                    # The gradients of the earlier micro-batches, and of this one's finished chunks, are
                    # already reduced into DeepSpeed's partitions: keep them and redo only the rest.
                    replay, start = [], self._memfit_done
                else:
                    model.zero_grad(set_to_none=True)
                    replay, start = self._memfit_step_inputs[:-1], 0

    def _micro_batch(self, model, inputs, num_items_in_batch, start: int = 0):
        """One micro-batch (in chunks after an OOM), with the ranks agreeing on any OOM.

        In a distributed run every rank takes part in one agreement (a MAX all-reduce
        of an OOM flag) at the end of each forward and one after each micro-batch, and
        a rank that runs out of memory joins the agreement the others are waiting in.
        The forward's agreement runs in a hook at the end of the model's own forward,
        before DDP prepares its gradient reduction, so a forward abandoned because of
        another rank's OOM leaves DDP's reducer untouched.
        """
        self._memfit_ranks_told = False
        if not self._memfit_hooked:
            self.accelerator.unwrap_model(model).register_forward_hook(self._agree_after_forward)
            self._memfit_hooked = True
        try:
            loss = self._chunked_step(model, inputs, num_items_in_batch, start)
        except Exception as error:
            if is_out_of_memory(error) and self._distributed and not self._memfit_ranks_told:
                if self._memfit_forward_agreed and (self.memfit_backward_syncs or self.memfit_layout != "replicated"):
                    # The others are inside this backward's collectives (DDP's all-reduce; a sharded layout
                    # gathers and reduces in every backward) and wait for this rank: none is left to join.
                    self._stop_at_last_checkpoint(error, self._alone("the backward pass"))
                if self.memfit_layout == "fsdp1":
                    self._stop_at_last_checkpoint(error, self._alone("the forward pass"))
                self._any_rank_out_of_memory(True)  # joins the others' forward or end-of-micro-batch agreement
            raise
        if self._any_rank_out_of_memory(False):
            raise PeerOutOfMemoryError("another rank ran out of memory in this micro-batch's backward")
        return loss

    def _agree_after_forward(self, module, args, output):
        """Forward hook on the unwrapped model: the backward starts next; ranks learn of any OOM in a forward."""
        if not (module.training and torch.is_grad_enabled()):
            return None
        self._memfit_forward_agreed = True
        if self._any_rank_out_of_memory(False):
            self._memfit_ranks_told = True
            self._memfit_forward_agreed = False  # no backward ran on any rank
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

    def _chunked_step(self, model, inputs, num_items_in_batch, start: int = 0):
        """The micro-batch whole, or after an OOM in chunks whose gradients add up to the same.

        Only the last chunk of a synchronising micro-batch reduces gradients: the
        others run under `no_sync` (DDP, FSDP2), or as DeepSpeed micro-steps that
        are not an accumulation boundary, like the Trainer's own accumulation steps.
        `start` skips the samples whose gradients are already kept (DeepSpeed);
        `_memfit_done` counts the samples whose backward has finished.
        """
        size = _batch_size(inputs)
        syncs = self.accelerator.sync_gradients
        self._memfit_done = start
        if start == 0 and (self._memfit_chunk is None or self._memfit_chunk >= size):
            self.memfit_backward_syncs, self._memfit_forward_agreed = syncs, False
            loss = super().training_step(model, inputs, num_items_in_batch)
            self._memfit_done = size
            return loss
        step = self._memfit_chunk or size
        bounds = [(first, min(first + step, size)) for first in range(start, size, step)]
        saved = self.current_gradient_accumulation_steps
        # The Trainer's own test: is the loss normalised by the token count of the whole batch?
        normalised = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
            self.compute_loss_func is not None
        total = None
        try:
            for index, (first, end) in enumerate(bounds):
                chunk = _slice(inputs, first, end)
                if not normalised:
                    # A mean over the micro-batch, divided by the accumulation steps: weight each
                    # chunk's mean by its share of the micro-batch, so that the sum is the same.
                    self.current_gradient_accumulation_steps = saved * size / (end - first)
                last = index == len(bounds) - 1
                self.memfit_backward_syncs, self._memfit_forward_agreed = syncs and last, False
                # DeepSpeed's engine takes the boundary from accelerate's flag (DeepSpeedEngineWrapper.backward)
                self.accelerator.gradient_state._set_sync_gradients(syncs and last)
                hold = contextlib.nullcontext()
                if syncs and not last and self._distributed and self.memfit_layout != "deepspeed":
                    hold = self.accelerator.no_sync(model)
                with hold:
                    loss = super().training_step(model, chunk, num_items_in_batch)
                self._memfit_done = end
                total = loss if total is None else total + loss
        finally:
            self.current_gradient_accumulation_steps = saved
            self.accelerator.gradient_state._set_sync_gradients(syncs)
        return total

    def _reset_layout(self, model) -> None:
        """Undo what an interrupted forward or backward left in the layout's hooks (see the module docstring)."""
        if self.memfit_layout == "fsdp2":
            from torch.distributed.fsdp import FSDPModule

            root = next((m for m in model.modules() if isinstance(m, FSDPModule)), None)
            if root is not None:
                root.reset_iter_state()
        elif self.memfit_layout == "deepspeed":
            engine = self.model_wrapped
            offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
            if offload is not None:  # ZeRO-3: release every parameter its hooks gathered
                offload.get_param_coordinator().release_and_reset_all(engine.module)

    def _next_rung(self, inputs, error) -> str:
        """Step down the ladder: the largest chunk the measured peak says fits, else checkpointing on."""
        size = _batch_size(inputs)
        chunk = self._memfit_chunk or size
        if chunk > 1:
            self._memfit_chunk = self._replanned_chunk(chunk, error)
            return f"micro-batch split into chunks of {self._memfit_chunk}"
        if not self.args.gradient_checkpointing:
            kwargs = {"use_reentrant": False}
            for name, value in with_checkpointing_aliases(self.args, {"gradient_checkpointing": True,
                                                                    "gradient_checkpointing_kwargs": kwargs}).items():
                setattr(self.args, name, value)
            self.accelerator.unwrap_model(self.model).gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            return "gradient checkpointing enabled"
        return ""

    def _replanned_chunk(self, chunk: int, error) -> int:
        """The largest chunk below `chunk` whose estimate, scaled by the measured overshoot, fits the budget.

        On CUDA the failed step's need is measured: the allocator's peak plus the
        request it refused (from the OOM message). The overshoot is that over the
        predicted peak at the chunk that ran out of memory, and every smaller
        chunk's device total is scaled by it. On the CPU nothing is measured (torch
        keeps no allocator peak there): the chunk is halved.
        """
        halved = max(1, chunk // 2)
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return halved
        try:
            from hf_memfit.estimator.assemble import estimate_settings

            spec, settings = self.memfit_inputs["model"], self.memfit_result.estimate.settings
            at = lambda c: estimate_settings(spec, settings.replace(batch_size=c))
            overshoot = max(1.0, measured_peak_bytes(error) / at(chunk).peak_allocated_bytes)
            usable = self.memfit_result.plan.budget_bytes * (1 - self.memfit_args.headroom)
            return largest_fitting_chunk(chunk, overshoot, lambda c: at(c).device_total_bytes, usable)
        except Exception as problem:  # noqa: BLE001 - the ladder must not fail on a planning problem
            logger.warning("hf-memfit: could not re-plan the chunk (%s); halving it", problem)
            return halved

    def _step_down_the_ladder(self, model, inputs, error):
        optim = str(getattr(self.args.optim, "value", self.args.optim))
        if optim.endswith("_layerwise"):
            # Each parameter was stepped by its hook as soon as its gradient was made: an OOM in backward
            # leaves part of this step's update applied, and chunks would each step every parameter.
            raise MemFitError(f"out of memory with `optim={optim}`, which updates each parameter inside backward: "
                              "part of this step is already applied, so it cannot be redone in place or in chunks; "
                              "lower `memory_budget` and plan again, resuming from the last checkpoint") from error
        self._memfit_recoveries += 1
        if self._memfit_recoveries > self.memfit_args.memfit_max_recoveries:
            self._give_up(error)
        change = self._next_rung(inputs, error)
        if not change:
            self._give_up(error)
        _free_cached_memory()
        where = "another rank" if isinstance(error, PeerOutOfMemoryError) else f"rank {self.args.process_index}"
        if self.args.process_index == 0 or not isinstance(error, PeerOutOfMemoryError):
            logger.warning("hf-memfit: out of memory on %s at step %d; %s; redoing this step's micro-batches",
                           where, self.state.global_step, change)
        self.memfit_log({"memfit/oom_recovery": self._memfit_recoveries, "memfit/change": change})

    def _give_up(self, error):
        if self.args.should_save or self.memfit_layout != "replicated":
            self._save_checkpoint(self.model, trial=None)  # no on_save callback fires here: write the state too
            self.write_memfit_state(self.state.global_step)
        raise MemFitError(
            f"out of memory at step {self.state.global_step} after {self._memfit_recoveries - 1} recoveries; a checkpoint "
            f"was saved in {self.args.output_dir}. Lower `memory_budget` (the plan predicted "
            f"{self.memfit_result.estimate.device_total_bytes / 2**30:.1f} GiB) or allow offload with "
            "`allow_offload='cpu'`, and resume") from error

    def _stop_to_resume(self, model, inputs, error):
        """All ranks agreed but the layout cannot redo the step in place: checkpoint, next rung, command, stop.

        The checkpoint is the state at the start of this step (the optimizer has not
        stepped); its `memfit_state.json` carries the next rung, which
        `train(resume_from_checkpoint=...)` restores, so the resumed run redoes this
        step with it.
        """
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        self._step_down_the_ladder(model, inputs, error)
        self._save_checkpoint(self.model, trial=None)  # every rank takes part (sharded states)
        self.write_memfit_state(self.state.global_step)
        folder = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        command = resume_command(folder)
        if self.args.should_save:
            with open(os.path.join(folder, RESUME_FILE), "w") as handle:
                json.dump({"reason": str(error).splitlines()[0], "layout": self.memfit_layout,
                           "step": self.state.global_step, "next": self.memfit_state(), "command": command},
                          handle, indent=2)
        raise MemFitError(
            f"out of memory in the backward pass under DeepSpeed at step {self.state.global_step}; DeepSpeed has "
            f"already reduced part of it and cannot redo it in place. Saved {folder} with the next "
            f"rung ({self._memfit_log_change()}); resume with: {command}") from error

    def _alone(self, where: str) -> str:
        return (f"the other ranks are inside the collectives of {where} under {self.memfit_layout} and wait for rank "
                f"{self.args.process_index}, so the step cannot be redone in place and no new checkpoint can be saved")

    def _stop_at_last_checkpoint(self, error, why: str):
        """Stop without a new checkpoint (none can be saved consistently): name the last one and the command."""
        from transformers.trainer_utils import get_last_checkpoint

        last = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
        raise MemFitError(
            f"out of memory on rank {self.args.process_index} at step {self.state.global_step}; {why}. Resume from "
            f"{last or 'the start'} with a lower `memory_budget` (the plan predicted "
            f"{self.memfit_result.estimate.device_total_bytes / 2**30:.1f} GiB): {resume_command(last)}") from error

    def _memfit_log_change(self) -> str:
        chunk = f"chunks of {self._memfit_chunk}" if self._memfit_chunk else "whole micro-batches"
        return f"{chunk}, gradient checkpointing {'on' if self.args.gradient_checkpointing else 'off'}"


def largest_fitting_chunk(chunk: int, overshoot: float, device_total_at, usable: float) -> int:
    """The largest chunk below `chunk` whose predicted device total, times `overshoot`, is within `usable`; else 1."""
    return next((c for c in range(chunk - 1, 1, -1) if device_total_at(c) * overshoot <= usable), 1)


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def measured_peak_bytes(error: BaseException) -> int:
    """What the failed CUDA step needed: the allocator's peak plus the request it refused ("Tried to allocate 2.00 GiB")."""
    match = re.search(r"tried to allocate ([\d.]+) ([KMGT]iB|B)", str(error), re.IGNORECASE)
    requested = int(float(match.group(1)) * _UNITS.get(match.group(2), 1)) if match else 0
    return torch.cuda.max_memory_allocated() + requested


def resume_command(checkpoint: str | None) -> str:
    """This launch's command line with `--resume_from_checkpoint` set (as HF example scripts pass it to `train`)."""
    argv = list(sys.argv)
    for index, value in enumerate(argv):
        if value == "--resume_from_checkpoint" and index + 1 < len(argv):
            del argv[index:index + 2]
            break
        if value.startswith("--resume_from_checkpoint="):
            del argv[index]
            break
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        per_node = os.environ.get("LOCAL_WORLD_SIZE", str(world))
        launcher = ["torchrun", "--nnodes", str(world // int(per_node)), "--nproc_per_node", per_node]
    else:
        launcher = [os.path.basename(sys.executable)]
    tail = ["--resume_from_checkpoint", checkpoint] if checkpoint else []
    return shlex.join(launcher + argv + tail)


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

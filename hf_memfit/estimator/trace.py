"""Exact mode: run the real training step on fake tensors and count live storage bytes.

Under `FakeTensorMode` the real transformers model builds and trains with no
memory and no GPU. `StorageTracker`, a TorchDispatchMode beneath it, sees the
output of every aten op, counts each new storage once (views share one), and
releases it through a weakref finalizer when the last tensor on it dies. The
running sum is what the allocator holds; its maximum is the peak.

Periods of a stack are identical, so exact mode (`exact.py`) traces the model at depth 2p and 3p
(p = the stack's layer period, 1 for most models) and extrapolates every *region* of the
step linearly to the real depth. A region is a stretch of the
step (forward before the stack, each layer of its first and its last period
in forward, the head and loss, the same in backward, the optimizer step) over
which the live bytes are a linear function of the depth (`regions.py`); its
maximum therefore extrapolates exactly, and the step's peak is the largest
extrapolated region maximum.

CUDA semantics on a CPU-only torch (autograd refuses fake CUDA tensors there):
the trace runs on fake CPU tensors, and what differs on a GPU is applied
explicitly, each item sourced in `shared/CUDA_MEMORY_FACTS.md`:
- the SDPA backend a GPU picks (flash / memory-efficient) and what its kernels
  keep for backward, by `fake_patches.GpuAttentionMemory`;
- CUDA autocast's fp32 op list (layer_norm, softmax, pow, ...), fused dropout (a bool mask) and softmax
  backward (`grad * output`): `fake_patches.cuda_autocast_policy`, `cuda_dropout`, `cuda_softmax_backward`;
- torch's default foreach optimizer path on CUDA (`step.make_optimizer`);
- the caching allocator's 512-byte rounding (its reserved memory beyond that is
  `cuda_overhead.allocator_slack_bytes`, the same model as fast mode's);
- in a run replayed through the allocator simulator only, the blocks CUDA's reductions stage
  (`StorageTracker.after_op`, `kernel_staging.py`).
"""

import contextlib
import functools
import logging
import weakref
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_flatten

from hf_memfit.estimator import step as training
from hf_memfit.estimator.breakdown import CATEGORIES
from hf_memfit.estimator.fake_ctc import static_ctc_loss
from hf_memfit.estimator.fake_optimizers import apollo_on_fake_tensors, make_traced_optimizer, optimizer_state_tensors
from hf_memfit.estimator.fake_vision import runs_for_real
from hf_memfit.estimator.ssm_kernels import cuda_kernel_path
from hf_memfit.estimator.trace_mode import MISS, TraceFakeTensorMode, TraceMode, fake_device
from hf_memfit.estimator.warm_up import (StatesNeedABackward, check_reached, known_without_gradient,
                                         remember_without_gradient, warm_up_settings, warm_up_without_a_pass)
from hf_memfit.estimator.fake_patches import (cuda_autocast_policy, cuda_dropout, cuda_softmax_backward,
                                              deepcopy_fake_tensors_as_real_ones, environment, gpu_sdpa,
                                              grouped_mm_any_dtype, is_experts, masks_as_the_batch_has,
                                              spec_augment_off, triton_folds_in_place, truncated_normal_init_in_place)
from hf_memfit.models.vision_language import reads_batch_values
from hf_memfit.settings import TrainSettings
from hf_memfit.units import CUDA_BLOCK_BYTES

# Progress of the traces ("tracing 2 of 3 ..."), at INFO: the CLI shows it on stderr; a library
# user sees it only by enabling the "hf_memfit" logger.
progress = logging.getLogger("hf_memfit.progress")

# What an allocation is, by the phase that made it, until it is recognised as a
# parameter, a gradient or optimizer state.
_CATEGORY_BY_PHASE = {"build": "weights", "inputs": "activations", "forward": "activations",
                      "backward": "temporary", "optimizer": "temporary"}


@dataclass
class Allocation:
    nbytes: int
    start: int  # clock of the allocation
    end: int | None  # clock of the release; None while live
    category: str
    phase: str
    module: str  # innermost module running when it was made


_TO_COPY = torch.ops.aten._to_copy.default
_ADD, _ADD_IN_PLACE = torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor
# A fake tensor held by nothing but the engine's input buffer, as __torch_dispatch__ sees it (the dispatcher's
# own references included): measured on torch 2.13 (4 uses, 2 on the storage); a gradient still held elsewhere too
# shows more (7 for one passed to two inputs).
_SOLE_USE_COUNT, _SOLE_STORAGE_USE_COUNT = 4, 2


def _fake_mode_beneath() -> TraceFakeTensorMode | None:
    """The trace's fake mode where an op goes from the tracker straight to it (no other dispatch mode between them);
    None there, and where the tensors are real (a MemFit trainer's measured step)."""
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    return mode if isinstance(mode, TraceFakeTensorMode) and torch._C._len_torch_dispatch_stack() == 1 else None


class StorageTracker(TraceMode):
    """Counts live storage bytes op by op, with a clock, regions and per-allocation records."""

    def __init__(self, round_to: int = 1):
        super().__init__()
        self.round_to = round_to
        self.allocations: list[Allocation] = []
        self._live: dict[int, Allocation] = {}
        self.clock = 0
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_clock = 0
        self.phase = "build"
        self.region = "build"
        self.region_peaks: dict[str, tuple[int, int]] = {}  # region -> (live bytes, clock)
        self.region_starts: list[tuple[int, str]] = []  # (clock, region) as regions begin, for timelines
        self.module_stack: list[str] = [""]
        self.events: list[tuple[int, int]] = []  # (+alloc index+1 | -(alloc index+1), bytes) for replay
        self.markers: list[tuple[int, str]] = []  # (clock, label) phase boundaries, for timelines
        # (tracker, func, args, kwargs) after each op that made a tensor, for blocks a kernel takes from the
        # allocator and frees inside the op, which no fake tensor shows (`kernel_staging.py`).
        self.after_op = None
        # Ops on the values a model reads (a VLM's image grid) run for real (`fake_vision.runs_for_real`). This mode
        # applies those rules itself: a mode of their own above it cost every op of such a step another Python dispatch.
        self.real_integers = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        device = fake_device(func, args)
        if device is not None:
            return device
        kwargs = kwargs or {}
        if func is _ADD and self._engine_sums_in_place(args, kwargs):
            func, args = _ADD_IN_PLACE, args[:2]
        out = MISS
        if self.real_integers and runs_for_real(func, args, kwargs):
            with unset_fake_temporarily():
                out = func(*args, **kwargs)
        elif (fake_mode := _fake_mode_beneath()) is not None:
            out = fake_mode.cached_output(func, args, kwargs)  # most ops: see there
        if out is MISS:
            out = func(*args, **kwargs)
        # Most ops seen here return one tensor, or none (`prim.device`, asked by autograd for every gradient,
        # is over half of a TiledMLP step's ops): those skip the pytree walk.
        if isinstance(out, torch.Tensor):
            values = (out,)
        elif isinstance(out, (torch.device, int, float, bool)) or out is None:
            return out
        else:
            values = [value for value in tree_flatten(out)[0] if isinstance(value, torch.Tensor)]
        # Autocast's cached low-precision copy of a weight (autocast_mode.cpp
        # cached_cast) lives as long as the autocast region: count it as weights.
        category = "weights" if func is _TO_COPY and self._is_weight(args[0]) else None
        for value in values:
            self.track(value, category)
        if self.after_op is not None:
            self.after_op(self, func, args, kwargs)
        return out

    def _engine_sums_in_place(self, args, kwargs) -> bool:
        """Whether this `a + b` is autograd's engine summing two gradients of one tensor, which a real run does in place.

        The engine adds each gradient that reaches a tensor into its input buffer (input_buffer.cpp
        `accumulate`): in place (`old_var.add_(var)`) when the buffer holds the only reference to a dense
        `old_var`, but out of place for a tensor subclass or under a dispatch mode, as here. Out of place, a
        tensor read in many slices (Mamba's scan reads one [b, d, s, n] tensor a token at a time) briefly
        holds a second full-size buffer. The engine's sum runs with grad mode off, in backward, and its first
        operand is held by the buffer alone: the reference counts of an operand nothing else holds.
        """
        a, b = args[0], args[1] if len(args) > 1 else None
        return (self.phase == "backward" and not torch.is_grad_enabled() and not kwargs and len(args) == 2
                and isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                and a.is_contiguous() and a._use_count() <= _SOLE_USE_COUNT
                and torch._C._storage_Use_Count(a.untyped_storage()._cdata) <= _SOLE_STORAGE_USE_COUNT)

    def _is_weight(self, tensor) -> bool:
        record = self._live.get(tensor.untyped_storage()._cdata) if isinstance(tensor, torch.Tensor) else None
        return record is not None and record.category == "weights" and self.phase == "forward"

    def track(self, tensor: torch.Tensor, category: str | None = None) -> None:
        if self.phase == "build" and tensor.device.type == "meta":
            return  # `from_pretrained` makes the model on the meta device first (`build.instantiate`): no memory
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        record = self._allocate(storage.nbytes(), category)
        self._live[key] = record
        weakref.finalize(storage, self._release, key, len(self.allocations))

    def transient(self, launches: list[tuple[int, ...]], held: int = 0) -> None:
        """Blocks the op that just ran took and gave back: `held` through it, and each launch's in turn, freed
        in the reverse order of their requests (a kernel's locals)."""
        outer = (self._allocate(held, "temporary"), len(self.allocations)) if held else None
        for requests in launches:
            records = [(self._allocate(nbytes, "temporary"), len(self.allocations)) for nbytes in requests]
            for record, index in reversed(records):
                self._free(record, index)
        if outer:
            self._free(*outer)

    def _allocate(self, nbytes: int, category: str | None) -> Allocation:
        if self.round_to > 1:
            nbytes = max(self.round_to, -(-nbytes // self.round_to) * self.round_to)
        self.clock += 1
        record = Allocation(nbytes, self.clock, None, category or _CATEGORY_BY_PHASE[self.phase], self.phase,
                            self.module_stack[-1])
        self.allocations.append(record)
        self.events.append((len(self.allocations), nbytes))
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_clock = self.live_bytes, self.clock
        best = self.region_peaks.get(self.region)
        if best is None or self.live_bytes > best[0]:
            self.region_peaks[self.region] = (self.live_bytes, self.clock)
        return record

    def _release(self, key: int, index: int) -> None:
        record = self._live.pop(key, None)
        if record is not None:
            self._free(record, index)

    def _free(self, record: Allocation, index: int) -> None:
        self.clock += 1
        record.end = self.clock
        self.live_bytes -= record.nbytes
        self.events.append((-index, record.nbytes))

    def set_region(self, region: str) -> None:
        self.region = region
        self.region_starts.append((self.clock, region))
        # A region starts with what is already live, so its maximum is at least that.
        best = self.region_peaks.get(region)
        if best is None or self.live_bytes > best[0]:
            self.region_peaks[region] = (self.live_bytes, self.clock)

    def mark(self, tensor: torch.Tensor | None, category: str) -> None:
        """Recognise a live tensor as a parameter, gradient or optimizer state."""
        if tensor is None:
            return
        record = self._live.get(tensor.untyped_storage()._cdata)
        if record is not None:
            record.category = category

    def breakdown_at(self, clock: int) -> dict[str, int]:
        totals = dict.fromkeys(CATEGORIES, 0)
        for record in self.allocations:
            if record.start <= clock and (record.end is None or record.end > clock):
                totals[record.category] += record.nbytes
        return totals


# --- the traced step ----------------------------------------------------------

def _flash_supported(settings: TrainSettings) -> bool:
    """Flash attention needs sm80+ (sdp_utils.cpp); with no GPU named we assume a current one."""
    if settings.gpu is None:
        return True
    from hf_memfit.hardware import find_gpu

    return find_gpu(settings.gpu).compute_capability >= (8, 0)


def _layer_stacks(model) -> list[torch.nn.ModuleList]:
    """The outermost ModuleLists of repeated blocks, found by structure (decoder layers; T5's encoder and decoder)."""
    from hf_memfit.models.generic import layer_stacks

    return [stack for _, stack in layer_stacks(model)]


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


@dataclass
class TraceResult:
    """One traced step at one depth: region maxima with their breakdowns, and the raw records."""

    depths: tuple[int, ...]
    region_peaks: dict[str, int]
    region_breakdowns: dict[str, dict[str, int]]
    peak_bytes: int
    tracker: StorageTracker | None  # None once sent back from a forked child (`_depth_trace`)
    largest_param_numel: int
    trainable_params: int
    total_params: int
    param_bytes: int
    quantizable_linear_params: int = 0
    largest_linear_numel: int = 0
    host_bytes: int = 0  # offloaded activation checkpoints: the most pinned host memory held
    stack_depths: tuple[int, ...] = ()  # the length of every layer stack found in the traced model
    # Multi-shape traces only (`trace_step(shapes=...)`): each step's host peak, and the trainable tensors
    # as (shape, element size, in the weight-decay group, an nn.Embedding weight), in parameters() order.
    host_peaks: list[int] = field(default_factory=list)
    host_peak_tensors: list[list[tuple]] = field(default_factory=list)  # and the tensors held then
    trainable_tensors: list[tuple] = field(default_factory=list)
    # The steps whose optimizer step was not run but is the first shape's, moved by what else was live
    # (`_step_repeats`, `parametric_fit._point_series`).
    repeated_optimizer_steps: list[int] = field(default_factory=list)


def _install_region_hooks(tracker: StorageTracker, stacks, step_tag) -> list:
    handles = []

    def make_hooks(stack_index: int, layer_index: int, depth: int):
        tag = f"s{stack_index}.L{layer_index}"

        def pre_hook(module, args, kwargs):
            if tracker.phase != "forward":
                return
            tracker.set_region(f"{step_tag()}|fwd|{tag}")
            if layer_index == 0:
                hidden = _first_tensor(args) if args else _first_tensor(kwargs)
                if hidden is not None and hidden.requires_grad:
                    hidden.register_hook(lambda g: tracker.set_region(f"{step_tag()}|bwd|s{stack_index}.post") or None)

        def post_hook(module, args, kwargs, output):
            if tracker.phase != "forward":
                return
            if layer_index == depth - 1:
                tracker.set_region(f"{step_tag()}|fwd|s{stack_index}.post")
            hidden = _first_tensor(output)
            if hidden is not None and hidden.requires_grad:
                hidden.register_hook(lambda g: tracker.set_region(f"{step_tag()}|bwd|{tag}") or None)

        return pre_hook, post_hook

    for s, stack in enumerate(stacks):
        for i, layer in enumerate(stack):
            pre, post = make_hooks(s, i, len(stack))
            handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(layer.register_forward_hook(post, with_kwargs=True))
    return handles


@contextlib.contextmanager
def _module_names(tracker: StorageTracker, model):
    """Keep `tracker.module_stack` on the module running, for per-module attribution."""
    names = {id(m): n or type(m).__name__ for n, m in model.named_modules()}  # the root: the model's class
    handles = []

    def pre(module, args):
        tracker.module_stack.append(names.get(id(module), tracker.module_stack[-1]))

    def post(module, args, output):
        if len(tracker.module_stack) > 1:
            tracker.module_stack.pop()

    for module in model.modules():
        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def trace_step(config: dict, settings: TrainSettings, depths: tuple[int, ...], *, steps: int = 2,
               shapes: tuple[tuple[int, int], ...] = (), short_warm_up: bool = True, after_op=None) -> TraceResult:
    """Trace `steps` optimizer steps of the model built from `config` with the given stack depths.

    The steady-state peak is the one of the last step, when optimizer states exist.
    `depths` is informational here; the config already carries them.

    The first step is a warm-up: it is there to leave the optimizer's states (and whatever else a step
    leaves behind) for the steps that count, whose region peaks are the only ones kept. With
    `short_warm_up` it is the optimizer step alone on zero gradients where it can be, else one micro-batch of
    rows cut to `WARM_UP_TOKENS` (`warm_up.py` says which, and why); the timeline `explain` draws passes
    False, to show the first step as it runs.

    `shapes` ((batch, seq, micro-batches) triples, for `parametric.py`; a fourth item is another precision
    of the same autocast build, for that step): after the warm-up, one steady-state step
    per shape on the same built model, so one build serves every point. Region peaks (with their clocks in
    `tracker.region_peaks`) are then kept for every step but the warm-up, and no
    breakdowns are computed here (the caller sweeps the events once for all of them). Or `shapes` is a run:
    per optimizer step a tuple of its micro-batches' settings, traced as given, with no warm-up before it.
    `after_op`: the tracker's (`kernel_staging.py`).
    """
    if short_warm_up and not _runs_as_given(shapes) and warm_up_without_a_pass(settings):
        known = known_without_gradient(config, settings)
        no_gradient = known or frozenset()
        for _ in range(2):  # a second start that finds others again: the warm-up runs a pass (below)
            try:
                result = _trace_step(config, settings, depths, steps, shapes, True, after_op, no_gradient=no_gradient)
            except StatesNeedABackward as missing:
                no_gradient = missing.names
                logging.getLogger(__name__).debug("%s: no gradient for %d parameters (%s, ...); starting again",
                                                  config.get("model_type"), len(no_gradient),
                                                  min(no_gradient, default=""))
                continue
            if no_gradient != (known or frozenset()):
                remember_without_gradient(config, settings, no_gradient)
            return result
    return _trace_step(config, settings, depths, steps, shapes, short_warm_up, after_op, no_gradient=None)


def _runs_as_given(shapes) -> bool:
    """Whether `shapes` is a run's steps, traced as given with no warm-up (`trace_step`)."""
    return bool(shapes) and isinstance(shapes[0][0], TrainSettings)


def _trace_step(config: dict, settings: TrainSettings, depths: tuple[int, ...], steps: int,
                shapes: tuple, short_warm_up: bool, after_op, *, no_gradient: frozenset[str] | None) -> TraceResult:
    """`trace_step`. Unless `no_gradient` is None, the warm-up is the optimizer step alone, on zero gradients of
    the trainable parameters not named there; the first measured forward and backward must then reach every
    trainable parameter but those (else `StatesNeedABackward`)."""
    states_only = no_gradient is not None
    run_as_given = _runs_as_given(shapes)
    if shapes:
        steps = (0 if run_as_given else 1) + len(shapes)
    warm_up = warm_up_settings(settings) if short_warm_up else settings
    cuda = settings.device == "cuda"
    training.import_step_modules(config, settings)  # outside the tracker: see there
    tracker = StorageTracker(round_to=CUDA_BLOCK_BYTES if cuda else 1)  # the caching allocator's blocks
    tracker.after_op = after_op
    fake_mode = TraceFakeTensorMode(allow_non_fake_inputs=True)
    patches = contextlib.ExitStack()
    with fake_mode, tracker, patches:
        patches.enter_context(training.quiet_transformers())  # its forward warns about the configs we build
        patches.enter_context(deepcopy_fake_tensors_as_real_ones())  # peft copies modules; see there
        patches.enter_context(truncated_normal_init_in_place())  # ModernBERT, SigLIP init; see there
        patches.enter_context(training.cuda_synchronize_without_cuda())  # GaLore 8-bit's step syncs
        patches.enter_context(masks_as_the_batch_has(settings.padding_free))  # see there
        if settings.optimizer.family == "apollo":
            patches.enter_context(apollo_on_fake_tensors())
        if cuda:
            original_sdpa = torch.nn.functional.scaled_dot_product_attention
            torch.nn.functional.scaled_dot_product_attention = gpu_sdpa(flash_supported=_flash_supported(settings))
            patches.callback(setattr, torch.nn.functional, "scaled_dot_product_attention", original_sdpa)
        if cuda and settings.trainer != "trainer":
            triton_folds_in_place(patches)
        model = training.build_model(config, settings)
        if settings.ssm_path == "cuda":  # mamba-ssm / causal-conv1d's autograd Functions; see there
            patches.enter_context(cuda_kernel_path(model))
        spec_augment_off(model)  # see there (fake_patches)
        # Qwen2-VL's image grid, Idefics3's pixels: the values the model reads run as real tensors (see there)
        tracker.real_integers = settings.task == "image-text-to-text" and reads_batch_values(config)
        # A VLM checks that its image tokens match its image features (`torch_compilable_check`, a value fake
        # tensors do not have); transformers' documented switch turns the checks off while the trace runs.
        patches.enter_context(environment("TRANSFORMERS_DISABLE_TORCH_CHECK", "1"))
        patches.enter_context(static_ctc_loss(model))  # CTC's loss with the batch's static shapes
        for tensor in list(model.parameters()) + list(model.buffers()):
            tracker.mark(tensor, "weights")
        optimizer = make_traced_optimizer(model, settings, cuda)
        trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
        stacks = _layer_stacks(model)
        if any(is_experts(m) for m in model.modules()):
            patches.enter_context(grouped_mm_any_dtype())
        position = {"step": 0, "micro": 0}
        step_tag = lambda: f"{position['step']}.{min(position['micro'], 1)}"  # noqa: E731
        handles = _install_region_hooks(tracker, stacks, step_tag)
        for emulation in ([cuda_softmax_backward(), cuda_dropout()] if cuda else []) + (
                [cuda_autocast_policy()] if cuda and settings.autocast_dtype else []):
            patches.enter_context(emulation)
        patches.enter_context(_module_names(tracker, model))
        micro_batches = min(settings.gradient_accumulation_steps, 2)  # later micro-batches repeat the second
        stash = getattr(model, "memfit_host_stash", None) or getattr(getattr(model, "base_model", None),
                                                                     "memfit_host_stash", None)
        host_peaks = []  # the pinned host memory each step held at most (offloaded activations)
        host_peak_tensors = []  # and the tensors it held then (`pinned_host.fit_offloaded_tensors`)
        got_gradient: set = set()  # ids of the parameters a backward gave a gradient (the optimizer steps only those)
        # A fit's later shapes copy the first shape's optimizer step (`repeated_optimizer_steps`): the gradients it
        # steps are those this set was at the first shape.
        first_stepped = None if run_as_given or not shapes or not _step_repeats(settings) else frozenset()
        repeated: list[int] = []
        for step_index in range(steps):
            position["step"] = step_index
            if stash is not None:
                stash.restart_peak()
            if run_as_given:  # a run's steps as given, its first standing for the warm-up (`run_of_shapes.py`)
                micro_settings = shapes[step_index]
                progress.info("tracing optimizer step %d of %d", step_index + 1, len(shapes))
            elif step_index == 0:
                micro_settings = () if states_only else (warm_up,) * (1 if short_warm_up else micro_batches)
            elif shapes:
                batch_size, seq_len, micros, *precision = shapes[step_index - 1]
                micro_settings = (settings.replace(batch_size=batch_size, seq_len=seq_len,
                                                   precision=(precision or [None])[0] or settings.precision),) * micros
            else:
                micro_settings = (settings,) * micro_batches
            for micro, shaped in enumerate(micro_settings):
                position["micro"] = micro
                tracker.phase = "inputs"
                tracker.set_region(f"{step_tag()}|fwd|pre")
                tracker.markers.append((tracker.clock, f"step {step_index + 1} forward{_micro_label(micro, shaped)}"))
                batch = training.make_batch(shaped, config)
                tracker.phase = "forward"
                # The warm-up's zero gradients were those the loss reaches: checked before the backward runs. Not
                # under TiledMLP, whose Function builds its MLP's graph in the backward (`warm_up.check_reached`).
                check = (functools.partial(check_reached, trainable, no_gradient)
                         if states_only and step_index == 1 and micro == 0 and not settings.tiled_mlp else None)
                _forward_backward(model, batch, shaped, tracker, step_tag, before_backward=check)
                del batch
                for p in model.parameters():
                    tracker.mark(p.grad, "gradients")
                    if p.grad is not None:
                        got_gradient.add(id(p))
                if states_only and step_index == 1 and micro == 0:  # and after it, by the gradients it gave
                    missing = frozenset(name for name, p in trainable.items() if p.grad is None)
                    if missing != no_gradient:
                        raise StatesNeedABackward(missing)
            tracker.phase = "optimizer"
            tracker.set_region(f"{step_tag()}|opt")
            tracker.markers.append((tracker.clock, f"step {step_index + 1} optimizer"))
            if states_only and step_index == 0:  # the warm-up's states alone: the step on zero gradients
                for name, p in trainable.items():
                    if name in no_gradient:
                        continue
                    p.grad = torch.zeros_like(p)
                    tracker.mark(p.grad, "gradients")
            with_gradient = None if first_stepped is None else frozenset(
                id(p) for p in model.parameters() if p.grad is not None)
            if first_stepped is not None and step_index >= 2 and with_gradient == first_stepped:
                model.zero_grad(set_to_none=True)  # the step itself is the first shape's (`_point_series`)
                repeated.append(step_index)
            else:
                with training.optim_args_named(settings):
                    training.optimizer_step(model, optimizer, cuda_semantics=cuda)
                if first_stepped is not None and step_index == 1:
                    first_stepped = with_gradient
            for p in model.parameters():  # GaLore 8-bit's step gives each target a new storage (`p.saved_data`)
                tracker.mark(p, "weights")
            for value in optimizer_state_tensors(optimizer):
                tracker.mark(value, "optimizer")
            host_peaks.append(stash.peak if stash is not None else 0)
            host_peak_tensors.append(stash.peak_tensors if stash is not None else [])
        if shapes and not run_as_given:  # the teardown's frees below are no step's: the last step's region ends as
            tracker.set_region("end")    # the others do, and its clocks line up with theirs
        tracker.markers.append((tracker.clock, "end"))
        for h in handles:
            h.remove()
        params = list(model.parameters())
        result = TraceResult(
            depths=depths,
            region_peaks={},
            region_breakdowns={},
            peak_bytes=tracker.peak_bytes,
            tracker=tracker,
            largest_param_numel=max(p.numel() for p in params),
            trainable_params=sum(p.numel() for p in params if p.requires_grad),
            total_params=sum(p.numel() for p in params),
            param_bytes=sum(p.numel() * p.element_size() for p in params),
            stack_depths=tuple(len(stack) for stack in stacks),
        )
        if settings.load_in_kbit:
            result.quantizable_linear_params, result.largest_linear_numel = _quantizable_linear_params(model)
        result.host_bytes = max(host_peaks, default=0)
        if shapes:  # what `parametric.py` needs to move the optimizer by formula
            result.host_peaks = host_peaks
            result.host_peak_tensors = host_peak_tensors
            result.repeated_optimizer_steps = repeated
            decay = {id(p) for p in training.param_groups(model)[0]["params"]}
            embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
            # The tensors the optimizer holds states for: those a backward gave a gradient. A trainable parameter
            # the step never reads has none, and AdamW (torch, bitsandbytes, torchao) makes no state for it:
            # LLaVA's last CLIP layer (its features are the second-to-last layer's). A layerwise optimizer takes
            # each gradient inside the backward, so there it is every trainable parameter.
            stepped = [p for p in params if p.requires_grad
                       and (settings.optimizer.layerwise or id(p) in got_gradient)]
            result.trainable_tensors = [(tuple(p.shape), p.element_size(), id(p) in decay, id(p) in embeddings)
                                        for p in stepped]
        del model, optimizer
    if shapes:
        result.region_peaks = {r: live for r, (live, _) in tracker.region_peaks.items() if not r.startswith("0.")}
        return result
    last_step = f"{steps - 1}."
    for region, (live, clock) in tracker.region_peaks.items():
        if region.startswith(last_step) or region == "build":
            result.region_peaks[region] = live
            result.region_breakdowns[region] = tracker.breakdown_at(clock)
    return result


def _step_repeats(settings: TrainSettings) -> bool:
    """Whether one shape's optimizer step stands for every shape's in a multi-shape trace: the step reads the
    parameters, their gradients and its states, whose shapes no batch or length changes, so its allocations
    are the same at every shape; only what else is live differs (the same at every point where the backward
    freed the activations). Not for optimizers whose step changes from one step to the next or runs inside
    the backward: GaLore / APOLLO recompute their projections every `update_proj_gap` steps, and the
    layerwise variants step in backward hooks. The step was 5-20% of a fit's trace time (Jamba's, with a
    state per expert tensor, the most)."""
    return not settings.optimizer.low_rank and not settings.optimizer.layerwise


def _micro_label(micro: int, settings: TrainSettings) -> str:
    """', micro-batch 1' / ', micro-batches 2-8' with accumulation (the second traced one stands for the rest)."""
    steps = settings.gradient_accumulation_steps
    if steps == 1:
        return ""
    return ", micro-batch 1" if micro == 0 else (", micro-batch 2" if steps == 2 else f", micro-batches 2-{steps}")


def _forward_backward(model, batch, settings, tracker, step_tag, before_backward=None):
    """`step.forward_backward`, with the phase switched to backward once the loss exists (and `before_backward`
    called with it)."""
    original_backward = torch.Tensor.backward

    def backward(loss, *args, **kwargs):
        if before_backward is not None:
            before_backward(loss)
        tracker.phase = "backward"
        tracker.set_region(f"{step_tag()}|bwd|pre")
        step_index, micro = (int(part) for part in step_tag().split("."))
        tracker.markers.append((tracker.clock, f"step {step_index + 1} backward{_micro_label(micro, settings)}"))
        return original_backward(loss, *args, **kwargs)

    torch.Tensor.backward = backward
    try:
        training.forward_backward(model, batch, settings, device_type="cpu")
    finally:
        torch.Tensor.backward = original_backward


def _quantizable_linear_params(model) -> tuple[int, int]:
    """Parameters bitsandbytes would pack to 4 bits, and the largest one (`step.quantizable_linears`)."""
    sizes = [module.weight.numel() for module in training.quantizable_linears(model)]
    return sum(sizes), max(sizes, default=0)

"""Exact mode: run the real training step on fake tensors and count live storage bytes.

Under `FakeTensorMode` the real transformers model builds and trains with no
memory and no GPU. `StorageTracker`, a TorchDispatchMode beneath it, sees the
output of every aten op, counts each new storage once (views share one), and
releases it through a weakref finalizer when the last tensor on it dies. The
running sum is what the allocator holds; its maximum is the peak.

Layers of a stack are identical, so the model is traced at depth p and 2p
(p = the stack's layer period, 1 for most models) and every *region* of the
step is extrapolated linearly to the real depth. A region is a stretch of the
step (forward before the stack, the first and the last layer in forward, the
head and loss, the same in backward, the optimizer step) over which the live
bytes are a linear function of the depth; its maximum therefore extrapolates
exactly, and the step's peak is the largest extrapolated region maximum.

CUDA semantics on a CPU-only torch (autograd refuses fake CUDA tensors there):
the trace runs on fake CPU tensors, and what differs on a GPU is applied
explicitly, each item sourced in `shared/CUDA_MEMORY_FACTS.md`:
- the SDPA backend a GPU picks (flash / memory-efficient) and what its kernels
  keep for backward, by `_GpuAttentionMemory`;
- CUDA autocast's fp32 op list (layer_norm, softmax, ...) by `_cuda_autocast_policy`;
- torch's default foreach optimizer path on CUDA (`step.make_optimizer`);
- the caching allocator's 512-byte rounding (its reserved memory beyond that is
  `cuda_overhead.allocator_slack_bytes`, the same model as fast mode's).
"""

import contextlib
import copy
import functools
import logging
import math
import weakref
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hf_memfit import step as training
from hf_memfit.breakdown import CATEGORIES, StepMemory
from hf_memfit.settings import TrainSettings

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


class StorageTracker(TorchDispatchMode):
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

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Autocast's cached low-precision copy of a weight (autocast_mode.cpp
        # cached_cast) lives as long as the autocast region: count it as weights.
        category = "weights" if func is torch.ops.aten._to_copy.default and self._is_weight(args[0]) else None
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self.track(value, category)
        return out

    def _is_weight(self, tensor) -> bool:
        record = self._live.get(tensor.untyped_storage()._cdata) if isinstance(tensor, torch.Tensor) else None
        return record is not None and record.category == "weights" and self.phase == "forward"

    def track(self, tensor: torch.Tensor, category: str | None = None) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        nbytes = storage.nbytes()
        if self.round_to > 1:
            nbytes = max(self.round_to, -(-nbytes // self.round_to) * self.round_to)
        self.clock += 1
        record = Allocation(nbytes, self.clock, None, category or _CATEGORY_BY_PHASE[self.phase], self.phase,
                            self.module_stack[-1])
        self._live[key] = record
        self.allocations.append(record)
        self.events.append((len(self.allocations), nbytes))
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_clock = self.live_bytes, self.clock
        best = self.region_peaks.get(self.region)
        if best is None or self.live_bytes > best[0]:
            self.region_peaks[self.region] = (self.live_bytes, self.clock)
        weakref.finalize(storage, self._release, key, len(self.allocations))

    def _release(self, key: int, index: int) -> None:
        record = self._live.pop(key, None)
        if record is None:
            return
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


# --- CUDA semantics on fake CPU tensors ------------------------------------

def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


class _GpuAttentionMemory(torch.autograd.Function):
    """What SDPA's flash / memory-efficient CUDA kernels allocate, on fake tensors.

    Values do not matter under FakeTensorMode; the allocations do. Sources
    (aten/src/ATen/native/transformers/cuda, summarised in CUDA_MEMORY_FACTS.md):
    - forward: output [b,s,h,d] in the input dtype, logsumexp fp32 [b,h,s]
      (memory-efficient pads s to a multiple of 32); q, k, v are saved as they are.
    - backward: dq, dk, dv; flash adds `dq_accum` fp32 [b, round128(s), h, round32(d)]
      and `softmax_d` fp32 [b, h, round128(s)]; memory-efficient adds `delta` fp32
      [b,h,s] and a grad-q accumulation workspace of q's size in fp32.
    """

    @staticmethod
    def forward(ctx, q, k, v, backend):
        b, h, s, d = q.shape
        out = torch.empty((b, s, h, v.shape[-1]), dtype=q.dtype, device=q.device).transpose(1, 2)
        lse_len = s if backend == "flash" else _round_up(s, 32)
        lse = torch.empty((b, h, lse_len), dtype=torch.float32, device=q.device)
        ctx.backend = backend
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        b, h, s, d = q.shape
        if ctx.backend == "flash":
            scratch = [torch.empty((b, _round_up(s, 128), h, _round_up(d, 32)), dtype=torch.float32, device=q.device),
                       torch.empty((b, h, _round_up(s, 128)), dtype=torch.float32, device=q.device)]
        else:
            scratch = [torch.empty((b, h, s), dtype=torch.float32, device=q.device),
                       torch.empty(q.shape, dtype=torch.float32, device=q.device)]
        grads = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        del scratch
        return (*grads, None)


def _gpu_sdpa(flash_supported: bool):
    """A stand-in for F.scaled_dot_product_attention that follows CUDA's backend choice."""
    original = torch.nn.functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **kw):
        half = query.dtype in (torch.float16, torch.bfloat16)
        head_dim = query.shape[-1]
        if key.shape[1] != query.shape[1]:  # GQA: the kernels see k/v expanded to all heads
            repeat = query.shape[1] // key.shape[1]
            key = key.repeat_interleave(repeat, dim=1)
            value = value.repeat_interleave(repeat, dim=1)
        # sdp_utils.cpp: flash needs no mask, fp16/bf16, sm80+, head_dim <= 256.
        if flash_supported and attn_mask is None and half and head_dim <= 256:
            return _GpuAttentionMemory.apply(query, key, value, "flash")
        # memory-efficient takes masks and fp32; its own limits are far above our head dims.
        if head_dim % 8 == 0:
            out = _GpuAttentionMemory.apply(query, key, value, "efficient")
            if attn_mask is not None and attn_mask.requires_grad:
                out = out + 0 * attn_mask.sum()
            return out
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, **kw)

    return sdpa


# What CUDA autocast runs in fp32 and CPU autocast does not (autocast_mode.cpp
# fp32 lists), as (namespace, attribute) pairs the model code calls through.
_CUDA_FP32_OPS = (
    (torch.nn.functional, "layer_norm"), (torch, "layer_norm"), (torch.nn.functional, "group_norm"),
    (torch.nn.functional, "softmax"), (torch, "softmax"), (torch.Tensor, "softmax"),
    (torch.nn.functional, "log_softmax"), (torch, "log_softmax"), (torch.Tensor, "log_softmax"),
)


@contextlib.contextmanager
def _cuda_autocast_policy():
    """While autocast is on, run CUDA autocast's fp32 ops in fp32 (CPU autocast leaves them in fp16/bf16).

    Casting the inputs to fp32 above autograd reproduces what CUDA autocast
    saves for backward (the fp32 copy of the input) and what it outputs. The
    functions themselves are wrapped, and each call asks torch's autocast state,
    so the policy holds wherever the model code runs: in the forward, and in the
    recompute of a checkpointed layer inside backward, where checkpoint restores
    the forward's autocast state. (A TorchFunctionMode does not reach that
    recompute: torch pops a mode while its handler runs, and `Tensor.backward`
    is itself dispatched through the handler, so a mode-based policy upcast in
    the forward but not in the recompute, and checkpoint refused the mismatch:
    "recomputed ... dtype float16 vs float32".)
    """

    def fp32_when_autocast(original):
        @functools.wraps(original)
        def upcast(*args, **kwargs):
            if not torch.is_autocast_enabled("cpu"):
                return original(*args, **kwargs)
            args = tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
            with torch.autocast("cpu", enabled=False):
                return original(*args, **kwargs)

        return upcast

    originals = [(owner, name, getattr(owner, name)) for owner, name in _CUDA_FP32_OPS]
    try:
        for owner, name, original in originals:
            setattr(owner, name, fp32_when_autocast(original))
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


@contextlib.contextmanager
def _truncated_normal_init_in_place():
    """Let weight init by `trunc_normal_` run on fake tensors.

    torch 2.13's `trunc_normal_` resamples until no value is out of bounds,
    reading `.item()` of the data, which fake tensors do not have. The values
    do not matter here and the init is in place (no allocation), so a plain
    in-place `normal_` stands in for it while the model is built.
    """
    import transformers.initialization as hf_init

    def trunc_normal_(tensor, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=None):
        with torch.no_grad():
            return tensor.normal_(mean, std)

    original_torch, original_hf = torch.nn.init.trunc_normal_, hf_init.TORCH_INIT_FUNCTIONS.get("trunc_normal_")
    torch.nn.init.trunc_normal_ = trunc_normal_
    if original_hf is not None:
        hf_init.TORCH_INIT_FUNCTIONS["trunc_normal_"] = trunc_normal_
    try:
        yield
    finally:
        torch.nn.init.trunc_normal_ = original_torch
        if original_hf is not None:
            hf_init.TORCH_INIT_FUNCTIONS["trunc_normal_"] = original_hf


# --- mixture-of-experts layers on fake tensors ----------------------------------

def _is_experts(module) -> bool:
    """A transformers experts module (fused 3-D expert weights behind `use_experts_implementation`)."""
    return hasattr(module, "has_gate") and hasattr(module, "is_transposed") and hasattr(module, "num_experts")


class _GroupedMatmul(torch.autograd.Function):
    """What `torch.nn.functional.grouped_mm` allocates, for dtypes its meta kernel refuses.

    transformers 5.23 runs experts through `grouped_mm` by default
    (`get_correct_experts_implementation`), and on the CPU the real kernel
    takes fp32 too; torch's meta registration accepts only bf16. The output
    is (rows, out) in the input's dtype whatever the routing (the offsets only
    say which expert each row uses); backward makes the input's gradient and
    the weights' gradient when each needs one, as the derivative formula does.
    """

    @staticmethod
    def forward(ctx, input, weight, offs):
        ctx.save_for_backward(input, weight)
        return torch.empty((input.shape[0], weight.shape[-1]), dtype=input.dtype, device=input.device)

    @staticmethod
    def backward(ctx, grad):
        input, weight = ctx.saved_tensors
        grad_input = torch.empty_like(input) if ctx.needs_input_grad[0] else None
        grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        return grad_input, grad_weight, None


@contextlib.contextmanager
def _grouped_mm_any_dtype():
    """Route transformers' grouped expert matmuls through `_GroupedMatmul` when the meta kernel would refuse."""
    from transformers.integrations import moe

    original = moe._grouped_mm

    def grouped_mm(input, weight, offs):
        if weight.dtype == torch.bfloat16:
            return original(input, weight, offs=offs)
        return _GroupedMatmul.apply(input.to(weight.dtype), weight, offs)

    moe._grouped_mm = grouped_mm
    try:
        yield
    finally:
        moe._grouped_mm = original


def _triton_folds_in_place(patches: contextlib.ExitStack) -> None:
    """TRL's fused LM head as its Triton kernels run on a GPU: each tile folded in place, no temporaries.

    On a device without Triton (the CPU, where the trace runs) TRL folds the tiles
    with torch ops (`_forward_tile`, `_backward_tile`) that make fp32 temporaries
    of the tile's size; on CUDA `_forward_kernel` / `_backward_kernel` keep them in
    registers and write the tile in place, and `_addmm_fp32` accumulates into the
    fp32 gradients with `addmm(out_dtype=float32)`, without upcast copies
    (trl/kernels/chunked_logprob.py, TRL 1.16). Values do not matter on fake tensors.
    """
    import trl.kernels.chunked_logprob as kernel

    for name in ("_forward_tile", "_backward_tile", "_addmm_fp32"):
        original = getattr(kernel, name)
        setattr(kernel, name, lambda *args, **kwargs: None)
        patches.callback(setattr, kernel, name, original)


# --- optimizers that cannot run on fake tensors -----------------------------

class _Bnb8bitStateLayout(torch.optim.Optimizer):
    """bitsandbytes 8-bit AdamW's state layout, for fake tensors.

    bnb's step makes data-dependent calls, so under FakeTensorMode we allocate
    its state exactly as `Optimizer8bit.init_state` does (bitsandbytes 0.50):
    tensors with at least `min_8bit_size` (4096) elements get uint8 `state1`,
    `state2` and fp32 `absmax1`, `absmax2` per 256-element block; smaller ones
    keep fp32 states. On CUDA the step runs one fused kernel per tensor and
    keeps no temporaries; on the CPU (backends/cpu/ops.py) it computes in fp32
    temporaries, one tensor at a time, which `step` allocates the same way.
    """

    min_8bit_size = 4096
    block_size = 256

    def __init__(self, params, state_bits: int = 8, cuda_semantics: bool = True, thirty_two_bit: set = frozenset(),
                 **_):
        super().__init__(params, {})
        self.state_bits = state_bits
        self.cuda_semantics = cuda_semantics
        self.thirty_two_bit = thirty_two_bit  # ids of parameters with a 32-bit override (embeddings)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                eight_bit = (self.state_bits == 8 and p.numel() >= self.min_8bit_size
                             and id(p) not in self.thirty_two_bit)
                if not state:
                    if eight_bit:
                        blocks = -(-p.numel() // self.block_size)
                        state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
                        state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
                        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32)
                        state["absmax2"] = torch.zeros(blocks, dtype=torch.float32)
                    else:
                        state["state1"] = torch.zeros_like(p, dtype=torch.float32)
                        state["state2"] = torch.zeros_like(p, dtype=torch.float32)
                if not self.cuda_semantics:
                    _bnb_cpu_update_temporaries(p, eight_bit)


def _bnb_cpu_update_temporaries(p: torch.Tensor, eight_bit: bool) -> None:
    """What bitsandbytes' CPU update of one tensor allocates, and frees before the next.

    `_optimizer_update_{8bit_blockwise,32bit}_cpu` (bitsandbytes 0.50 backends/cpu/ops.py): the dequantized
    states (8-bit only), grad.float() * gnorm_scale, p.data.float() (a copy unless fp32), and
    denom = state2.sqrt() / correction2 beside its sqrt. On CUDA the kernel updates in place.
    """
    fp32 = lambda: torch.empty_like(p, dtype=torch.float32)  # noqa: E731
    temporaries = [fp32(), fp32()] if eight_bit else []
    temporaries += [fp32(), fp32(), fp32()] + ([fp32()] if p.dtype != torch.float32 else [])
    del temporaries


def _galore_8bit_kernels_as_layout(optimizer, cuda_semantics: bool) -> None:
    """Make a real `GaLoreAdamW8bit` traceable by replacing only its call into bitsandbytes' kernels.

    galore_torch's `GaLoreAdamW8bit` is bitsandbytes' `Optimizer2State`. Its `step` runs
    GaLore in torch, which fake tensors run as they are: project the gradient,
    `p.saved_data = p.data.clone()`, `p.data` and `p.grad` swapped for the low-rank
    gradient (the full gradient is released there), project back and add. bnb's own
    `init_state` makes the states (uint8 + an fp32 absmax per 256-element block, fp32
    under 4096 elements). Only `update_step`, whose kernels read the data, is replaced:
    it does what bnb's does around the kernel (contiguous copies, the step count) and
    allocates what the kernel allocates (nothing on CUDA; `_bnb_cpu_update_temporaries`
    on the CPU). The class is swapped on the instance, so the Trainer's own object,
    with its groups and (layerwise) hooks, is the one traced.
    """

    class GaLore8bitKernelsAsLayout(type(optimizer)):
        @torch.no_grad()
        def update_step(self, group, p, gindex, pindex):
            p.data = p.data.contiguous()
            p.grad = p.grad.contiguous()
            state = self.state[p]
            state["step"] += 1
            if not cuda_semantics:
                _bnb_cpu_update_temporaries(p, state["state1"].dtype == torch.uint8)

    optimizer.__class__ = GaLore8bitKernelsAsLayout


@contextlib.contextmanager
def _bnb_qmaps_made_concrete():
    """bitsandbytes' 8-bit quantization maps, made from real numbers while an optimizer is built on fake tensors.

    `Optimizer8bit.__init__` fills its two 256-entry fp32 maps with
    `functional.create_dynamic_map`, which reads values (`.tolist()`). The values are
    computed outside the fake and tracking modes; what the optimizer keeps is a tensor
    of the same size made in the fake mode, so its bytes are counted as the real ones.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    import bitsandbytes.functional as bnb_functional

    original = bnb_functional.create_dynamic_map

    def create_dynamic_map(*args, **kwargs):
        with _disable_current_modes():
            real = original(*args, **kwargs)
        return torch.empty(real.shape, dtype=real.dtype)

    bnb_functional.create_dynamic_map = create_dynamic_map
    try:
        yield
    finally:
        bnb_functional.create_dynamic_map = original


@contextlib.contextmanager
def _apollo_on_fake_tensors():
    """Let APOLLO's real step run on fake tensors: its two reads of data are made concrete.

    apollo_torch 1.0.3 (apollo.py, random_projector.py) reads values twice, which a
    FakeTensor has not:
    - `next_seed` draws the projector's next seed with `torch.randint(...).tolist()`
      on a 15-element CPU tensor. It runs here outside the fake and tracking modes,
      as a real seed: a host-side int64 scratch of 120 bytes, not device memory;
    - the norm-growth limiter takes Python's `max(norm_ratio, 1.01)`, a comparison
      of a 0-d tensor. Either branch then makes the same full-size
      `scaled_grad / limiter` and a 0-d state; only whether `limiter` is a 0-d tensor
      or a float differs. The comparison is answered with the tensor (the norm grew
      by over 1%, the limiter acting).
    Everything else (the seeded Gaussian projector, the low-rank states, the scaled
    gradient) runs as it is.
    """
    import builtins

    from torch.utils._python_dispatch import _disable_current_modes

    import apollo_torch.apollo as apollo
    import apollo_torch.random_projector as projector

    original_next_seed = projector.next_seed

    def next_seed(seed, adv=projector.ADV_DEFAULT):
        with _disable_current_modes():
            return original_next_seed(seed, adv)

    def limiter_max(*args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        return tensors[0] if tensors else builtins.max(*args, **kwargs)

    projector.next_seed = next_seed
    apollo.max = limiter_max  # a module global shadows the builtin for apollo.py's code only
    try:
        yield
    finally:
        projector.next_seed = original_next_seed
        del apollo.max


def _torchao_state_layout(optimizer_cls):
    """torchao's low-bit AdamW (the class the Trainer builds), with its step replaced for fake tensors.

    torchao compiles one update per tensor (`torch.compile(single_param_adam)`),
    which cannot run under FakeTensorMode. The states are made by torchao's own
    `_new_buffer` (quantized `OptimState8bit` / `OptimState4bit`: uint8 codes, an
    fp32 scale per block and the qmap; `zeros_like(param)` for tensors it does not
    quantize), and the compiled update's fp32 buffers, measured on the CPU
    allocator (`optimizers.TORCHAO_STEP_BYTES_PER_ELEMENT`), are allocated one
    tensor at a time, as the real step does.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    from hf_memfit.optimizers import TORCHAO_STEP_BYTES_PER_ELEMENT

    # The lookup tables are computed once with data-dependent ops (lru-cached Python tuples): make them
    # outside the fake and tracking modes, as any real run has before its first step.
    with _disable_current_modes():
        from torchao.optim import subclass_4bit, subclass_8bit

        for module in (subclass_8bit, subclass_4bit):
            module.get_qmap_signed()
            module.get_qmap_unsigned()

    class TorchaoStateLayout(optimizer_cls):
        @torch.no_grad()
        def step(self, closure=None):
            bits = 4 if "4bit" in optimizer_cls.__name__ else 8
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        # torch.tensor(0.0) lives on the host even when the params are on a GPU
                        with _disable_current_modes() if self.cuda_semantics else contextlib.nullcontext():
                            state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = self._new_buffer(p, True)
                        state["exp_avg_sq"] = self._new_buffer(p, False)
                    if hasattr(state["exp_avg"], "codes"):
                        scratch = torch.empty(TORCHAO_STEP_BYTES_PER_ELEMENT[bits] * p.numel(), dtype=torch.uint8)
                        del scratch

    return TorchaoStateLayout


def optimizer_state_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor holding optimizer state, the inner tensors of torchao's quantized states included."""
    out = []
    for inner in training.inner_optimizers(optimizer):
        out += _state_tensors(inner)
    return out


def _state_tensors(optimizer) -> list[torch.Tensor]:
    out = []
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                inner = [getattr(value, name) for name in getattr(value, "tensor_attrs", ())]
                out += inner or [value]
            elif hasattr(value, "ortho_matrix"):  # GaLore / APOLLO projector
                matrix = value.ortho_matrix
                out += [m for m in (matrix if isinstance(matrix, list) else [matrix]) if isinstance(m, torch.Tensor)]
    return out


def _make_traced_optimizer(model, settings: TrainSettings, cuda_semantics: bool):
    optimizer = settings.optimizer
    trainable = [p for p in model.parameters() if p.requires_grad]
    if optimizer.implementation == "bnb":
        # The Trainer keeps 32-bit states for nn.Embedding weights (step.trainer_keeps_embeddings_32bit)
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        return _Bnb8bitStateLayout(trainable, state_bits=optimizer.state_bits, cuda_semantics=cuda_semantics,
                                   thirty_two_bit=embeddings if optimizer.state_bits == 8 else set())
    if optimizer.implementation == "torchao":
        optimizer_cls, kwargs = training.trainer_optimizer_class(settings, model)
        made = _torchao_state_layout(optimizer_cls)([g for g in training.param_groups(model) if g["params"]],
                                                    **kwargs)
        made.cuda_semantics = cuda_semantics
        return made
    with _bnb_qmaps_made_concrete() if optimizer.state_bits == 8 else contextlib.nullcontext():
        made = training.make_optimizer(model, settings, cuda_semantics=cuda_semantics)
    # Layerwise variants: one real optimizer per parameter, stepped by hooks inside backward.
    for inner in training.inner_optimizers(made):
        if optimizer.low_rank:
            # The projector is remade every `update_proj_gap` steps (GaLore's SVD, APOLLO's new Gaussian,
            # beside the old one); trace it in the measured step too, with the states already there, as
            # every 200th real step runs it.
            for group in inner.param_groups:
                if "update_proj_gap" in group:
                    group["update_proj_gap"] = 1
        if optimizer.family == "galore" and optimizer.state_bits == 8:
            _galore_8bit_kernels_as_layout(inner, cuda_semantics)
    return made


# --- deep copies of fake tensors ------------------------------------------------

@contextlib.contextmanager
def _deepcopy_fake_tensors_as_real_ones():
    """Make `copy.deepcopy` of a FakeTensor allocate what it allocates for a real tensor, and nothing else.

    peft deep-copies modules while it wraps a model: `ModulesToSaveWrapper`
    copies the classifier head for `SEQ_CLS` (and any `modules_to_save`), and
    DoRA (of a 4-bit base layer), LN tuning and layer replication copy layers
    too. torch's
    `Tensor.__deepcopy__`, which FakeTensor inherits, ends with
    `new.__dict__ = deepcopy(self.__dict__, memo)`, and a FakeTensor's
    `__dict__` holds its `fake_mode`. That deep-copies the whole
    FakeTensorMode, including `fake_tensor_converter.constant_storage_mapping`,
    whose keys are `StorageWeakRef`s: raw pointers to real storages, each
    holding one weak reference that its `__del__` releases. The copy duplicates
    the pointer without taking a reference, so the reference is released
    twice, and the process heap is corrupted (SIGSEGV in a later trace, or
    glibc's "corrupted double-linked list" at exit).

    The replacement does for fake tensors what torch does for real ones:
    a parameter is `Parameter(data.clone(preserve_format), requires_grad)`
    (`Parameter.__deepcopy__`); another tensor gets a copy of its whole storage,
    shared by every tensor on that storage within one deepcopy, then the same
    view of it, its grad and its Python attributes (`Tensor.__deepcopy__`).
    The copy stays in the tensor's own fake mode, and every allocation goes
    through the dispatcher, so the tracker counts it.
    """
    from torch._subclasses.fake_tensor import FakeTensor

    had_own = "__deepcopy__" in FakeTensor.__dict__
    original = FakeTensor.__dict__.get("__deepcopy__")
    fake_keys = object()  # memo key of this deepcopy's storage copies, per source storage

    def deepcopy(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            if isinstance(self, torch.nn.Parameter):
                new = torch.nn.Parameter(self.detach().clone(memory_format=torch.preserve_format), self.requires_grad)
            else:
                storages = memo.setdefault(id(fake_keys), {})
                source = self.untyped_storage()
                if source._cdata not in storages:
                    storages[source._cdata] = torch.empty(
                        source.nbytes(), dtype=torch.uint8, device=self.device).untyped_storage()
                new = self.new_empty((0,))
                new.set_(storages[source._cdata], self.storage_offset(), self.size(), self.stride())
                if self.requires_grad:
                    new.requires_grad_()
                if self.grad is not None:
                    new.grad = copy.deepcopy(self.grad, memo)
                for key, value in self.__dict__.items():  # attributes set by users, not the fake mode's own
                    if key not in new.__dict__:
                        setattr(new, key, copy.deepcopy(value, memo))
        memo[id(self)] = new
        return new

    FakeTensor.__deepcopy__ = deepcopy
    try:
        yield
    finally:
        if had_own:
            FakeTensor.__deepcopy__ = original
        else:
            del FakeTensor.__deepcopy__


# --- the traced step ----------------------------------------------------------

def _flash_supported(settings: TrainSettings) -> bool:
    """Flash attention needs sm80+ (sdp_utils.cpp); with no GPU named we assume a current one."""
    if settings.gpu is None:
        return True
    from hf_memfit.hardware import find_gpu

    return find_gpu(settings.gpu).compute_capability >= (8, 0)


def _layer_stacks(model) -> list[torch.nn.ModuleList]:
    """The outermost ModuleLists of repeated blocks, found by structure (decoder layers; T5's encoder and decoder)."""
    from hf_memfit.generic import layer_stacks

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
    tracker: StorageTracker
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
    trainable_tensors: list[tuple] = field(default_factory=list)


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
               shapes: tuple[tuple[int, int], ...] = ()) -> TraceResult:
    """Trace `steps` optimizer steps of the model built from `config` with the given stack depths.

    The steady-state peak is the one of the last step, when optimizer states exist.
    `depths` is informational here; the config already carries them.

    `shapes` ((batch, seq, micro-batches) triples, for `parametric.py`): one warm-up
    step of one micro-batch at the settings' own shape, then one steady-state step
    per shape on the same built model, so one build serves every point. Region peaks (with their clocks in
    `tracker.region_peaks`) are then kept for every step but the warm-up, and no
    breakdowns are computed here (the caller sweeps the events once for all of them).
    """
    if shapes:
        steps = 1 + len(shapes)
    cuda = settings.device == "cuda"
    tracker = StorageTracker(round_to=512 if cuda else 1)  # CUDACachingAllocator rounds to 512 B
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    patches = contextlib.ExitStack()
    with fake_mode, tracker, patches:
        patches.enter_context(training.quiet_transformers())  # its forward warns about the configs we build
        patches.enter_context(_deepcopy_fake_tensors_as_real_ones())  # peft copies modules; see there
        patches.enter_context(_truncated_normal_init_in_place())  # ModernBERT, SigLIP init; see there
        patches.enter_context(training.cuda_synchronize_without_cuda())  # GaLore 8-bit's step syncs
        if settings.optimizer.family == "apollo":
            patches.enter_context(_apollo_on_fake_tensors())
        if cuda:
            original_sdpa = torch.nn.functional.scaled_dot_product_attention
            torch.nn.functional.scaled_dot_product_attention = _gpu_sdpa(flash_supported=_flash_supported(settings))
            patches.callback(setattr, torch.nn.functional, "scaled_dot_product_attention", original_sdpa)
        if cuda and settings.trainer != "trainer":
            _triton_folds_in_place(patches)
        model = training.build_model(config, settings)
        for tensor in list(model.parameters()) + list(model.buffers()):
            tracker.mark(tensor, "weights")
        optimizer = _make_traced_optimizer(model, settings, cuda)
        stacks = _layer_stacks(model)
        if any(_is_experts(m) for m in model.modules()):
            patches.enter_context(_grouped_mm_any_dtype())
        position = {"step": 0, "micro": 0}
        step_tag = lambda: f"{position['step']}.{min(position['micro'], 1)}"  # noqa: E731
        handles = _install_region_hooks(tracker, stacks, step_tag)
        if cuda and settings.autocast_dtype:
            patches.enter_context(_cuda_autocast_policy())
        patches.enter_context(_module_names(tracker, model))
        micro_batches = min(settings.gradient_accumulation_steps, 2)  # later micro-batches repeat the second
        stash = getattr(model, "memfit_host_stash", None) or getattr(getattr(model, "base_model", None),
                                                                     "memfit_host_stash", None)
        host_peaks = []  # the pinned host memory each step held at most (offloaded activations)
        for step_index in range(steps):
            position["step"] = step_index
            if stash is not None:
                stash.peak = stash.live
            for micro in range(micro_batches if not shapes else shapes[step_index - 1][2] if step_index else 1):
                position["micro"] = micro
                tracker.phase = "inputs"
                tracker.set_region(f"{step_tag()}|fwd|pre")
                tracker.markers.append((tracker.clock, f"step {step_index + 1} forward{_micro_label(micro, settings)}"))
                shaped = settings if not shapes or step_index == 0 else \
                    settings.replace(batch_size=shapes[step_index - 1][0], seq_len=shapes[step_index - 1][1])
                batch = training.make_batch(shaped, config)
                tracker.phase = "forward"
                _forward_backward(model, batch, shaped, tracker, step_tag)
                del batch
                for p in model.parameters():
                    tracker.mark(p.grad, "gradients")
            tracker.phase = "optimizer"
            tracker.set_region(f"{step_tag()}|opt")
            tracker.markers.append((tracker.clock, f"step {step_index + 1} optimizer"))
            training.optimizer_step(model, optimizer, cuda_semantics=cuda)
            for p in model.parameters():  # GaLore 8-bit's step gives each target a new storage (`p.saved_data`)
                tracker.mark(p, "weights")
            for value in optimizer_state_tensors(optimizer):
                tracker.mark(value, "optimizer")
            host_peaks.append(stash.peak if stash is not None else 0)
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
        if settings.load_in_4bit:
            result.quantizable_linear_params, result.largest_linear_numel = _quantizable_linear_params(model)
        result.host_bytes = max(host_peaks, default=0)
        if shapes:  # what `parametric.py` needs to move the optimizer by formula
            result.host_peaks = host_peaks
            decay = {id(p) for p in training.param_groups(model)[0]["params"]}
            embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
            result.trainable_tensors = [(tuple(p.shape), p.element_size(), id(p) in decay, id(p) in embeddings)
                                        for p in params if p.requires_grad]
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


def _micro_label(micro: int, settings: TrainSettings) -> str:
    """', micro-batch 1' / ', micro-batches 2-8' with accumulation (the second traced one stands for the rest)."""
    steps = settings.gradient_accumulation_steps
    if steps == 1:
        return ""
    return ", micro-batch 1" if micro == 0 else (", micro-batch 2" if steps == 2 else f", micro-batches 2-{steps}")


def _forward_backward(model, batch, settings, tracker, step_tag):
    """`step.forward_backward`, with the phase switched to backward once the loss exists."""
    original_backward = torch.Tensor.backward

    def backward(loss, *args, **kwargs):
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
    """Parameters bitsandbytes would pack to 4 bits (every Linear but the head and adapters), and the largest one."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    sizes = [module.weight.numel() for name, module in model.named_modules()
             if isinstance(module, torch.nn.Linear) and module is not head
             and not any(part in name for part in ("lora_", "score", "classifier"))]
    return sum(sizes), max(sizes, default=0)


# --- extrapolation to the real depth -----------------------------------------

def _region_class(region: str, depth: int) -> list[str]:
    """Map a depth-specific region to the depth-independent classes it stands for."""
    step, phase, where = region.split("|") if region.count("|") == 2 else (region, "", "")
    if ".L" not in where:
        return [region]
    stack, layer = where.split(".L")
    layer = int(layer)
    first, last = (0, depth - 1) if phase == "fwd" else (depth - 1, 0)
    classes = []
    if layer == first:
        classes.append(f"{step}|{phase}|{stack}.first")
    if layer == last:
        classes.append(f"{step}|{phase}|{stack}.last")
    return classes


def _by_class(trace: TraceResult) -> dict[str, tuple[int, dict[str, int]]]:
    out = {}
    for region, live in trace.region_peaks.items():
        stack = region.split("|")[-1].split(".")[0] if "|" in region else ""
        depth = _depth_of(stack, trace.stack_depths or trace.depths)
        for cls in _region_class(region, depth):
            if cls not in out or live > out[cls][0]:
                out[cls] = (live, trace.region_breakdowns[region])
    return out


def exact_candidates(spec, settings: TrainSettings, *, extrapolate: bool = True) -> StepMemory:
    """Trace at small depths and extrapolate each region linearly to the model's real depth.

    A model whose forward has shapes that depend on the data (a mixture-of-experts layer that loops over the
    experts a batch hits) cannot run on fake tensors; that is reported in one line, not as a traceback.
    """
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        return _exact_candidates(spec, settings, extrapolate=extrapolate)
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        from hf_memfit.errors import MemFitError

        raise MemFitError(f"exact mode cannot trace model_type `{spec.model_type}`: its forward has shapes that "
                          f"depend on the data ({type(exc).__name__} in {exc.func if hasattr(exc, 'func') else exc}),"
                          " which fake tensors do not have; for mixture-of-experts models use transformers' "
                          "grouped_mm experts (its default where the model supports it)") from None


def _exact_candidates(spec, settings: TrainSettings, *, extrapolate: bool = True) -> StepMemory:
    real = _real_depths(spec)
    period = getattr(spec, "layer_period", 1) or 1
    # The first layer of a stack can differ from the rest (T5's relative position
    # bias lives in layer 0), so extrapolate from 2p to 3p layers, where the first
    # and the last layer are distinct and only ordinary layers are added.
    base_depth, grown_depth = 2 * period, 3 * period
    if not extrapolate or max(real) <= grown_depth:
        progress.info("exact mode: tracing %s at its full depth %s", spec.name, _depth_text(real))
        return full_depth_step_memory(trace_step(_config_with_depths(spec, real), settings, real), settings,
                                      spec)

    base = tuple(min(base_depth, d) for d in real)
    depth_sets = [base] + [tuple(grown_depth if j == i else base[j] for j in range(len(real))) for i in range(len(real))]
    traces = []
    for number, depths in enumerate(depth_sets, 1):
        progress.info("exact mode: tracing %s at depth %s (%d of %d), extrapolated to %s", spec.name,
                      _depth_text(depths), number, len(depth_sets), _depth_text(real))
        traces.append(trace_step(_config_with_depths(spec, depths), settings, depths))
    base_classes = _by_class(traces[0])
    grown_classes = [_by_class(t) for t in traces[1:]]
    candidates = {}
    for cls, (_, base_breakdown) in base_classes.items():
        extrapolated = dict(base_breakdown)
        for i, classes in enumerate(grown_classes):
            if cls not in classes:
                continue
            grown_breakdown = classes[cls][1]
            steps = (real[i] - base[i]) / period
            for key in extrapolated:
                extrapolated[key] += steps * (grown_breakdown[key] - base_breakdown[key])
        candidates[cls] = {k: max(0, int(round(v))) for k, v in extrapolated.items()}
    result = _exact_result(candidates, traces, real, base_depth, traces[0], settings, spec)

    def grow(attr):  # parameter counts grow linearly with depth too
        base_value = getattr(traces[0], attr)
        # (real - base) / period periods are added; a depth that is not a whole number of
        # periods (Gemma-3: 26 layers, period 6) adds a fraction of one, which is what it adds on average.
        return base_value + int(round(sum((real[i] - base[i]) / period * (getattr(t, attr) - base_value)
                                          for i, t in enumerate(traces[1:]))))
    result.trainable_params = grow("trainable_params")
    result.total_params = grow("total_params")
    result.quantizable_linear_params = grow("quantizable_linear_params")
    result.host_bytes = grow("host_bytes")
    return result


def full_depth_step_memory(trace: TraceResult, settings: TrainSettings, spec=None) -> StepMemory:
    """Exact mode's candidates from a trace at the model's real depth (nothing to extrapolate)."""
    candidates = {r: b for r, (_, b) in _by_class(trace).items()}
    return _exact_result(candidates, [trace], trace.depths, trace.depths[0], trace, settings, spec)


def _exact_result(candidates, traces, real, base, trace, settings, spec=None) -> StepMemory:
    step = StepMemory(candidates, trace.trainable_params, trace.total_params, trace.largest_param_numel,
                      trace.quantizable_linear_params, trace.largest_linear_numel, host_bytes=trace.host_bytes)
    moe = getattr(spec, "moe", None)
    if moe:
        from hf_memfit.generic import moe_note

        step.notes.append(moe_note(moe, settings))
    return step


def _depth_text(depths: tuple[int, ...]) -> str:
    return "+".join(map(str, depths))


def _depth_of(stack: str, depths: tuple[int, ...]) -> int:
    index = int(stack[1:]) if stack.startswith("s") and stack[1:].isdigit() else 0
    return depths[min(index, len(depths) - 1)]


def _real_depths(spec) -> tuple[int, ...]:
    depths = [spec.num_layers]
    if spec.is_encoder_decoder and getattr(spec, "num_decoder_layers", 0):
        depths.append(spec.num_decoder_layers)
    return tuple(depths)


def _config_with_depths(spec, depths: tuple[int, ...]) -> dict:
    from hf_memfit.spec import _set_path

    config = spec.with_layers(depths[0])
    keys = spec.layer_count_keys
    for key, depth in zip(keys, depths):
        _set_path(config, key, depth)
    return config

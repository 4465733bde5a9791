"""The one optimizer model: every `TrainingArguments.optim` hf-memfit plans, its state, its step, its speed.

Both estimator modes, the sharding layer and the planner read optimizers from
here and nowhere else:
- `OPTIMIZERS`: the names the HF Trainer knows (transformers 5.23
  `trainer_optimizer.py`), each with the library that implements it, the
  state layout, whether it changes the training dynamics (then the planner
  uses it only when allowed), its step throughput on the CPU and its relative
  step cost on a GPU;
- `state_bytes`: the state one trainable tensor gets, in the layout the
  implementation allocates (fast mode; exact mode builds the real optimizer);
- `tensors_step_temporary_bytes` / `step_temporary_bytes`: the most bytes of
  temporaries alive inside `optimizer.step()`, on the code path each library
  takes on the device;
- `flat_partition_state_bytes`: the state of DeepSpeed ZeRO's flat fp32 partition.

No torch here: the fast path must import nothing heavy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hf_memfit.errors import MemFitError
from hf_memfit.units import cuda_block_bytes

# bitsandbytes 8-bit optimizers keep 8-bit states only for tensors with at least
# this many elements, with one fp32 absmax per block (Optimizer8bit, bnb >= 0.46).
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCK = 256
# torchao low-bit AdamW (torchao/optim/adam.py `_new_buffer`): quantized states only for tensors of at
# least 4096 elements whose size is a multiple of the block; the others get zeros_like(param) (the
# param's dtype). The HF Trainer passes block_size=256 for both 8-bit and 4-bit (`_get_torchao_optimizer`,
# optim_args default), although torchao's own 4-bit default is 128.
TORCHAO_MIN_SIZE = 4096
TORCHAO_BLOCK = 256
# Each quantized state also holds its lookup table (`qmap`, fp32): 256 entries for 8-bit, 16 for 4-bit.
TORCHAO_QMAP_ENTRIES = {8: 256, 4: 16}
# torchao compiles one `single_param_adam` per tensor (torch.compile, fullgraph); the generated code
# materializes fp32 buffers of the tensor being updated (dequantized states and the block-wise requantization).
# Measured on the CPU allocator (profiler, torch 2.13 inductor, torchao 0.18; 1024x1024 and 512x1024 tensors,
# fp32 and bf16 params, with and without bf16 stochastic rounding): 8.03 B per element for 8-bit and 26.03 B
# for 4-bit, one tensor at a time, nothing left after the step. Inductor lowers the same graph for CUDA, so
# the same buffers are assumed there (no GPU measurement).
TORCHAO_STEP_BYTES_PER_ELEMENT = {8: 8, 4: 26}
# GaLore / APOLLO defaults as the HF Trainer passes them (`_get_galore_optimizer`, `_get_apollo_optimizer`).
LOW_RANK_DEFAULT_RANK = 128
GALORE_DEFAULT_UPDATE_PROJ_GAP = 200


@dataclass(frozen=True)
class Optimizer:
    """One `TrainingArguments.optim` value and what hf-memfit knows of it."""

    name: str
    family: str  # state layout: adam | adam8bit | adam4bit | adam32bit_bnb | adafactor | sgd | galore | apollo
    implementation: str  # torch | torch_fused | bnb | torchao | hf_adafactor | galore | apollo
    changes_dynamics: bool = False  # planned only when the user allows it (`--allow-optimizers`)
    cpu_params_per_s: float = 5e8  # step throughput on the CPU (planner's CPU speed model)
    gpu_step_factor: float = 1.0  # step time relative to fused AdamW's memory-bound step
    package: str | None = None  # what must be installed for the Trainer to build it
    paged: bool = False
    layerwise: bool = False
    state_bits: int = 32

    @property
    def low_rank(self) -> bool:
        return self.family in ("galore", "apollo")


# GPU step cost: fused AdamW touches params, grads and two fp32 states (~32 B/param, memory-bound). bitsandbytes'
# 8-bit step does block-wise (de)quantisation: 25% more (a planning figure); paging another 25% under pressure.
# torchao's low-bit AdamW: Llama-2-7B full-bf16 fine-tuning on an A100 ran at 3200 tok/s with fused AdamW, 3000
# with bnb 8-bit, 2900 with ao 8-bit and ao 4-bit (torchao/optim/README.md); a whole-step difference of ~10%,
# which at these sizes is mostly the optimizer: charged like bnb. GaLore and APOLLO add two matmuls per target
# tensor (project, project back) and GaLore an SVD every `update_proj_gap` steps: a planning figure of 2x.
# CPU throughput: measured with `python benchmarks/planner.py --calibrate` (see planner.py) for torch, bnb and
# Adafactor. torchao's compiled step, timed the same way (16 x 256 K fp32 tensors, 1 thread, best of 5 steps
# after the first, which compiles: 24 s for 8-bit, 10 s for 4-bit) right after bnb 8-bit on the same busy
# machine: 13.3 (8-bit) and 18.5 (4-bit) M params/s against bnb's 23.4, scaled to bnb's calibrated 4.5e7.
# GaLore / APOLLO are not calibrated and take adamw_torch's figure.
_TABLE = (
    Optimizer("adamw_torch_fused", "adam", "torch_fused", cpu_params_per_s=1.2e9),
    Optimizer("adamw_torch", "adam", "torch", cpu_params_per_s=5e8),
    Optimizer("adamw_bnb_8bit", "adam8bit", "bnb", cpu_params_per_s=4.5e7, gpu_step_factor=1.25,
              package="bitsandbytes", state_bits=8),
    Optimizer("adamw_8bit", "adam8bit", "bnb", cpu_params_per_s=4.5e7, gpu_step_factor=1.25,
              package="bitsandbytes", state_bits=8),
    Optimizer("paged_adamw_8bit", "adam8bit", "bnb", cpu_params_per_s=4.5e7, gpu_step_factor=1.25 * 1.25,
              package="bitsandbytes", paged=True, state_bits=8),
    Optimizer("paged_adamw_32bit", "adam32bit_bnb", "bnb", cpu_params_per_s=4.5e7, gpu_step_factor=1.25,
              package="bitsandbytes", paged=True),
    Optimizer("adamw_torch_8bit", "adam8bit", "torchao", cpu_params_per_s=2.5e7, gpu_step_factor=1.25,
              package="torchao", state_bits=8),
    Optimizer("adamw_torch_4bit", "adam4bit", "torchao", cpu_params_per_s=3.5e7, gpu_step_factor=1.25,
              package="torchao", state_bits=4),
    # transformers' Adafactor is a per-tensor Python loop of unfused ops: charged its CPU ratio to fused AdamW
    # (1.2e9 / 4.5e8 ~ 2.7, rounded down) on a GPU too, a planning figure.
    Optimizer("adafactor", "adafactor", "hf_adafactor", changes_dynamics=True, cpu_params_per_s=4.5e8,
              gpu_step_factor=2.5),
    Optimizer("sgd", "sgd", "torch", changes_dynamics=True, cpu_params_per_s=3.8e9, gpu_step_factor=0.5),
    Optimizer("galore_adamw", "galore", "galore", changes_dynamics=True, gpu_step_factor=2.0, package="galore_torch"),
    Optimizer("galore_adamw_8bit", "galore", "galore", changes_dynamics=True, gpu_step_factor=2.0,
              package="galore_torch", state_bits=8),
    Optimizer("apollo_adamw", "apollo", "apollo", changes_dynamics=True, gpu_step_factor=2.0, package="apollo_torch"),
    # The layerwise variants (transformers `_setup_low_rank_optimizer`): one optimizer per parameter,
    # stepped by a `register_post_accumulate_grad_hook` inside backward, which then frees the gradient
    # (`zero_grad()`, set_to_none), so the full gradients never exist together. The Trainer refuses them
    # with gradient accumulation > 1 (ValueError) and under DDP (NotImplementedError); `settings` does too.
    # The same work per parameter: the same step cost.
    Optimizer("galore_adamw_layerwise", "galore", "galore", changes_dynamics=True, gpu_step_factor=2.0,
              package="galore_torch", layerwise=True),
    Optimizer("galore_adamw_8bit_layerwise", "galore", "galore", changes_dynamics=True, gpu_step_factor=2.0,
              package="galore_torch", state_bits=8, layerwise=True),
    Optimizer("apollo_adamw_layerwise", "apollo", "apollo", changes_dynamics=True, gpu_step_factor=2.0,
              package="apollo_torch", layerwise=True),
)
OPTIMIZERS: dict[str, Optimizer] = {o.name: o for o in _TABLE}

# The planner's default ladder, fastest first: AdamW, then the same AdamW with quantized states (the
# numerics stay AdamW's: `changes_dynamics` is False), 8-bit before 4-bit.
ADAMW_LADDER = ("adamw_torch_fused", "adamw_bnb_8bit", "paged_adamw_8bit", "adamw_torch_8bit", "adamw_torch_4bit")
# With pure bf16 weights there is no fp32 master copy: updates smaller than bf16's resolution would be
# rounded away, so the planner uses torchao's AdamW with bf16 stochastic rounding (`optim_args`).
PURE_BF16_LADDER = ("adamw_torch_8bit", "adamw_torch_4bit")
BF16_STOCHASTIC_ROUND_ARGS = "bf16_stochastic_round=True"


def get(name: str) -> Optimizer:
    """The optimizer called `name` (a `TrainingArguments.optim` value); MemFitError if it is not modelled."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise MemFitError(f"`--optim` {name!r} is not modelled; use one of {', '.join(OPTIMIZERS)}") from None


def parse_optim_args(optim_args: str | None) -> dict[str, str] | None:
    """`TrainingArguments.optim_args` ("rank=64,bf16_stochastic_round=True") as a dict, as the Trainer parses it
    (transformers' `_parse_optim_args`: spaces dropped, comma-separated key=value pairs, the values left as strings);
    None where they are not such pairs, which the Trainer refuses (`TrainSettings.validate` names them)."""
    try:
        return dict(pair.split("=") for pair in optim_args.replace(" ", "").split(",")) if optim_args else {}
    except ValueError:
        return None


def low_rank_rank(optim_args: str | None) -> int:
    return int((parse_optim_args(optim_args) or {}).get("rank", LOW_RANK_DEFAULT_RANK))


def torchao_block_size(optim_args: str | None) -> int:
    return int((parse_optim_args(optim_args) or {}).get("block_size", TORCHAO_BLOCK))


# --- state --------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorGroup:
    """`count` trainable tensors of one shape and element size, as the optimizer sees them.

    `low_rank_target`: a 2-D weight of an `nn.Linear` named by `optim_target_modules`
    (GaLore / APOLLO project its gradient); `decay`: in the Trainer's weight-decay group;
    `embedding`: an `nn.Embedding` weight, which the Trainer gives 32-bit states under
    bitsandbytes' 8-bit optimizers (`eight_bit_states`).
    """

    shape: tuple[int, ...]
    count: int
    dtype_bytes: int
    decay: bool = True
    low_rank_target: bool = False
    embedding: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def eight_bit_states(t: TensorGroup) -> bool:
    """Whether bitsandbytes' 8-bit AdamW, as the HF Trainer builds it, keeps 8-bit states for `t`.

    Not under 4096 elements (`min_8bit_size`), and not for an `nn.Embedding` weight: the
    Trainer registers `{"optim_bits": 32}` for every embedding with bitsandbytes'
    `GlobalOptimManager` (`Trainer.create_optimizer`, transformers 5.23), so a trainable
    embedding table, and a head tied to it, keeps two fp32 states (8 B/param).
    """
    return t.numel >= BNB_MIN_8BIT_SIZE and not t.embedding


def allocated_bytes(numel: int, dtype_bytes: float, cuda: bool) -> int:
    """Bytes one tensor takes: rounded to the caching allocator's 512-byte blocks on CUDA."""
    n = int(round(numel * dtype_bytes))
    if cuda:
        n = cuda_block_bytes(n)
    return n


def _low_rank_dims(t: TensorGroup, rank: int, family: str = "galore") -> tuple[int, int, int]:
    """(long side, short side, effective rank) of a projected 2-D tensor.

    GaLore's projector is a slice of the SVD (`U[:, :rank]`), so its rank is at most
    the short side; APOLLO draws a Gaussian of the full `rank` whatever the shape
    (`stable_randn((m, rank))`), so a tensor narrower than the rank is projected *up*
    to it (random_projector.py).
    """
    rows, cols = t.shape[0], t.shape[-1]
    long, short = max(rows, cols), min(rows, cols)
    return long, short, (rank if family == "apollo" else min(rank, short))


def state_bytes(t: TensorGroup, optim: str, cuda: bool, *, optim_args: str | None = None) -> int:
    """The optimizer state the tensors of `t` get (all `t.count` of them)."""
    o = get(optim)
    n, b = t.numel, t.dtype_bytes
    nb = lambda numel, size: allocated_bytes(numel, size, cuda)  # noqa: E731
    if o.family == "sgd":
        return 0  # the Trainer's SGD has no momentum: no state
    if o.family == "adafactor":
        # transformers Adafactor (beta1=None: no exp_avg). States are made from grad.float(): fp32.
        # 2-D tensors are factored into a row and a column vector; state["RMS"] is a 0-d fp32 tensor.
        rms = nb(1, 4)
        if len(t.shape) >= 2:
            return t.count * (nb(t.shape[0], 4) + nb(t.shape[-1], 4) + rms)
        return t.count * (nb(n, 4) + rms)
    if o.family == "adam8bit" and o.implementation == "bnb":
        if eight_bit_states(t):  # uint8 state1/state2 and an fp32 absmax per block each
            return t.count * 2 * (nb(n, 1) + nb(-(-n // BNB_BLOCK), 4))
        return t.count * 2 * nb(n, 4)
    if o.family == "adam32bit_bnb":
        return t.count * 2 * nb(n, 4)  # bitsandbytes 32-bit states
    if o.implementation == "torchao":
        block = torchao_block_size(optim_args)
        # state["step"] = torch.tensor(0.0) is made on the CPU whatever the device: host memory on a GPU.
        step = 0 if cuda else 4
        if n >= TORCHAO_MIN_SIZE and n % block == 0:
            bits = o.state_bits
            one = nb(n * bits // 8, 1) + nb(n // block, 4) + nb(TORCHAO_QMAP_ENTRIES[bits], 4)  # codes, scale, qmap
            return t.count * (2 * one + step)
        return t.count * (2 * nb(n, b) + step)  # zeros_like(param)
    if o.low_rank:
        # A layerwise 8-bit optimizer per parameter fills its own two 256-entry fp32 quantization maps
        # (bitsandbytes `Optimizer8bit.fill_qmap`); one shared pair otherwise (2 KiB, not counted).
        qmaps = t.count * 2 * nb(256, 4) if o.layerwise and o.state_bits == 8 else 0
        if t.low_rank_target and len(t.shape) == 2:
            return t.count * _low_rank_state_bytes(t, o, cuda, low_rank_rank(optim_args)) + qmaps
        if o.state_bits == 8:  # GaLoreAdamW8bit is bitsandbytes' 8-bit AdamW for the rest
            # (a galore_torch class: the Trainer registers no 32-bit override for its embeddings)
            return state_bytes(replace(t, embedding=False), "adamw_bnb_8bit", cuda) + qmaps
        return t.count * 2 * nb(n, b)  # exp_avg / exp_avg_sq = zeros_like(grad); `step` is a Python int
    # torch AdamW: exp_avg and exp_avg_sq are zeros_like(param) (the param's dtype), plus a scalar fp32 `step`.
    return t.count * (2 * nb(n, b) + nb(1, 4))


def _low_rank_state_bytes(t: TensorGroup, o: Optimizer, cuda: bool, rank: int) -> int:
    """GaLore / APOLLO state of one projected [m, n] tensor.

    Both project the gradient to [max(m, n), r] / [r, max(m, n)] (the short side
    is the one reduced) and keep AdamW's two states at that size, in the
    gradient's dtype (`zeros_like(low_rank_grad)`), 8-bit under GaLoreAdamW8bit.
    The projector:
    - GaLore (galore_projector.py `get_orthogonal_matrix`): `U[:, :r]` / `Vh[:r, :]`
      of `torch.linalg.svd(full_matrices=False)`. For fp32 gradients that slice is
      a view, so the whole short x short U / Vh stays alive; for half-precision
      ones `.type(dtype)` copies r x short;
    - APOLLO (random_projector.py): a seeded Gaussian r x short matrix in the
      gradient's dtype, plus the 0-d fp32 norm-growth limiter state.
    """
    nb = lambda numel, size: allocated_bytes(numel, size, cuda)  # noqa: E731
    long, short, r = _low_rank_dims(t, rank, o.family)
    b = t.dtype_bytes
    if o.state_bits == 8 and long * r >= BNB_MIN_8BIT_SIZE:
        states = 2 * (nb(long * r, 1) + nb(-(-long * r // BNB_BLOCK), 4))
    elif o.state_bits == 8:  # bitsandbytes keeps fp32 states under `min_8bit_size`, whatever the dtype
        states = 2 * nb(long * r, 4)
    else:
        states = 2 * nb(long * r, b)
    if o.family == "galore":
        projector = nb(short * short, 4) if b == 4 else nb(r * short, b)
    else:
        projector = nb(r * short, b) + nb(1, 4)
    return states + projector


def flat_partition_state_bytes(optim: str, numel: int) -> int:
    """Optimizer state for one flat fp32 tensor of `numel` elements.

    DeepSpeed ZeRO hands the optimizer a flattened fp32 master partition (one
    1-D tensor per parameter group), so the state follows the optimizer's layout
    for a 1-D fp32 tensor: AdamW 8 B/param, 8-bit AdamW ~2 B/param, Adafactor
    unfactored (4 B/param), SGD without momentum nothing. Low-rank optimizers
    project nothing there (no 2-D tensor): plain AdamW states.
    """
    return state_bytes(TensorGroup((numel,), 1, 4), optim, cuda=False)


# --- step temporaries -------------------------------------------------------------------
# Read in the installed torch 2.13 and transformers 5.23, and checked by running each step on
# CPU tensors under a dispatch mode that tracks live storages.
#
# Which torch code path runs (torch/optim/optimizer.py, _default_to_fused_or_foreach; adam.py,
# adam()): with neither `foreach` nor `fused` given, foreach is chosen when every param is on a
# device in _get_foreach_kernels_supported_devices() = ["cuda", "xpu", "mtia", privateuse1]; fused
# is never the default ("we want to give the fused impl bake-in time"). So CUDA runs foreach and
# CPU runs the single-tensor loop. HF maps "adamw_torch" to AdamW() and "adamw_torch_fused" to
# AdamW(fused=True) (trainer_optimizer.py _get_adamw_torch); the latter is the TrainingArguments
# default from torch 2.8 on.
#
# torch optimizers keep their state in the parameter's dtype (zeros_like(p)), so for them
# `state_dtype_bytes` is also the size of a gradient element.

_TORCH_ADAM, _FUSED, _SGD, _ADAGRAD, _RMSPROP, _ADAFACTOR, _BNB, _TORCHAO = (
    "torch_adam", "fused", "sgd", "adagrad", "rmsprop", "adafactor", "bnb", "torchao")
# Every name `step_temporary_bytes` accepts (the planner's OPTIMIZERS plus the other torch and
# bitsandbytes optimizers the Trainer knows, whose temporaries follow the same code paths).
_STEP_KINDS: dict[str, str] = {
    "adamw_torch": _TORCH_ADAM, "adamw": _TORCH_ADAM, "adam": _TORCH_ADAM,
    "adamw_torch_fused": _FUSED, "adamw_apex_fused": _FUSED,
    "sgd": _SGD, "adagrad": _ADAGRAD, "rmsprop": _RMSPROP,
    "adafactor": _ADAFACTOR,
    "adamw_torch_8bit": _TORCHAO, "adamw_torch_4bit": _TORCHAO,
    **{name: _BNB for name in (
        "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit",
        "lion_8bit", "lion_32bit", "paged_lion_8bit", "paged_lion_32bit",
        "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit",
        "ademamix", "ademamix_8bit", "paged_ademamix_32bit", "paged_ademamix_8bit")},
}


def step_temporary_bytes(optim: str, trainable_params: int, state_dtype_bytes: int = 4,
                         largest_param_numel: int = 0, device: str = "cuda", *,
                         param_dtype_bytes: int | None = None,
                         weight_decay: bool = False, one_flat_tensor: bool = False) -> int:
    """Most bytes of temporaries alive at once inside `optimizer.step()`, beyond states and grads.

    `optim` is an HF `TrainingArguments.optim` name. `largest_param_numel` is the
    element count of the largest trainable tensor; paths that work one tensor at
    a time need it, and use `trainable_params` as a safe bound when it is 0.
    `param_dtype_bytes` (default: `state_dtype_bytes`) matters for Adafactor,
    whose states are always fp32. `weight_decay` is for SGD, Adagrad and RMSprop,
    which copy the gradients to add it (HF's default weight_decay is 0.0).
    `one_flat_tensor`: the parameters are a single flat tensor (DeepSpeed ZeRO's
    master partition), so no previous tensor's temporaries are still bound.
    For GaLore / APOLLO, whose temporaries depend on the tensors' shapes, use
    `tensors_step_temporary_bytes`.
    """
    kind = _STEP_KINDS.get(optim.strip().lower())
    if kind is None:
        known = ", ".join(_STEP_KINDS)
        raise MemFitError(f"`--optim` got {optim!r}, whose step temporaries are not modelled; "
                          f"use one of {known}")
    if device not in ("cuda", "cpu"):
        raise MemFitError(f"`device` got {device!r}; use cuda or cpu")
    s = state_dtype_bytes
    group = trainable_params * s  # one state-sized copy of every trainable tensor
    largest = (largest_param_numel or trainable_params) * s  # one copy of the largest tensor
    foreach = device == "cuda"  # the default path on each device, see above

    if kind == _TORCHAO:
        # One compiled update per tensor, fp32 buffers of that tensor (TORCHAO_STEP_BYTES_PER_ELEMENT).
        numel = largest_param_numel or trainable_params
        return TORCHAO_STEP_BYTES_PER_ELEMENT[4 if "4bit" in optim else 8] * numel
    if kind == _BNB and device == "cpu":
        # bitsandbytes' CPU kernels (backends/cpu/ops.py, _optimizer_update_8bit_blockwise_cpu
        # and _optimizer_update_32bit_cpu) work one tensor at a time in fp32 temporaries: the
        # dequantized state1 and state2 (8-bit only), grad.float() * gnorm_scale, p.data.float()
        # (a copy for half params) and denom = state2.sqrt() / correction2, with the sqrt alive.
        # Measured (profiler, bitsandbytes 0.50): 20 / 24 B per element of the tensor for 8-bit
        # with fp32 / half params, 12 / 16 for 32-bit. Paged optimizers fall back to these on the CPU.
        numel = largest_param_numel or trainable_params
        half = (param_dtype_bytes if param_dtype_bytes is not None else s) < 4
        return ((20 if "8bit" in optim else 12) + (4 if half else 0)) * numel
    if kind in (_FUSED, _BNB):
        # fused: one kernel updates params and states in place (torch._fused_adamw_;
        # apex multi_tensor_adam). bitsandbytes on CUDA: Optimizer2State/1State.update_step
        # launches F.optimizer_update_8bit_blockwise / optimizer_update_32bit once
        # per parameter, in place; paged states live in managed memory, not here.
        return 0
    if kind == _TORCH_ADAM:
        if foreach:
            # _multi_tensor_adam: lerp_/mul_/addcmul_ are in place; with a float lr
            # and capturable=False the bias corrections are Python floats; then
            # exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs) makes one
            # state-sized tensor per param of the device/dtype group, updated in
            # place (div_, add_) until addcdiv_. Each param group is a separate
            # call, so the real peak is the largest group; HF's no-decay group
            # (biases, norms) is tiny, so the whole trainable set is the bound.
            return group
        # _single_tensor_adam: denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        # holds sqrt and quotient at once, while the previous param's denom is
        # still bound: at most 3 x the largest tensor (2 x for one flat tensor, as
        # measured under DeepSpeed on the CPU: benchmarks/zero.py).
        return (2 if one_flat_tensor else 3) * largest
    if kind == _SGD:
        # _multi_tensor_sgd: momentum buffers update in place and nesterov adds into
        # the grads in place; only weight decay makes device_grads = _foreach_add(
        # grads, params): a grads-sized list (per tensor on the single-tensor path).
        if not weight_decay:
            return 0
        return group if foreach else largest
    if kind == _ADAGRAD:
        # _multi_tensor_adagrad: std = _foreach_sqrt(state_sums) and numerator =
        # _foreach_mul(grads, minus_clr) (or the weight-decayed grads copy) are
        # alive together. Single tensor: std = state_sum.sqrt() plus the previous
        # param's std, and a grad copy with weight decay.
        if foreach:
            return 2 * group
        return (3 if weight_decay else 2) * largest
    if kind == _RMSPROP:
        # _multi_tensor_rmsprop: avg = _foreach_sqrt(square_avgs), plus the
        # weight-decayed grads copy, which stays alive until addcdiv_. Single
        # tensor: avg = square_avg.sqrt() plus the previous param's avg.
        if foreach:
            return (2 if weight_decay else 1) * group
        return (3 if weight_decay else 2) * largest
    # Adafactor (transformers/optimization.py, Adafactor.step) works one tensor at
    # a time in fp32. At `update = (grad**2) + eps` these are alive: grad**2, the
    # sum, and the previous tensor's final `update`; later the new update plus
    # the old one, and `-update` beside `update` in p_data_fp32.add_(-update). For
    # fp16/bf16 params, the fp32 copies grad.float() and p.float() live through
    # the whole iteration. Measured on CPU: 3x (fp32 params) and 5x (half params)
    # the largest tensor's fp32 size, for same-sized tensors in a row.
    numel = largest_param_numel or trainable_params
    half = (param_dtype_bytes if param_dtype_bytes is not None else s) < 4
    return (5 if half else 3) * numel * 4


def tensors_step_temporary_bytes(tensors: list[TensorGroup], optim: str, device: str, *,
                                 optim_args: str | None = None) -> int:
    """Most temporary bytes inside `optimizer.step()` over these trainable tensors (the Trainer's two groups)."""
    if not tensors:
        return 0
    o = get(optim)
    cuda = device == "cuda"
    nb = lambda numel, size: allocated_bytes(numel, size, cuda)  # noqa: E731
    if o.implementation == "torchao":
        # Quantized tensors take the measured compiled buffers; the others (zeros_like states) run the
        # same compiled update in fp32 with no quantization: taken as free.
        block = torchao_block_size(optim_args)
        quantized = [t for t in tensors if t.numel >= TORCHAO_MIN_SIZE and t.numel % block == 0]
        return max((step_temporary_bytes(optim, t.numel, largest_param_numel=t.numel, device=device)
                    for t in quantized), default=0)
    if o.implementation == "bnb":
        # bitsandbytes: in place on CUDA; on the CPU fp32 temporaries of one tensor at a time
        # (tensors under 4096 elements keep fp32 states and take the 32-bit kernel).
        return max(step_temporary_bytes(optim if eight_bit_states(t) else "paged_adamw_32bit",
                                        t.numel, largest_param_numel=t.numel, device=device,
                                        param_dtype_bytes=t.dtype_bytes) for t in tensors)
    if o.implementation == "torch_fused":
        return 0  # fused AdamW updates params and states in place
    if o.family == "sgd":
        return step_temporary_bytes(optim, sum(t.numel * t.count for t in tensors), device=device)
    if o.family == "adafactor":
        # transformers' Adafactor works one tensor at a time in fp32: grad**2 and grad**2 + eps
        # (then the factored estimate beside the old update, then -update beside update) are two
        # fp32 copies; half-precision params add grad.float() and p.float(). The previous
        # tensor's `update` is still bound when the next one starts.
        best = prev = 0
        for g in ([t for t in tensors if t.decay], [t for t in tensors if not t.decay]):
            for t in g:
                one = nb(t.numel, 4)
                k = 2 if t.dtype_bytes == 4 else 4
                best = max(best, k * one + prev)
                prev = one
        return best
    if o.low_rank:
        if o.layerwise:  # each parameter is its own optimizer's whole step: nothing carries over between them
            return max(_low_rank_step_bytes([t], o, cuda, low_rank_rank(optim_args)) for t in tensors)
        return _low_rank_step_bytes(tensors, o, cuda, low_rank_rank(optim_args))
    # torch AdamW. The Trainer makes two param groups (decay, no decay); each is one
    # `_multi_tensor_adam` / `_single_tensor_adam` call, so only one group's temporaries live at once.
    groups = [[t for t in tensors if t.decay], [t for t in tensors if not t.decay]]
    if cuda:
        # foreach: exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs) is one state-sized tensor per
        # param of the group, updated in place until addcdiv_.
        return max(sum(t.count * nb(t.numel, t.dtype_bytes) for t in g) for g in groups)
    # single tensor: denom = (exp_avg_sq.sqrt() / bc2).add_(eps) holds sqrt and the quotient,
    # while the previous param's denom is still bound.
    best = 0
    for g in groups:
        prev = 0
        for t in g:
            one = nb(t.numel, t.dtype_bytes)
            best = max(best, 2 * one + prev)
            prev = one
    return best


def _low_rank_step_bytes(tensors: list[TensorGroup], o: Optimizer, cuda: bool, rank: int) -> int:
    """GaLore / APOLLO step temporaries, one tensor at a time (galore_torch/adamw.py, apollo_torch/apollo.py).

    The HF Trainer makes two groups: the targets (projected) and the rest. For a
    plain tensor the loop is AdamW's with `denom = exp_avg_sq.sqrt().add_(eps)` and
    `norm_grad = exp_avg / denom` alive together. For a target [m, n]:
    - GaLore: every `update_proj_gap` steps (the first one included) the projector
      runs `torch.linalg.svd` on the fp32 gradient (a `.float()` copy for half
      precision): U (m x k), S and Vh (k x n), k = min(m, n), while the old
      projector is still bound; then low_rank_grad, denom and norm_grad (long x r
      each), and the projection back: a full m x n matmul output and its `* scale`
      copy;
    - APOLLO: the same low-rank triple, then `scaled_grad = p.grad * factor` (m x n)
      and the column norms.
    The previous tensor's `norm_grad` is still bound when the next tensor starts.
    """
    nb = lambda numel, size: allocated_bytes(numel, size, cuda)  # noqa: E731
    if o.family == "galore" and o.state_bits == 8:
        return _galore_8bit_step_bytes(tensors, cuda, rank)
    best = prev = 0
    for t in tensors:
        b = t.dtype_bytes
        if t.low_rank_target and len(t.shape) == 2:
            long, short, r = _low_rank_dims(t, rank, o.family)
            full = nb(t.numel, b)
            low = nb(long * r, b)
            # The previous tensor's full-size `norm_grad` is released when this tensor's low-rank
            # `norm_grad` is made, before the projection back (GaLore) or the scaled gradient (APOLLO).
            before_back = 3 * low + prev
            if o.family == "galore":
                peak = max(_galore_svd_bytes(t, cuda, rank) + prev, before_back, 3 * low + 2 * full)
            else:  # the limiter's `scaled_grad / limiter` beside `scaled_grad`, and the column norms
                peak = max(before_back, 3 * low + 2 * full + nb(long, 4))
            best, prev = max(best, peak), full
            continue
        best = max(best, 2 * nb(t.numel, b) + prev)
        prev = nb(t.numel, b)
    return best


def _galore_svd_bytes(t: TensorGroup, cuda: bool, rank: int = LOW_RANK_DEFAULT_RANK) -> int:
    """GaLore's projector refresh on one [m, n] gradient (galore_projector.py `get_orthogonal_matrix`).

    `torch.linalg.svd` of the fp32 gradient (a `.float()` copy for half precision):
    U (m x k), S (k) and Vh (k x n), k = min(m, n); then the unused factor times
    `diag(S[:r])` (an r x r diagonal, and an fp32 product of the long side x r), and
    for half precision the kept factor's r x short copy in the gradient's dtype,
    made while the old projector is still bound (fp32 keeps a view of U / Vh).
    """
    nb = lambda numel, size: allocated_bytes(numel, size, cuda)  # noqa: E731
    long, short, r = _low_rank_dims(t, rank)
    b = t.dtype_bytes
    half_copy = nb(t.numel, 4) if b != 4 else 0
    factors = nb(long * short, 4) + nb(short * short, 4) + nb(short, 4)
    new_projector = nb(r * short, b) if b != 4 else 0
    return half_copy + factors + nb(long * r, 4) + max(nb(r * r, 4), new_projector)


def _bnb_update_bytes(numel: int, dtype_bytes: int, cuda: bool) -> int:
    """bitsandbytes' update of one tensor: in place on CUDA, fp32 temporaries on the CPU (8-bit from 4096 elements)."""
    optim = "adamw_bnb_8bit" if numel >= BNB_MIN_8BIT_SIZE else "paged_adamw_32bit"
    return step_temporary_bytes(optim, numel, largest_param_numel=numel, device="cuda" if cuda else "cpu",
                                param_dtype_bytes=dtype_bytes)


def _galore_8bit_step_bytes(tensors: list[TensorGroup], cuda: bool, rank: int) -> int:
    """`GaLoreAdamW8bit.step` (galore_torch/adamw8bit.py, bitsandbytes' Optimizer2State), one tensor at a time.

    The Trainer's groups come in order: the rest (plain bnb 8-bit AdamW), then the
    targets. For a target [m, n] (long side L, rank r), beyond the states:
    - every `update_proj_gap` steps, GaLore's SVD (`_galore_svd_bytes`);
    - `grad` = the low-rank projection (L x r), then `p.saved_data = p.data.clone()`
      (m x n); `p.data = grad.clone()` (L x r) releases the weight's own storage, and
      `p.grad = grad` the full gradient;
    - bnb's update of the L x r tensor (`_bnb_update_bytes`);
    - the projection back: the m x n matmul and its `* scale` copy, added into
      `saved_data`, which becomes `p.data` again (the L x r copy is released).
    So each target leaves its gradient at L x r until `zero_grad`: the full gradients
    already replaced before a tensor are subtracted from its peak.
    """
    nb = lambda numel, size: allocated_bytes(numel, size, cuda)  # noqa: E731
    best = released = 0
    targets = [t for t in tensors if t.low_rank_target and len(t.shape) == 2]
    rest = [t for t in tensors if not (t.low_rank_target and len(t.shape) == 2)]
    for t in rest:
        best = max(best, _bnb_update_bytes(t.numel, t.dtype_bytes, cuda))
    for t in targets:
        long, _, r = _low_rank_dims(t, rank)
        full, low = nb(t.numel, t.dtype_bytes), nb(long * r, t.dtype_bytes)
        kernel = _bnb_update_bytes(long * r, t.dtype_bytes, cuda)
        one = max(_galore_svd_bytes(t, cuda, rank), low + full, 2 * low - full + kernel, 2 * low + full)
        best = max(best, one - released)
        # Identical tensors are a stack's layers, stepped layer by layer: the first of each
        # shape comes after one of every earlier shape, so only one of each is released before it.
        released += full - low
    return best

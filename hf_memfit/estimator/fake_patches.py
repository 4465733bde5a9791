"""What the exact trace patches so that a model trains on fake CPU tensors as it would on a GPU.

CUDA semantics that a CPU-only torch cannot run (the SDPA backend a GPU picks and what its kernels keep,
CUDA autocast's fp32 op list, Triton kernels that fold in place), and what fake tensors cannot do as
transformers and peft use them (in-place truncated-normal init, grouped matmuls of any dtype, deep copies).
Each item is sourced in `shared/CUDA_MEMORY_FACTS.md` or in the comment beside it.
"""

import contextlib
import copy
import functools
import os

import torch
from torch._subclasses.fake_tensor import FakeTensor


# --- CUDA semantics on fake CPU tensors ------------------------------------

def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


class GpuAttentionMemory(torch.autograd.Function):
    """What SDPA's flash / memory-efficient CUDA kernels allocate, on fake tensors.

    Values do not matter under FakeTensorMode; the allocations do. Sources
    (aten/src/ATen/native/transformers/cuda, summarised in CUDA_MEMORY_FACTS.md):
    - forward: output [b,s,h,d] in the input dtype, logsumexp fp32 [b,h,s]
      (memory-efficient pads s to a multiple of 32); q, k, v are saved as they are.
    - backward: dq, dk, dv; flash adds `dq_accum` fp32 [b, round128(s), h, round32(d)]
      and `softmax_d` fp32 [b, h, round128(s)]; memory-efficient adds `delta` fp32
      [b,h,s] and a grad-q accumulation workspace of q's size in fp32.
    - grouped-query attention: flash takes k and v with fewer heads as they are (sdp_utils.cpp
      `can_use_flash_attention`: `backend_supports_grouped_query_attention = true` on CUDA), and its
      backward writes dk and dv for every query head into `dk_expanded` / `dv_expanded` [b, s_k, h, d]
      before summing each group (flash_api.cpp `mha_bwd`, "MQA / GQA").
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
            if k.shape[1] != h:  # dk_expanded, dv_expanded
                scratch += [torch.empty((b, k.shape[2], h, t.shape[-1]), dtype=q.dtype, device=q.device) for t in (k, v)]
        else:
            scratch = [torch.empty((b, h, s), dtype=torch.float32, device=q.device),
                       torch.empty(q.shape, dtype=torch.float32, device=q.device)]
        grads = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        del scratch
        return (*grads, None)


def gpu_sdpa(flash_supported: bool):
    """A stand-in for F.scaled_dot_product_attention that follows CUDA's backend choice."""
    original = torch.nn.functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **kw):
        device_type = query.device.type
        if torch.is_autocast_enabled(device_type):
            # CUDA autocast runs scaled_dot_product_attention in the lower precision (autocast_mode.cpp, its
            # lower_precision_fp list), casting every floating input. This stand-in is Python, above the
            # dispatcher, so autocast never sees the aten op: cast as it would. (A half-precision model's RoPE
            # makes q and k fp32 under mixed precision, since its cos/sin follow the fp32 hidden states.)
            low = torch.get_autocast_dtype(device_type)
            query, key, value = (t.to(low) if t.is_floating_point() and t.dtype != low else t
                                 for t in (query, key, value))
            if attn_mask is not None and attn_mask.is_floating_point() and attn_mask.dtype != low:
                attn_mask = attn_mask.to(low)
        half = query.dtype in (torch.float16, torch.bfloat16)
        head_dim = query.shape[-1]
        # sdp_utils.cpp: flash needs no mask, fp16/bf16, sm80+, head_dim <= 256; it runs GQA as it is.
        if flash_supported and attn_mask is None and half and head_dim <= 256:
            return GpuAttentionMemory.apply(query, key, value, "flash")
        if key.shape[1] != query.shape[1]:  # GQA elsewhere: the kernels see k/v expanded to all heads
            repeat = query.shape[1] // key.shape[1]
            key = key.repeat_interleave(repeat, dim=1)
            value = value.repeat_interleave(repeat, dim=1)
        # memory-efficient takes masks and fp32; its own limits are far above our head dims.
        if head_dim % 8 == 0:
            out = GpuAttentionMemory.apply(query, key, value, "efficient")
            if attn_mask is not None and attn_mask.requires_grad:
                out = out + 0 * attn_mask.sum()
            return out
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, **kw)

    return sdpa


# What CUDA autocast runs in fp32 and CPU autocast does not (autocast_mode.cpp
# fp32 lists), as (namespace, attribute) pairs the model code calls through.
# pow is on CUDA's list and not on the CPU's: GPT-2's NewGELU (`torch.pow(x, 3.0)`)
# keeps an fp32 copy of its input and an fp32 result on a GPU (an H100 check of
# GPT-2 held 84 MiB a layer there where the CPU policy gives 48).
_CUDA_FP32_OPS = (
    (torch.nn.functional, "layer_norm"), (torch, "layer_norm"), (torch.nn.functional, "group_norm"),
    (torch.nn.functional, "softmax"), (torch, "softmax"), (torch.Tensor, "softmax"),
    (torch.nn.functional, "log_softmax"), (torch, "log_softmax"), (torch.Tensor, "log_softmax"),
    (torch, "pow"), (torch.Tensor, "pow"), (torch.Tensor, "__pow__"),
)


@contextlib.contextmanager
def _wrapped(owners, wrap):
    """While open, each `owner.name` of `owners` is `wrap(original)`; the originals come back after."""
    originals = [(owner, name, getattr(owner, name)) for owner, name in owners]
    try:
        for owner, name, original in originals:
            setattr(owner, name, wrap(original))
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


@contextlib.contextmanager
def cuda_autocast_policy():
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

    with _wrapped(_CUDA_FP32_OPS, fp32_when_autocast), _wrapped(((torch.nn.functional, "cross_entropy"),),
                                                               _cuda_cross_entropy):
        yield


def _cuda_cross_entropy(original):
    """`F.cross_entropy` of half-precision logits as CUDA autocast runs it.

    CPU autocast has `cross_entropy_loss` on its fp32 list: it casts the logits to fp32 and runs log_softmax and
    its backward in fp32. CUDA autocast has it on neither list, so it decomposes (LossNLL.cpp
    `cross_entropy_loss`): `log_softmax(x, dim, x.dtype)`, which keeps the logits' dtype because the dtype is
    given (fp32_set_opt_dtype), then `nll_loss`, which is on the fp32 list and so gets an fp32 copy. Whisper's
    H100 snapshot (docs/benchmarks.md section 21) holds exactly these: the fp16 log_softmax output and its fp32
    copy, then in backward the fp32 gradient, its fp16 cast and the fp16 log_softmax backward. Causal LMs are
    untouched: transformers' loss upcasts their logits to fp32 first. Label smoothing and the deprecated
    `size_average` / `reduce` keep the original path."""

    @functools.wraps(original)
    def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                      reduction="mean", label_smoothing=0.0):
        if (not torch.is_autocast_enabled("cpu") or input.dtype not in (torch.float16, torch.bfloat16)
                or label_smoothing or size_average is not None or reduce is not None
                or target.is_floating_point()):
            return original(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        with torch.autocast("cpu", enabled=False):
            log_probs = torch.log_softmax(input, 0 if input.dim() == 1 else 1, dtype=input.dtype)
            return torch.nn.functional.nll_loss(log_probs.float(), target, None if weight is None else weight.float(),
                                                ignore_index=ignore_index, reduction=reduction)

    return cross_entropy


@contextlib.contextmanager
def cuda_dropout():
    """Training-mode dropout as CUDA runs it: the fused `native_dropout`, which saves a bool mask.

    aten/src/ATen/native/Dropout.cpp `dropout`: on a CUDA tensor with 0 < p < 1 (`is_fused_kernel_acceptable`)
    it returns `std::get<0>(at::native_dropout(input, p, train))`, and NativeDropoutBackward0 keeps the bool
    mask (1 B an element); a CPU tensor takes `_dropout_impl`, whose multiply keeps noise of the input's dtype
    (2 or 4 B). Measured on an H100 (docs/benchmarks.md section 19): GPT-2's dropouts kept 1.5 MiB masks for
    [4, 512, 768] activations, and wav2vec2's feed-forward dropouts were over-predicted by the CPU mask.
    `native_dropout` runs on fake CPU tensors as it does on a GPU, so the trace calls it.
    """

    def fused(original):
        @functools.wraps(original)
        def dropout(input, p=0.5, training=True, inplace=False):
            if training and 0 < p < 1 and not inplace and input.numel() > 0:
                return torch.native_dropout(input, p, True)[0]
            return original(input, p, training, inplace)

        return dropout

    with _wrapped(((torch.nn.functional, "dropout"),), fused):
        yield


class _CudaSoftmax(torch.autograd.Function):
    """`_softmax` whose backward allocates as CUDA's does: the result, then `grad * output` (see below)."""

    @staticmethod
    def forward(ctx, x, dim):
        out = torch._softmax(x, dim, False)
        ctx.save_for_backward(out)
        ctx.dim = dim
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors  # a checkpointed layer's recomputed output is alive only in here
        grad_input = torch._softmax_backward_data(grad, out, ctx.dim, out.dtype)
        tmp = torch.empty_like(grad)
        del tmp
        return grad_input, None


@contextlib.contextmanager
def cuda_softmax_backward():
    """CUDA's softmax backward also makes `tmp = grad * output`, the size of the gradient, beside its result.

    aten/src/ATen/native/cuda/SoftMax.cu, `softmax_backward_cuda_out`: the structured kernel's `grad_input`
    is allocated first, then `Tensor tmp = grad * output;` feeds `host_softmax_backward` (the CPU kernel
    makes no such temporary, and log_softmax's CUDA backward none either). Found on an H100: eager
    attention's backward held one more fp32 [b, heads, s, s] buffer than the trace (docs/benchmarks.md
    section 19). Softmax runs as an autograd Function whose backward allocates the same, while its saved
    output is unpacked: under checkpointing that recomputed output lives only inside the backward, so a
    hook on the node (before or after it runs) would miss it, as a first version did (-22% on the H100).
    """

    def with_cuda_backward(original):
        @functools.wraps(original)
        def softmax(input, dim=None, *args, dtype=None, **kwargs):
            if args or kwargs or dim is None or not (torch.is_grad_enabled() and input.requires_grad):
                return original(input, dim, *args, dtype=dtype, **kwargs)
            return _CudaSoftmax.apply(input if dtype is None else input.to(dtype), dim)

        return softmax

    with _wrapped(((torch.nn.functional, "softmax"), (torch, "softmax"), (torch.Tensor, "softmax")),
                  with_cuda_backward):
        yield


@contextlib.contextmanager
def truncated_normal_init_in_place():
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

def is_experts(module) -> bool:
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
def grouped_mm_any_dtype():
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


def triton_folds_in_place(patches: contextlib.ExitStack) -> None:
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


# --- transformers' value-dependent mask decisions ----------------------------------

@contextlib.contextmanager
def masks_as_the_batch_has(padding_free: bool):
    """Let transformers decide on the attention mask from the traced batch as it does from the real one.

    With no cache and no 2-D attention mask (TRL's fused head calls the backbone with
    `use_cache=False`; SFT batches carry no padding), `create_causal_mask` looks for
    packed sequences in the position ids (`find_packed_sequence_indices`, transformers
    5.24 masking_utils.py): on real tensors it reads the values and returns None for
    one sequence per row (positions 0..s-1), and SDPA then runs with `is_causal` and
    native GQA. On a FakeTensor it cannot read them (`is_tracing` is true for fake
    tensors) and returns the packed mask, so the trace would build a [b, 1, s, s]
    additive mask and repeat K/V for every head: memory the real step never
    allocates (+8% at 8 x 1024 tokens). `make_batch` packs sequences exactly when
    the settings are padding-free, so that is the real answer here.

    Likewise with a 2-D attention mask (DPO's batches): `_ignore_causal_mask_sdpa`
    skips the mask when the padding mask is all ones (`fast_all`), but refuses to
    read a fake one. `make_batch`'s masks are all ones (every row as long as the
    plan's longest, as fast mode assumes), so the real step skips it: the check
    is made as on a batch without padding. So is an encoder's
    (`_ignore_bidirectional_mask_sdpa`, `create_bidirectional_mask`): ModernBERT's
    multiple-choice step built a [b x choices, 1, s, s] mask for its global layers that
    the real step skips (+1.9% against the CPU allocator; a sliding-window layer's mask is
    built either way, as the window asks).
    """
    import transformers.masking_utils as masking

    find_packed = masking.find_packed_sequence_indices
    skips = {name: getattr(masking, name) for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")}

    def find_packed_sequence_indices(position_ids):
        found = find_packed(position_ids)
        return found if padding_free else None

    def as_without_padding(skip):
        def decide(padding_mask, *args, **kwargs):
            if padding_mask is not None and isinstance(padding_mask, FakeTensor):
                padding_mask = None  # all ones in make_batch: what the real check finds on the real batch
            return skip(padding_mask, *args, **kwargs)
        return decide

    masking.find_packed_sequence_indices = find_packed_sequence_indices
    for name, skip in skips.items():
        setattr(masking, name, as_without_padding(skip))
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = find_packed
        for name, skip in skips.items():
            setattr(masking, name, skip)


# --- deep copies of fake tensors ------------------------------------------------

@contextlib.contextmanager
def deepcopy_fake_tensors_as_real_ones():
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


@contextlib.contextmanager
def environment(name: str, value: str):
    """An environment variable set for the trace, and restored after."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def spec_augment_off(model) -> None:
    """Trace wav2vec2-style models without SpecAugment's masking, which fake tensors cannot run.

    In training it writes a learned vector into a random mask of frames by boolean indexing
    (`_mask_hidden_states`), whose shape depends on the data. What it holds is a bool per frame and the
    masked frames' indices: bytes per frame, against the kilobytes per frame of a layer's activations.
    LayerDrop (`layerdrop`, `encoder_layerdrop`, `decoder_layerdrop`) skips whole layers at random, decided by
    comparing a random scalar on the device: traced with every layer run, the step's worst case.
    """
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "apply_spec_augment", False):
            config.apply_spec_augment = False
        for name in ("layerdrop", "encoder_layerdrop", "decoder_layerdrop"):
            if getattr(config, name, 0):
                setattr(config, name, 0.0)

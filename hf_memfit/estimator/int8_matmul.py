"""The stand-in forward of a bitsandbytes `Linear8bitLt` in the traced step (why each allocation: `int8.py`)."""

from __future__ import annotations

import torch

from hf_memfit.estimator.int8 import LLM_INT8_THRESHOLD


class Int8Matmul(torch.autograd.Function):
    """bitsandbytes' int8 matmul with a frozen weight, on a stand-in weight in the compute dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, cuda: bool):
        out = _cuda_forward(x, weight, bias) if cuda else _cpu_forward(x, weight, bias)
        if ctx.needs_input_grad[0]:
            # MatMul8bitLt's `ctx.tensors = (CAt, subA, A)` / MatMul8bitFp's `ctx.A = A`: attributes, not
            # save_for_backward, so activation checkpointing cannot drop them: the input lives until backward.
            ctx.x, ctx.weight = x, weight
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.x, ctx.weight
        # The weight dequantised in x's dtype is `pack_8bit`'s temporary (both modes add it by formula); here only
        # the input's gradient is allocated. On real tensors it is computed.
        if isinstance(x, torch._subclasses.fake_tensor.FakeTensor):
            return torch.empty_like(x), None, None, None
        return (grad.to(weight.dtype) @ weight).to(x.dtype), None, None, None


def _cuda_forward(x, weight, bias):
    """MatMul8bitLt.forward's allocations (fast path, frozen weight, no outlier columns counted)."""
    a16 = x.to(torch.float16)  # `A.to(torch.float16)`: a copy unless x is fp16
    ca = torch.empty_like(a16, dtype=torch.int8)  # int8_vectorwise_quant's out_row (CA), kept to the forward's end
    outliers = a16.abs() >= LLM_INT8_THRESHOLD  # the threshold's fp16 |A| and bool mask
    del outliers, a16  # the fp16 copy dies when int8_vectorwise_quant returns
    i32 = x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.int32)  # int8_linear_matmul
    o16 = torch.empty_like(i32, dtype=torch.float16)  # int8_mm_dequant: fp16 only ("cuda kernel only ... fp16")
    if bias is not None:
        o16.add_(bias)  # in place (fused for an fp16 bias)
    out = o16.to(x.dtype)
    del ca, i32, o16
    return out  # values undefined: this path only runs in the trace, on fake tensors


def _cpu_forward(x, weight, bias):
    """MatMul8bitFp.forward: the whole weight dequantised to x's dtype, then F.linear."""
    dequantised = weight.to(x.dtype, copy=True)
    return torch.nn.functional.linear(x, dequantised, None if bias is None else bias.to(x.dtype))


def like_linear8bit(module, cuda: bool) -> None:
    """Make a stand-in nn.Linear (or GPT-2 Conv1D) run as `Linear8bitLt.forward` does."""
    from transformers.pytorch_utils import Conv1D

    weight = (lambda: module.weight.t()) if isinstance(module, Conv1D) else (lambda: module.weight)

    def forward(x):
        return Int8Matmul.apply(x, weight(), module.bias, cuda)

    module.forward = forward

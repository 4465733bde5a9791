"""The CUDA kernel path of state-space mixers, on fake tensors: what mamba-ssm and causal-conv1d allocate.

A GPU user has `mamba-ssm` and `causal-conv1d` installed, and transformers' mixers then call their autograd
Functions (see `models/ssm.py`). Those cannot be installed here (CUDA builds), so each stand-in below is an
autograd Function that allocates on fake tensors what the real one allocates and saves, with the sizes and
dtypes read from the sources (mamba-ssm 2.2, causal-conv1d 1.5):
- `mamba_ssm/ops/selective_scan_interface.py`: `SelectiveScanFn`, `MambaInnerFn` (checkpoint_lvl=1: conv1d_out
  and delta are recomputed in backward);
- `csrc/selective_scan/selective_scan.cpp`: fwd allocates `out` (empty_like(delta)), `x` fp32
  [b, d, ceil(L/2048), 2*d_state] (the chunk states) and `out_z` (empty_like(z)); bwd allocates du, ddelta,
  dA, fp32 dB / dC (then `.to(B.dtype)`), dD, ddelta_bias, dz (unless given) and out_z when recomputed;
- `mamba_ssm/ops/triton/ssd_combined.py`: `MambaSplitConv1dScanCombinedFn` saves zxbcdt, the scan output
  `out_x` [b, s, h, p], the gated RMSNorm's rstd fp32 [groups*b*s] and the (autocast) out_proj weight; its
  chunked scan keeps fp32 dt / dA_cumsum [b, h, nchunks, chunk], fp32 states [b, nchunks, h, p, n] and
  fp32 CB [b, nchunks, g, chunk, chunk] while it runs, and again in backward;
- `causal_conv1d/causal_conv1d_interface.py`: `CausalConv1dFn` saves x and weight; out is empty_like(x);
  bwd allocates dx and fp32 dweight / dbias.
Values do not matter under FakeTensorMode; the allocations and their lifetimes do.
"""

from __future__ import annotations

import contextlib
import math
import sys

import torch

from hf_memfit.models.ssm import SELECTIVE_SCAN_CHUNK


def _empty(shape, dtype, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(int(s) for s in shape), dtype=dtype, device=like.device)


def _autocast_dtype() -> torch.dtype | None:
    # The trace runs CUDA's mixed precision as CPU autocast on fake tensors (estimator/step.py).
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


def _cast(weight: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """`weight.to(autocast dtype)` as MambaInnerFn / MambaSplitConv1dScanCombinedFn do: a copy when it changes."""
    if weight is None or dtype is None or weight.dtype == dtype:
        return weight
    return _empty(weight.shape, dtype, weight)


def _contiguous_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _scan_states(b: int, d: int, length: int, d_state: int, like) -> torch.Tensor:
    # selective_scan.cpp: x = zeros({batch, dim, n_chunks, dstate * 2}, weight_type) with n_chunks = ceil(L / 2048)
    return _empty((b, d, math.ceil(length / SELECTIVE_SCAN_CHUNK), 2 * d_state), torch.float32, like)


class SelectiveScanMemory(torch.autograd.Function):
    """mamba-ssm `SelectiveScanFn` (selective_scan_fn), as Jamba's mixer calls it with z (the gate)."""

    @staticmethod
    def forward(ctx, u, delta, A, B, C, D, z, delta_bias):
        u, delta, B, C = (_contiguous_last(t) for t in (u, delta, B, C))
        z = _contiguous_last(z) if z is not None else None
        b, d, length = u.shape
        out = _empty(delta.shape, delta.dtype, delta)  # empty_like(delta)
        states = _scan_states(b, d, length, A.shape[-1], u)
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, states, out)
        if z is None:
            return out
        return _empty(z.shape, z.dtype, z)  # out_z = empty_like(z)

    @staticmethod
    def backward(ctx, dout):
        u, delta, A, B, C, D, z, delta_bias, states, out = ctx.saved_tensors
        dout = _contiguous_last(dout)
        du, ddelta = _empty(u.shape, u.dtype, u), _empty(delta.shape, delta.dtype, delta)
        dA = _empty(A.shape, A.dtype, A)
        dB32, dC32 = _empty(B.shape, torch.float32, B), _empty(C.shape, torch.float32, C)  # fp32 for variable B/C
        dB, dC = dB32.to(B.dtype), dC32.to(C.dtype)
        del dB32, dC32
        dD = _empty(D.shape, D.dtype, D) if D is not None else None
        ddelta_bias = _empty(delta_bias.shape, delta_bias.dtype, delta_bias) if delta_bias is not None else None
        dz = _empty(z.shape, z.dtype, z) if z is not None else None
        return du, ddelta, dA, dB, dC, dD, dz, ddelta_bias


class MambaInnerMemory(torch.autograd.Function):
    """mamba-ssm `MambaInnerFn` (mamba_inner_fn, checkpoint_lvl=1), as Mamba / FalconMamba's mixer calls it."""

    @staticmethod
    def forward(ctx, xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                out_proj_bias, A, D, delta_bias):
        amp = _autocast_dtype()
        compute = amp or x_proj_weight.dtype
        x_proj_w, delta_proj_w = _cast(x_proj_weight, amp), _cast(delta_proj_weight, amp)
        out_proj_w, out_proj_b = _cast(out_proj_weight, amp), _cast(out_proj_bias, amp)
        xz = _contiguous_last(xz)
        b, two_d, length = xz.shape
        d, rank, d_state = two_d // 2, delta_proj_weight.shape[1], A.shape[-1]
        conv1d_out = _empty((b, d, length), xz.dtype, xz)  # causal_conv1d_fwd: empty_like(x)
        x_dbl = _empty((b * length, x_proj_weight.shape[0]), compute, xz)  # F.linear(conv1d_out, x_proj_weight)
        delta = _empty((d, b * length), compute, xz)  # delta_proj_weight @ x_dbl[:, :rank].t()
        B = _empty((b, 1, d_state, length), compute, xz)  # rearrange(...).contiguous()
        C = _empty((b, 1, d_state, length), compute, xz)
        out = _empty((b, d, length), compute, xz)  # selective_scan fwd: empty_like(delta)
        states = _scan_states(b, d, length, d_state, xz)
        out_z = _empty((b, d, length), compute, xz)
        result = _empty((b, length, out_proj_weight.shape[0]), compute, xz)  # F.linear(out_z^T, out_proj_weight)
        del conv1d_out, delta, out_z  # checkpoint_lvl=1: conv1d_out and delta are recomputed in backward
        ctx.save_for_backward(xz, conv1d_weight, conv1d_bias, x_dbl, x_proj_w, delta_proj_w, out_proj_w, A, B, C,
                              D, delta_bias, states, out)
        ctx.rank, ctx.has_out_bias = rank, out_proj_bias is not None
        return result

    @staticmethod
    def backward(ctx, dout):
        (xz, conv1d_weight, conv1d_bias, x_dbl, x_proj_w, delta_proj_w, out_proj_w, A, B, C, D, delta_bias,
         states, out) = ctx.saved_tensors
        b, two_d, length = xz.shape
        d, compute = two_d // 2, out.dtype
        conv1d_out = _empty((b, d, length), xz.dtype, xz)  # recomputed
        delta = _empty((b, d, length), compute, xz)  # recomputed
        dxz = _empty(xz.shape, xz.dtype, xz)  # empty_like(xz); dx, dz are its halves
        dout_y = _empty((d, b * length), compute, xz)  # out_proj_weight.t() @ dout
        # selective_scan bwd with dz given and recompute_out_z=True
        dconv1d_out, ddelta = _empty(conv1d_out.shape, xz.dtype, xz), _empty(delta.shape, compute, xz)
        dA = _empty(A.shape, A.dtype, A)
        dB32, dC32 = _empty(B.shape, torch.float32, B), _empty(C.shape, torch.float32, C)
        dB, dC = dB32.to(B.dtype), dC32.to(C.dtype)
        del dB32, dC32
        dD = _empty(D.shape, D.dtype, D) if D is not None else None
        ddelta_bias = _empty(delta_bias.shape, delta_bias.dtype, delta_bias) if delta_bias is not None else None
        out_z = _empty((b, d, length), compute, xz)
        dout_proj_weight = _empty(out_proj_w.shape, compute, xz)  # einsum("eB,dB->ed", dout, out_z)
        dout_proj_bias = _empty((out_proj_w.shape[0],), compute, xz) if ctx.has_out_bias else None
        del out_z, dout_y
        dx_dbl = _empty(x_dbl.shape, x_dbl.dtype, x_dbl)  # empty_like(x_dbl)
        dB, dC = dB.reshape(b * length, -1).contiguous(), dC.reshape(b * length, -1).contiguous()
        del dB, dC
        ddelta_proj_weight = _empty(delta_proj_w.shape, compute, xz)
        dx_proj_weight = _empty(x_proj_w.shape, compute, xz)
        del ddelta, conv1d_out, delta
        # causal_conv1d_bwd writes dx into dxz; dweight / dbias fp32, then cast back
        dconv1d_weight = _empty(conv1d_weight.shape, torch.float32, xz).to(conv1d_weight.dtype)
        dconv1d_bias = (_empty(conv1d_bias.shape, torch.float32, xz).to(conv1d_bias.dtype)
                        if conv1d_bias is not None else None)
        del dconv1d_out
        return (dxz, dconv1d_weight, dconv1d_bias, dx_proj_weight, ddelta_proj_weight, dout_proj_weight,
                dout_proj_bias, dA, dD, ddelta_bias)


class CausalConv1dMemory(torch.autograd.Function):
    """causal-conv1d `CausalConv1dFn` (causal_conv1d_fn), as Jamba's mixer calls it."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        if x.stride(2) != 1 and x.stride(1) != 1:
            x = x.contiguous()
        ctx.save_for_backward(x, weight, bias)
        return _empty(x.shape, x.dtype, x)  # causal_conv1d_fwd: empty_like(x)

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias = ctx.saved_tensors
        dx = _empty(x.shape, x.dtype, x)
        dweight = _empty(weight.shape, torch.float32, weight).to(weight.dtype)  # zeros_like(weight, fp32)
        dbias = _empty(bias.shape, torch.float32, bias).to(bias.dtype) if bias is not None else None
        return dx, dweight, dbias


class Mamba2CombinedMemory(torch.autograd.Function):
    """mamba-ssm `MambaSplitConv1dScanCombinedFn` with rmsnorm and out_proj, as Mamba-2's mixer calls it."""

    @staticmethod
    def forward(ctx, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight, outproj_weight,
                outproj_bias, chunk_size, headdim, ngroups):
        amp = _autocast_dtype()
        b, s, _ = zxbcdt.shape
        heads = A.shape[0]
        dim = heads * headdim
        conv_dim = conv1d_weight.shape[0]
        d_state = (conv_dim - dim) // ngroups // 2
        xbc_conv = _empty((b, s, conv_dim), zxbcdt.dtype, zxbcdt)  # causal_conv1d_fwd, channel last
        scratch = _chunk_scan_scratch(b, s, heads, headdim, ngroups, d_state, chunk_size, zxbcdt)
        out_x = _empty((b, s, heads, headdim), zxbcdt.dtype, zxbcdt)  # _chunk_scan_fwd's out (z=None)
        del xbc_conv, scratch
        # with rmsnorm: _layer_norm_fwd's output, gated by z; without (Falcon-H1's default): the scan's own
        # z-gated output beside out_x
        normed = _empty((b * s, dim), zxbcdt.dtype, zxbcdt)
        rstd = _empty((ngroups * b * s,), torch.float32, zxbcdt) if rmsnorm_weight is not None else None
        outproj_w, outproj_b = _cast(outproj_weight, amp), _cast(outproj_bias, amp)
        if amp is not None and normed.dtype != amp:
            normed = normed.to(amp)
        out = _empty((b, s, outproj_weight.shape[0]), amp or outproj_weight.dtype, zxbcdt)  # F.linear
        del normed
        ctx.save_for_backward(zxbcdt, conv1d_weight, conv1d_bias, out_x, A, D, dt_bias, rmsnorm_weight, rstd,
                              outproj_w, outproj_b)
        ctx.shape = (chunk_size, headdim, ngroups, d_state)
        return out

    @staticmethod
    def backward(ctx, dout):
        zxbcdt, conv1d_weight, conv1d_bias, out_x, A, D, dt_bias, rmsnorm_weight, rstd, outproj_w, outproj_b = \
            ctx.saved_tensors
        chunk_size, headdim, ngroups, d_state = ctx.shape
        b, s, _ = zxbcdt.shape
        heads = A.shape[0]
        dim, conv_dim = heads * headdim, conv1d_weight.shape[0]
        it = zxbcdt.dtype
        out_recompute = _empty((b, s, dim), out_x.dtype, zxbcdt)
        xbc_conv = _empty((b, s, conv_dim), it, zxbcdt)  # recomputed x, B, C
        dzxbcdt = _empty(zxbcdt.shape, it, zxbcdt)  # empty_like(zxbcdt); dz and ddt are its slices
        dxbc = _empty((b, s, conv_dim), it, zxbcdt)  # empty_like(xBC) of a strided slice: contiguous
        dout_norm = _empty((b, s, dim), outproj_w.dtype, zxbcdt)  # F.linear(dout, outproj_weight.t())
        dz = _empty((b * s, dim), it, zxbcdt)  # rearrange(dz).clone()
        dy_norm = _empty((b * s, dim), dout_norm.dtype, zxbcdt)  # _layer_norm_bwd's dx
        del dout_norm
        scratch = _chunk_scan_scratch(b, s, heads, headdim, ngroups, d_state, chunk_size, zxbcdt, backward=True)
        del scratch, dy_norm, dz
        doutproj_weight = _empty(outproj_w.shape, outproj_w.dtype, zxbcdt)  # einsum over (b, s)
        doutproj_bias = _empty(outproj_b.shape, outproj_b.dtype, zxbcdt) if outproj_b is not None else None
        del out_recompute, xbc_conv
        dweight = _empty(conv1d_weight.shape, torch.float32, zxbcdt).to(conv1d_weight.dtype)
        dbias = _empty(conv1d_bias.shape, torch.float32, zxbcdt).to(conv1d_bias.dtype) if conv1d_bias is not None \
            else None
        del dxbc
        small = [_empty(t.shape, t.dtype, t) if t is not None else None for t in (dt_bias, A, D, rmsnorm_weight)]
        return (dzxbcdt, dweight, dbias, *small, doutproj_weight, doutproj_bias, None, None, None)


class Mamba2ChunkScanMemory(torch.autograd.Function):
    """mamba-ssm `MambaChunkScanCombinedFn` (mamba_chunk_scan_combined), as the Mamba-2 mixers call it when the
    fused call is skipped (a cache in training: the hybrids' models make one when `use_cache` is on).

    Saves out (or out_x with z), x, dt, dA_cumsum fp32 [b, h, nchunks, chunk], B, C, z; returns out and, when
    asked, the final states fp32 [b, h, p, n]."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, chunk_size, return_final_states):
        b, s, heads, headdim = x.shape
        ngroups, d_state = B.shape[2], B.shape[3]
        scratch = _chunk_scan_scratch(b, s, heads, headdim, ngroups, d_state, chunk_size, x)
        dA_cumsum = scratch[1]
        out = _empty(x.shape, x.dtype, x)
        out_x = _empty(x.shape, x.dtype, x) if z is not None else None
        final = _empty((b, heads, headdim, d_state), torch.float32, x)
        del scratch
        ctx.save_for_backward(out_x if z is not None else out, x, dt, dA_cumsum, A, B, C, D, z, dt_bias)
        ctx.chunk_size = chunk_size
        if return_final_states:
            ctx.mark_non_differentiable(final)
            return out, final
        del final
        return out

    @staticmethod
    def backward(ctx, dout, *unused):
        out, x, dt, dA_cumsum, A, B, C, D, z, dt_bias = ctx.saved_tensors
        b, s, heads, headdim = x.shape
        ngroups, d_state = B.shape[2], B.shape[3]
        dt_in = _empty(dt.shape, dt.dtype, dt)  # dt.clone()
        scratch = _chunk_scan_scratch(b, s, heads, headdim, ngroups, d_state, ctx.chunk_size, x, backward=True)
        dx = _empty(x.shape, x.dtype, x)
        dB, dC = _empty(B.shape, B.dtype, B), _empty(C.shape, C.dtype, C)
        ddt = _empty(dt.shape, dt.dtype, dt)
        dz = _empty(z.shape, z.dtype, z) if z is not None else None
        del scratch, dt_in
        small = [_empty(t.shape, t.dtype, t) if t is not None else None for t in (A, D, dt_bias)]
        return dx, ddt, small[0], dB, dC, small[1], dz, small[2], None, None


def _chunk_scan_scratch(b, s, heads, headdim, ngroups, d_state, chunk, like, backward: bool = False) -> list:
    """The chunked scan's fp32 working set (ssd_combined.py `_mamba_chunk_scan_combined_fwd` / `_bwd`)."""
    nchunks = math.ceil(s / chunk)
    f32 = torch.float32
    scratch = [_empty((b, heads, nchunks, chunk), f32, like),  # dt after softplus / limit
               _empty((b, heads, nchunks, chunk), f32, like),  # dA_cumsum
               _empty((b, nchunks, ngroups, chunk, chunk), f32, like),  # CB (_bmm_chunk_fwd, output fp32)
               _empty((b, nchunks, heads, headdim, d_state), f32, like),  # chunk states (states_in_fp32)
               _empty((b, nchunks, heads, headdim * d_state), f32, like)]  # _state_passing_fwd's states
    if backward:
        scratch += [_empty((b, nchunks, heads, headdim, d_state), f32, like),  # dstates
                    _empty((b, nchunks, ngroups, chunk, chunk), f32, like),  # dCB
                    _empty((b, heads, nchunks, chunk), f32, like),  # ddt
                    _empty((b, heads, nchunks, chunk), f32, like)]  # ddA
    return scratch


# --- the stand-ins transformers' mixers call -------------------------------------------------------------

def mamba_inner_fn(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight, out_proj_weight,
                   out_proj_bias, A, B=None, C=None, D=None, delta_bias=None, delta_softplus=True, **kwargs):
    return MambaInnerMemory.apply(xz, conv1d_weight, conv1d_bias, x_proj_weight, delta_proj_weight,
                                  out_proj_weight, out_proj_bias, A, D, delta_bias)


def mamba2_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                      initial_states=None, dt_limit=(0.0, float("inf")), return_final_states=False,
                                      activation="silu", rmsnorm_weight=None, rmsnorm_eps=1e-6, outproj_weight=None,
                                      outproj_bias=None, headdim=None, ngroups=1, norm_before_gate=True, **kwargs):
    return Mamba2CombinedMemory.apply(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight,
                                      outproj_weight, outproj_bias, chunk_size, headdim, ngroups)


def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                      dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, z=None, **kwargs):
    return Mamba2ChunkScanMemory.apply(hidden_states, dt, A, B, C, D, z, dt_bias, chunk_size, return_final_states)


def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    return CausalConv1dMemory.apply(hidden_states, weight, bias)


def mamba_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                         return_last_state=False, **kwargs):
    out = SelectiveScanMemory.apply(hidden_states, dt, A, B, C, D, z, delta_bias)
    if return_last_state:  # x[:, :, -1, 1::2], a view of the saved chunk states; not taken in training
        return out, _empty((hidden_states.shape[0], hidden_states.shape[1], A.shape[-1]), torch.float32, out)
    return out


# transformers' module-level names (models/<family>/modeling_<family>.py) -> the stand-in for each
_STAND_INS = {
    "mamba_inner_fn": mamba_inner_fn,
    "mamba2_split_conv1d_scan_combined": mamba2_split_conv1d_scan_combined,
    "mamba2_chunk_scan": mamba2_chunk_scan,
    "causal_conv1d_fn": causal_conv1d_fn,
    "mamba_selective_scan": mamba_selective_scan,
}


@contextlib.contextmanager
def cuda_kernel_path(model):
    """While the trace runs, the mixers of `model` call the kernels' stand-ins instead of the torch fallback.

    Patches the names above in the modeling module of every class that has a state-space mixer
    (`A_log` and `conv1d`), and puts them back after.
    """
    modules = {sys.modules[type(m).__module__] for m in model.modules()
               if getattr(m, "A_log", None) is not None and getattr(m, "conv1d", None) is not None}
    saved = []
    try:
        for module in modules:
            for name, stand_in in _STAND_INS.items():
                if hasattr(module, name):
                    saved.append((module, name, getattr(module, name)))
                    setattr(module, name, stand_in)
        yield bool(modules)
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)

"""A bitsandbytes `Linear8bitLt` (LLM.int8(), frozen int8 weight) in fast mode's ops.

The same allocations, in the same order, as `estimator/int8.py`'s `Int8Matmul`, which cites bitsandbytes 0.50's
code for each: on CUDA `MatMul8bitLt` (an fp16 copy of the input, its int8 copy kept to the end, the outlier
threshold's |A| and mask, an int32 product, an fp16 dequantised output, the output in the input's dtype); on
the CPU `MatMul8bitFp` (the weight dequantised to the input's dtype, then a matmul). Both keep the input for
the backward when it needs a gradient, and return the input's dtype (no cast to a compute dtype).
"""

from __future__ import annotations


def int8_linear(f, x, fin: int, fout: int, name: str, lora: bool):
    """`Linear8bitLt(x)` on the tape `f` (a `models.forward.ForwardTape`), plus its LoRA branch."""
    rows = x.numel // fin
    if f.ctx.cuda:
        a16 = x if x.dtype == "f16" else f.new(x.numel, "f16", False, inputs=(x,))
        ca = f.new(x.numel, "i8", False, inputs=(a16,))
        magnitude = f.new(x.numel, "f16", False, inputs=(a16,))
        f.new(x.numel, "bool", False, inputs=(magnitude, a16))  # the outlier mask; the fp16 copy dies after it
        i32 = f.new(rows * fout, "i32", False, inputs=(ca,))
        if x.dtype == "f16":
            out = f.new(rows * fout, "f16", x.rg, inputs=(i32, ca))
        else:
            o16 = f.new(rows * fout, "f16", False, inputs=(i32, ca))
            out = f.new(rows * fout, x.dtype, x.rg, inputs=(o16, i32, ca))
    else:
        dequantised = f.new(fin * fout, x.dtype, False)
        ac = f.ctx.ac  # F.linear inside the autograd Function runs under CPU autocast: both operands cast
        xin = x if not ac or x.dtype == ac else f.new(x.numel, ac, False, inputs=(x,))
        w = dequantised if not ac or x.dtype == ac else f.new(fin * fout, ac, False, inputs=(dequantised,))
        out = f.new(rows * fout, ac or x.dtype, x.rg, inputs=(xin, w, dequantised))
    if x.rg:  # kept as a ctx attribute, which checkpointing cannot drop (estimator/int8_matmul.py)
        f.hold(x) if f.ctx.checkpointing else f.save(x)
    if lora and f.ctx.lora_r and name in f.ctx.lora_targets:
        out = f._lora(x, out, fin, fout)
    return out

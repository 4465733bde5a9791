"""The symbolic forward fast mode runs: tensors with sizes and dtypes, and the ops a family's layer is written in.

A family module's `Forward` (a `FamilyForward`) writes its layer as the sequence of ops transformers 5
runs, on a `ForwardTape`: each op records which of its tensors autograd saves for backward, following
torch's derivative formulas (mm saves its input only if the weight needs a grad, `mul` saves the other
operand, `relu`/`tanh`/`softmax` save their output, ...), autocast's casts (input and weight copies; leaf
weights cached until autocast exits) and dtype promotion. `estimator/fast.py` runs the tape and turns it
into peak candidates. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_memfit.models.int8_linear import int8_linear
from hf_memfit.units import cuda_block_bytes

# Element sizes by our dtype tags.
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "u8": 1, "bool": 1, "i64": 8, "i8": 1, "i32": 4}
DTYPE_TAG = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


# ---------------------------------------------------------------------------
# Symbolic tensors and the forward recorder
# ---------------------------------------------------------------------------


# Hidden-sized fp32 tensors an RMSNorm's backward holds beyond the two every op is given (`rms_norm`):
# exact mode counts five at once in LlamaRMSNorm's backward (torch 2.13 derivatives of mul, mean, pow, rsqrt).
RMS_NORM_BACKWARD_EXTRA = 3


class SymTensor:
    """A symbolic tensor: element count, dtype, whether it needs grad, and where it was made.

    `base` is set for views (q, k, v split out of a fused projection); saving a
    view keeps its base's storage alive, so the base is what gets marked.
    `layout` is "bshd" when a [b, heads, s, d] tensor is a transposed view of
    a [b, s, heads*d] projection (its transpose back is contiguous), "bhsd"
    when it is contiguous in head-major order.
    """

    __slots__ = ("numel", "dtype", "rg", "scope", "saved", "held", "base", "layout", "alloc", "idx", "first_save",
                 "weight_copy", "last_use", "saves")

    def __init__(self, numel, dtype, rg, scope, alloc=True, base=None, layout="bshd", idx=0, weight_copy=False):
        self.numel, self.dtype, self.rg, self.scope = int(numel), dtype, rg, scope
        self.saved = self.held = False
        self.base, self.layout, self.alloc = base, layout, alloc
        self.idx = idx  # position on the forward tape
        self.first_save = None  # tape position of the first op that saved it (its last user in backward)
        self.weight_copy = weight_copy  # autocast's compute-dtype copy of a weight: counted with the weights
        self.last_use = idx  # tape position of the last op that reads it
        self.saves = 0  # how many ops save it (TRL's offloading keeps a tensor saved twice on the GPU)


def _promote(*dtypes: str) -> str:
    return "f32" if "f32" in dtypes else dtypes[0]


@dataclass
class StepContext:
    """What the symbolic forward needs to know about the step."""

    b: int
    s: int
    wdt: str  # storage dtype of the base weights
    ac: str | None  # autocast dtype, or None
    cuda: bool
    attn: str  # "eager" | "sdpa"
    full_ft: bool  # base weights trainable
    lora_r: int | None
    lora_targets: frozenset
    use_cache: bool  # the model builds a DynamicCache in forward (copies of k and v)
    flash_ok: bool  # the GPU can run SDPA's flash kernel
    checkpointing: bool = False
    decoder_s: int | None = None  # seq2seq: the decoder's (labels') length; None: s
    packed: bool = False  # padding-free: several sequences in one row, kept apart by a block-diagonal mask
    # A 4-bit model after peft's `prepare_model_for_kbit_training`: the dtype its 4-bit layers compute in (their
    # stand-in weights'), while every other weight (`wdt`) is fp32. None: one weight dtype for the whole model.
    kbit_compute: str | None = None
    unpacked_4bit: frozenset = frozenset()  # linear names bitsandbytes leaves unpacked (T5's `wo`)
    int8: bool = False  # the packed layers are LLM.int8()'s `Linear8bitLt` (models/int8_linear.py)

    @property
    def embeddings_need_grad(self) -> bool:
        """Whether the token embeddings' output requires grad.

        Under LoRA the table is frozen, but with checkpointing peft calls
        `enable_input_require_grads()`, which marks the embedding output as
        requiring grad so the checkpointed layers get a gradient path.
        """
        return self.full_ft or self.checkpointing

    @property
    def tokens(self) -> int:
        return self.b * self.s


class ForwardTape:
    """Records the tensors a forward makes, and which ones autograd saves or Python holds.

    Each op below mirrors what the aten op (or the transformers code) does to
    memory: which new tensors it allocates, in what dtype, and which of its
    inputs or outputs it saves for backward.
    """

    def __init__(self, ctx: StepContext):
        self.ctx = ctx
        self.tensors: list[SymTensor] = []
        self.scope = "emb"
        # (tape position, scope, gradient numel, param dtype, compute-dtype copy or None) per trainable weight use
        self.grad_events: list[tuple[int, str, int, str, str | None]] = []
        self.no_grad = False  # inside torch.no_grad(): nothing saved, no gradients (TiledMLP's forward)
        # (tape position, scope, the recompute's tape, gradient-buffer bytes) per tiled op (`tiled`), for backward
        self.tiled_backward: list[tuple[int, str, "ForwardTape", int]] = []
        # tape position -> bytes an op's backward keeps beyond the output-sized gradients every op is given
        self.backward_extra: dict[int, int] = {}
        # an RMSNorm's output position -> its fp32 input, when the norm reads that input without a copy
        self.norm_inputs: dict[int, SymTensor] = {}
        self.causal_mask_kept = False  # eager attention under checkpointing: the 4-D mask is on the tape

    # -- bookkeeping ---------------------------------------------------------

    def new(self, numel, dtype, rg=True, layout="bshd", weight_copy=False, inputs=()) -> SymTensor:
        """A new tensor made by an op that reads `inputs`."""
        self.use(*inputs)
        rg = rg and not self.no_grad
        t = SymTensor(numel, dtype, rg, self.scope, layout=layout, idx=len(self.tensors), weight_copy=weight_copy)
        self.tensors.append(t)
        return t

    def use(self, *ts: SymTensor | None) -> None:
        """The op about to run reads these tensors (Python keeps them alive until then)."""
        for t in ts:
            if t is not None:
                t = t.base or t
                t.last_use = len(self.tensors)

    def weight_grad(self, numel: int, dtype: str, cast: str | None = None) -> None:
        """A trainable weight is used here; its gradient appears when backward gets back to this point."""
        if self.no_grad:
            return
        self.grad_events.append((len(self.tensors), self.scope, numel, dtype, cast))

    def param(self, numel, dtype, trainable) -> SymTensor:
        return SymTensor(numel, dtype, trainable, "param", alloc=False)

    def view(self, base: SymTensor, numel, layout="bshd") -> SymTensor:
        return SymTensor(numel, base.dtype, base.rg, base.scope, alloc=False, base=base, layout=layout)

    def save(self, *ts: SymTensor | None) -> None:
        if self.no_grad:
            return
        for t in ts:
            if t is None:
                continue
            t = t.base or t
            if t.alloc:
                t.saved = True
                t.saves += 1
                if t.first_save is None:
                    t.first_save = len(self.tensors)

    def hold(self, *ts: SymTensor | None) -> None:
        for t in ts:
            if t is None:
                continue
            t = t.base or t
            if t.alloc:
                t.held = True

    def bytes_of(self, t: SymTensor) -> int:
        n = t.numel * DTYPE_BYTES[t.dtype]
        if self.ctx.cuda:
            n = cuda_block_bytes(n)
        return n

    def scope_bytes(self, scope: str, *, held: bool, weight_copies: bool = False) -> int:
        """Bytes of tensors made in `scope` that are saved (and, with `held`, also those only held).

        With `weight_copies`, only autocast's weight copies among them.
        """
        return sum(self.bytes_of(t) for t in self.tensors
                   if t.scope == scope and (t.saved or (held and t.held)) and (t.weight_copy or not weight_copies))

    def live_peak(self, scope: str, *, keep_saved: bool, everything: bool = False) -> int:
        """Most bytes of `scope`'s tensors alive at once.

        By default only what nothing keeps beyond its last read is counted. With
        `keep_saved`, saved tensors are left out (they are counted as saved); without
        (checkpointing's forward) only held ones are. With `everything`, saved and held
        tensors count too, alive to the scope's end (checkpointing's recompute).
        """
        deltas: dict[int, int] = {}
        end_of_scope = max((t.idx for t in self.tensors if t.scope == scope), default=0) + 1
        for t in self.tensors:
            if t.scope != scope or not t.alloc:
                continue
            kept = t.held or t.saved
            if not everything and (t.held or (keep_saved and t.saved)):
                continue
            b = self.bytes_of(t)
            deltas[t.idx] = deltas.get(t.idx, 0) + b
            end = end_of_scope if (everything and kept) else max(t.idx, t.last_use) + 1
            deltas[end] = deltas.get(end, 0) - b
        live = peak = 0
        for pos in sorted(deltas):
            live += deltas[pos]
            peak = max(peak, live)
        return peak

    # -- elementwise and casts -----------------------------------------------

    def cast(self, x: SymTensor, dtype: str) -> SymTensor:
        """`x.to(dtype)`: a copy when the dtype changes; its backward saves nothing."""
        if x.dtype == dtype:
            return x
        return self.new(x.numel, dtype, x.rg, layout=x.layout, inputs=(x,))

    def scale(self, x: SymTensor) -> SymTensor:
        """Multiply by a Python number (or a constant tensor): a new tensor, nothing saved."""
        return self.new(x.numel, x.dtype, x.rg, layout=x.layout, inputs=(x,))

    def add(self, a: SymTensor, b: SymTensor) -> SymTensor:
        """`a + b`: a new tensor in the promoted dtype; add saves nothing."""
        return self.new(max(a.numel, b.numel), _promote(a.dtype, b.dtype), a.rg or b.rg, layout=a.layout,
                        inputs=(a, b))

    def mul(self, a: SymTensor, b: SymTensor) -> SymTensor:
        """`a * b`: saves each operand that the other's gradient needs.

        With both operands needing grad, its backward (MulBackward0, derivatives.yaml: `grad * other`,
        `grad * self`) makes both output-sized gradients in one node, beside the incoming one: one more than
        the output-sized pair every op is given (a broadcast operand's is summed down only afterwards).
        """
        if b.rg:
            self.save(a)
        if a.rg:
            self.save(b)
        out = self.new(max(a.numel, b.numel), _promote(a.dtype, b.dtype), a.rg or b.rg, layout=a.layout,
                       inputs=(a, b))
        if a.rg and b.rg and not self.no_grad:
            self.backward_extra[out.idx] = self.backward_extra.get(out.idx, 0) + self.bytes_of(out)
        return out

    def dropout(self, x: SymTensor, p: float) -> SymTensor:
        """Training-mode dropout with p > 0: the mask (saved) and the output.

        A CPU tensor takes `_dropout_impl`: noise of the input's dtype, saved by
        the multiply. CUDA's fused `native_dropout` saves a bool mask.
        """
        if not p:
            return x
        mask = self.new(x.numel, "bool" if self.ctx.cuda else x.dtype, False)
        self.save(mask)
        return self.new(x.numel, x.dtype, x.rg, layout=x.layout, inputs=(x, mask))

    # -- activations ---------------------------------------------------------

    def activation(self, x: SymTensor, kind: str) -> SymTensor:
        if kind in ("gelu_new", "gelu_fast"):
            # NewGELUActivation: 0.5 * x * (1 + tanh(c * (x + 0.044715 * x**3))). pow saves its input, tanh
            # its output, the final mul 0.5*x and (1 + tanh). CUDA autocast runs pow in fp32 (its fp32 list), which
            # promotes the rest to fp32 (an H100 measured it: fake_patches._CUDA_FP32_OPS).
            cube_in = self.cast(x, "f32") if self.ctx.ac and self.ctx.cuda else x
            self.save(cube_in)
            half = self.scale(x)
            cube = self.new(x.numel, cube_in.dtype, x.rg, inputs=(cube_in,))
            inner = self.new(x.numel, cube.dtype, x.rg, inputs=(x, cube))  # c * (x + 0.044715 * cube)
            th = self.new(x.numel, inner.dtype, x.rg, inputs=(inner,))
            self.save(th)
            one_plus = self.scale(th)
            return self.mul(half, one_plus)
        out = self.new(x.numel, x.dtype, x.rg, layout=x.layout, inputs=(x,))
        if kind == "relu":
            self.save(out)  # threshold_backward uses the result
        else:
            self.save(x)  # gelu, gelu_pytorch_tanh, silu: backward recomputes from the input
        return out

    # -- linear ------------------------------------------------------------------

    def linear(self, x: SymTensor, fin: int, fout: int, name: str, bias: bool, *, trainable: bool | None = None,
               lora: bool = True) -> SymTensor:
        """nn.Linear / Conv1D, with autocast's casts and an optional LoRA branch.

        Autocast casts the input and the fp32 weight (and bias) to the compute
        dtype; casts of trainable leaf weights are cached until autocast exits.
        mm saves its input when the weight needs a grad and the (cast) weight
        when the input does.
        """
        ctx = self.ctx
        if (ctx.kbit_compute or ctx.int8) and self.scope != "head" and name not in ctx.unpacked_4bit:  # the rest: fp32 once prepared
            return int8_linear(self, x, fin, fout, name, lora) if ctx.int8 else self._prepared_4bit_linear(x, fin, fout, name, lora)
        trainable = ctx.full_ft if trainable is None else trainable
        rows = x.numel // fin
        w = None
        if ctx.ac:
            xin, out_dtype = self.cast(x, ctx.ac), ctx.ac
            if ctx.wdt != ctx.ac:
                w = self.new(fin * fout, ctx.ac, False, weight_copy=True)  # the weight's compute-dtype copy
                if trainable:
                    self.hold(w)  # autocast's weight cache
                    if bias:
                        self.hold(self.new(fout, ctx.ac, False, weight_copy=True))  # the bias copy, cached likewise
        else:
            xin, out_dtype = x, x.dtype
        if trainable:
            self.save(xin)
            self.weight_grad(fin * fout + (fout if bias else 0), ctx.wdt, ctx.ac if w is not None else None)
        if x.rg and w is not None:
            self.save(w)
        out = self.new(rows * fout, out_dtype, x.rg or trainable, inputs=(xin, w))
        if lora and ctx.lora_r and name in ctx.lora_targets:
            out = self._lora(x, out, fin, fout)
        return out

    def _prepared_4bit_linear(self, x: SymTensor, fin: int, fout: int, name: str, lora: bool) -> SymTensor:
        """bitsandbytes' `Linear4bit.forward` (nn/modules.py) once the residual stream is fp32.

        The input is cast to the compute dtype, the frozen weight (dequantised) is already in it, so autocast
        casts nothing, and the output is cast back to the input's dtype. The matmul saves the weight for the
        input's gradient (the parameter itself: no new bytes), and no input: nothing here trains but LoRA.
        """
        rows = x.numel // fin
        xin = self.cast(x, self.ctx.kbit_compute)
        out = self.cast(self.new(rows * fout, self.ctx.kbit_compute, x.rg, inputs=(xin,)), x.dtype)
        if lora and self.ctx.lora_r and name in self.ctx.lora_targets:
            out = self._lora(x, out, fin, fout)
        return out

    def _lora(self, x: SymTensor, base_out: SymTensor, fin: int, fout: int) -> SymTensor:
        """peft's LoRA Linear: result + lora_B(lora_A(x)) * scaling, adapters kept in fp32.

        peft casts x to the adapter dtype (fp32) first; lora_dropout is 0 by default.
        """
        r, rows = self.ctx.lora_r, x.numel // fin
        xa = self.cast(x, "f32")
        ac = self.ctx.ac
        self.weight_grad(fin * r, "f32", ac)
        self.weight_grad(r * fout, "f32", ac)
        if ac:
            xa_c = self.cast(xa, ac)
            wa = self.new(fin * r, ac, False, weight_copy=True)
            wb = self.new(r * fout, ac, False, weight_copy=True)
            self.hold(wa, wb)
            self.save(xa_c)
            if xa.rg:
                self.save(wa)
            a = self.new(rows * r, ac, True, inputs=(xa_c, wa))
            self.save(a, wb)
            out_b = self.new(rows * fout, ac, True, inputs=(a, wb))
        else:
            self.save(xa)
            a = self.new(rows * r, "f32", True, inputs=(xa,))
            self.save(a)
            out_b = self.new(rows * fout, "f32", True, inputs=(a,))
        scaled = self.scale(out_b)
        result = self.add(base_out, scaled)
        return self.cast(result, base_out.dtype)

    # -- norms -------------------------------------------------------------------

    def layer_norm(self, x: SymTensor, h: int, trainable: bool | None = None) -> SymTensor:
        """native_layer_norm: saves its input, mean and rstd. CUDA autocast runs it in fp32."""
        trainable = self.ctx.full_ft if trainable is None else trainable
        if self.ctx.ac and self.ctx.cuda:
            xin, out_dtype = self.cast(x, "f32"), "f32"
        else:
            xin, out_dtype = x, x.dtype
        rows = x.numel // h
        stat = "f32" if (self.ctx.cuda or xin.dtype == "f32") else xin.dtype
        if x.rg or trainable:
            self.save(xin, self.new(rows, stat, False), self.new(rows, stat, False))
        if trainable:
            self.weight_grad(2 * h, self.ctx.wdt)
        return self.new(x.numel, out_dtype, x.rg or trainable, inputs=(xin,))

    def rms_norm(self, x: SymTensor, h: int, style: str, trainable: bool | None = None) -> SymTensor:
        """The Python RMSNorms of transformers.

        llama: w * (x32 * rsqrt(mean(x32**2))).to(x.dtype); t5: w * (x * rsqrt(...));
        gemma2: (x32 * rsqrt(...)) * (1 + w), then .type_as(x). pow saves its
        input, rsqrt its output, each mul the operand the other's grad needs.
        """
        trainable = self.ctx.full_ft if trainable is None else trainable
        rows = x.numel // h
        w = self.param(h, self.ctx.wdt, trainable)
        if trainable:
            self.weight_grad(h, self.ctx.wdt)
        if style == "t5":
            x32 = self.cast(x, "f32")
            rstd = self.new(rows, "f32", x.rg, inputs=(x32,))
            if x.rg:
                self.save(x32, x, rstd)
            normed = self.new(x.numel, _promote(x.dtype, "f32"), x.rg, inputs=(x, rstd))
            if self.ctx.wdt != "f32":
                normed = self.cast(normed, self.ctx.wdt)
            return self.mul(w, normed)
        x32 = self.cast(x, "f32")
        rstd = self.new(rows, "f32", x.rg, inputs=(x32,))
        if x.rg:
            self.save(x32, rstd)
        normed = self.new(x.numel, "f32", x.rg, inputs=(x32, rstd))
        if x.rg:
            # Backward through x32 * rstd and rstd = rsqrt(mean(x32 ** 2)) holds more hidden-sized fp32
            # tensors at once than the output-sized pair every op is given: the gradient through the product
            # (grad * rstd), the one towards rstd (grad * x32), mean's expanded gradient and pow's product
            # (2 * x32 * grad) before the two sums meet; exact mode counts five at once.
            self.backward_extra[normed.idx] = RMS_NORM_BACKWARD_EXTRA * self.bytes_of(normed)
            if x32 is x:  # `_layer_backward`: one fewer when x's gradient has a buffer already (the residual)
                self.norm_inputs[normed.idx] = x
        if style == "gemma":
            w1 = self.new(h, "f32", trainable)  # 1 + weight.float()
            out = self.mul(normed, w1)
            return self.cast(out, x.dtype)
        normed = self.cast(normed, x.dtype)
        return self.mul(w, normed)

    # -- attention -----------------------------------------------------------------

    def kv_cache(self, k: SymTensor, v: SymTensor) -> tuple[SymTensor, SymTensor]:
        """DynamicLayer.update in training: cat([], k) copies k and v (in k's dtype); the cache holds them."""
        if not self.ctx.use_cache:
            return k, v
        kc = self.new(k.numel, k.dtype, k.rg, layout="bhsd", inputs=(k,))
        vc = self.new(v.numel, k.dtype, v.rg, layout="bhsd", inputs=(v,))
        self.hold(kc, vc)
        return kc, vc

    def attention(self, q: SymTensor, k: SymTensor, v: SymTensor, heads: int, kv_heads: int, head_dim: int, *, dropout: float,
                  mask: SymTensor | None = None, causal: bool = True, eager_style: str = "llama",
                  softcap: float | None = None) -> SymTensor:
        """Attention core; returns the [b, s, heads*head_dim] input of the output projection."""
        ctx = self.ctx
        b = ctx.b
        s = k.numel // (b * kv_heads * head_dim)  # the keys' length (the encoder's, in cross-attention)
        rows = b * heads * (q.numel // (b * heads * head_dim))
        out_numel = rows * head_dim
        if ctx.attn == "eager":
            return self._eager(q, k, v, heads, kv_heads, head_dim, dropout, mask, causal, eager_style, softcap)
        if ctx.cuda:
            if ctx.ac:  # CUDA autocast casts SDPA's inputs (the fp32 q and k of RoPE under *-mixed) to its dtype
                q, k, v = self.cast(q, ctx.ac), self.cast(k, ctx.ac), self.cast(v, ctx.ac)
            half = q.dtype in ("bf16", "f16")
            flash = ctx.flash_ok and mask is None and half and head_dim <= 256
            # flash runs GQA as it is, its backward writing dk, dv for every head before summing each group
            # (`fake_patches.GpuAttentionMemory`); the other kernels see k and v expanded to every head
            gqa_scratch = 2 * self.bytes_of(k) * heads // kv_heads if kv_heads != heads and flash else 0
            if kv_heads != heads and not flash:
                k = self.new(k.numel * heads // kv_heads, k.dtype, k.rg, inputs=(k,))
                v = self.new(v.numel * heads // kv_heads, v.dtype, v.rg, inputs=(v,))
            # the kernels save q, k, v, the output and the fp32 logsumexp (efficient pads s to 32s); no s x s
            q_len = rows // (b * heads)
            lse_s = q_len if flash else -(-q_len // 32) * 32
            out = self.new(out_numel, q.dtype, True, layout="bshd", inputs=(q, k, v, mask))
            self.save(q, k, v, out, self.new(b * heads * lse_s, "f32", False))
            self.backward_extra[out.idx] = gqa_scratch  # `out` is new here: nothing recorded at its position yet
            if mask is not None and mask.rg:
                out = self.new(out_numel, q.dtype, True, layout="bshd", inputs=(out, mask))  # out + 0 * mask.sum()
            return self._merge_heads(out)
        # CPU SDPA, under CPU autocast (scaled_dot_product_attention is a lower-precision op there).
        if ctx.ac:
            q, k, v = self.cast(q, ctx.ac), self.cast(k, ctx.ac), self.cast(v, ctx.ac)
        origin = q.dtype
        if ctx.packed and mask is None:
            # Packed rows get transformers' block-diagonal boolean mask; SDPA turns it into an additive
            # mask in q's dtype (convert_boolean_attn_mask), which the kernel keeps for backward.
            mask = self.new(b * (q.numel // (b * heads * head_dim)) * s, q.dtype, False)
        if not dropout:
            # _scaled_dot_product_flash_attention_for_cpu (GQA native): saves q, k, v, out, logsumexp.
            out = self.new(out_numel, q.dtype, True, layout=q.layout, inputs=(q, k, v, mask))
            self.save(q, k, v, out, self.new(rows, "f32", False), mask)
            return self._merge_heads(out)
        # Dropout rules the flash kernel out: `_scaled_dot_product_attention_math` materialises
        # the s x s probabilities, in fp32 (it upcasts half q, k, v: "keep ... in high precision").
        acc = "f32"
        q, k, v = self.cast(q, acc), self.cast(k, acc), self.cast(v, acc)
        if kv_heads != heads:
            k = self.new(k.numel * heads // kv_heads, k.dtype, k.rg, inputs=(k,))
            v = self.new(v.numel * heads // kv_heads, v.dtype, v.rg, inputs=(v,))
        qs = self.scale(q)  # q * sqrt(scale)
        kts = self.scale(k)  # k^T * sqrt(scale)
        self.save(qs, kts, v)
        scores = self.new(rows * s, acc, True, inputs=(qs, kts, mask))
        probs = self.new(rows * s, acc, True, inputs=(scores,))  # _safe_softmax output, saved
        self.save(probs)
        probs = self.dropout(probs, dropout)
        self.save(probs)
        out = self.new(out_numel, acc, True, layout="bhsd", inputs=(probs, v))
        # it returns (out.to(origin_dtype), attn.to(origin_dtype)); the caller drops the second
        weights = self.cast(probs, origin)
        out = self.cast(out, origin)
        self.use(weights, q, k, v, qs)  # C++ locals, alive until the function returns
        return self._merge_heads(out)

    def _eager(self, q, k, v, heads, kv_heads, head_dim, dropout, mask, causal, style, softcap):
        """transformers' eager_attention_forward (per family `style`)."""
        ctx = self.ctx
        b = ctx.b
        s = k.numel // (b * kv_heads * head_dim)  # the keys' length
        rows = b * heads * (q.numel // (b * heads * head_dim))
        if kv_heads != heads and style == "llama":  # repeat_kv copies
            k = self.new(k.numel * heads // kv_heads, k.dtype, k.rg, inputs=(k,))
            v = self.new(v.numel * heads // kv_heads, v.dtype, v.rg, inputs=(v,))
        cdt = ctx.ac or _promote(q.dtype, k.dtype)
        qm, km = (self.cast(q, ctx.ac), self.cast(k, ctx.ac)) if ctx.ac else (q, k)
        qm, km = self._bmm_operand(qm), self._bmm_operand(km)
        self.save(qm, km)  # matmul(q, k^T) saves both
        scores = self.new(rows * s, cdt, True, inputs=(qm, km))
        scaled = self.scale(scores)
        if softcap:  # gemma2: tanh(scores / cap) * cap; tanh saves its output
            divided = self.scale(scaled)
            th = self.new(rows * s, cdt, True, inputs=(divided,))
            self.save(th)
            scaled = self.scale(th)
        if mask is not None:  # T5's position bias
            scaled = self.new(rows * s, _promote(scaled.dtype, mask.dtype), True, inputs=(scaled, mask))
        if causal:  # the 4-D causal mask, in the hidden states' dtype
            if ctx.checkpointing and mask is None and not self.causal_mask_kept:
                # masking_utils' one [b, 1, s, s] mask, which every checkpoint keeps as an input for its recompute:
                # alive to the end of backward (without checkpointing it is gone before the head's peak)
                scope, self.scope = self.scope, "emb"
                self.save(self.new(b * (q.numel // (b * heads * head_dim)) * s, ctx.wdt, False))
                self.scope, self.causal_mask_kept = scope, True
            scaled = self.new(rows * s, _promote(scaled.dtype, ctx.wdt), True, inputs=(scaled,))
        # softmax: llama/opt/neox/gemma ask for fp32 and cast back to q's dtype; gpt2/bert/t5
        # take CUDA autocast's fp32 softmax, then gpt2 casts to v's dtype.
        soft_in = self.cast(scaled, "f32") if style == "llama" or (ctx.ac and ctx.cuda) else scaled
        probs = self.new(rows * s, soft_in.dtype, True, inputs=(soft_in,))
        self.save(probs)
        probs.first_save = probs.idx  # its own backward reads it: freed after that, not after the next op's
        if ctx.cuda:  # CUDA's backward also makes `grad * output` (fake_patches.cuda_softmax_backward)
            self.backward_extra[probs.idx] = self.backward_extra.get(probs.idx, 0) + self.bytes_of(probs)
        back = {"llama": q.dtype, "gpt2": v.dtype}.get(style, probs.dtype)
        probs = self.cast(probs, back)
        probs = self.dropout(probs, dropout)
        pm, vm = (self.cast(probs, ctx.ac), self.cast(v, ctx.ac)) if ctx.ac else (probs, v)
        vm = self._bmm_operand(vm)
        self.save(pm, vm)  # matmul(probs, v) saves both
        out = self.new(rows * head_dim, ctx.ac or _promote(pm.dtype, vm.dtype), True, layout="bhsd",
                       inputs=(pm, vm))
        return self._merge_heads(out)

    def _bmm_operand(self, x: SymTensor) -> SymTensor:
        """4-D matmul folds [b, heads] into one batch dim for bmm. A [b, heads, s, d] tensor
        that is a transposed view of [b, s, heads*d] only folds without a copy when b == 1;
        otherwise matmul's reshape copies it, and bmm saves the copy."""
        if x.layout == "bshd" and self.ctx.b > 1:
            return self.new(x.numel, x.dtype, x.rg, layout="bhsd", inputs=(x,))
        return x

    def _merge_heads(self, out: SymTensor) -> SymTensor:
        """attn_output.transpose(1, 2).reshape(b, s, -1).contiguous(): a copy unless already [b, s, h, d]."""
        if out.layout == "bshd":
            return out
        return self.new(out.numel, out.dtype, out.rg, inputs=(out,))


# ---------------------------------------------------------------------------
# Per-family forward programs
# ---------------------------------------------------------------------------


def rope(f: ForwardTape, x: SymTensor, cos_dtype: str, rotary_frac: float, cat_style: bool) -> SymTensor:
    """q * cos + rotate_half(q) * sin. mul saves cos/sin (shared); nothing of q.

    Partial rotary (NeoX) and Phi-3 concatenate the rotated part with the rest:
    a new contiguous [b, heads, s, d] tensor.
    """
    rot = int(x.numel * rotary_frac)
    dtype = _promote(x.dtype, cos_dtype)
    a = f.new(rot, dtype, x.rg, inputs=(x,))  # q * cos
    half = f.new(rot, x.dtype, x.rg, inputs=(x,))  # rotate_half(q)
    bpart = f.new(rot, dtype, x.rg, inputs=(half,))  # ... * sin
    out = f.new(rot, dtype, x.rg, layout=x.layout, inputs=(a, bpart))
    if cat_style:
        out = f.new(x.numel, _promote(dtype, x.dtype), x.rg, layout="bhsd", inputs=(out, x))
    return out


class FamilyForward:
    """Builds one family's forward on a `ForwardTape`: embedding, layers, final norm and head input.

    Each family module (`models/<family>.py`) subclasses it as `Forward`.
    """

    def __init__(self, spec, settings, f: ForwardTape):
        self.spec, self.settings, self.f = spec, settings, f
        self.ctx = f.ctx
        self.h = spec.hidden_size
        self.T = f.ctx.tokens
        if getattr(settings, "tiled_mlp", False) and hasattr(self, "_mlp"):
            from hf_memfit.models.tiling import tiled_mlp

            self._mlp = lambda x: tiled_mlp(self, type(self)._mlp, x)  # ALST's TiledMLP around the family's MLP

    def start_decoder(self):
        """Between an encoder-decoder's stacks: the decoder's own sequence length, where it differs."""

    # residual-stream dtype: the weights' storage dtype (autocast leaves adds alone)
    @property
    def rdt(self) -> str:
        return self.ctx.wdt

    def seq_cls_logits(self, head_in: SymTensor, width: int, num_labels: int, trainable: bool) -> SymTensor:
        """A decoder's `score` on every position (transformers picks the last one afterwards)."""
        return self.f.linear(head_in, width, num_labels, "score", False, trainable=trainable, lora=False)

    def token_embedding(self, width: int) -> SymTensor:
        """The token-embedding lookup. With a frozen table made to require grad (peft's
        `enable_input_require_grads` under checkpointing) the output is a leaf the graph keeps."""
        ctx = self.ctx
        x = self.f.new(self.T * width, self.rdt, ctx.embeddings_need_grad)
        if ctx.embeddings_need_grad and not ctx.full_ft:
            self.f.save(x)
        return x

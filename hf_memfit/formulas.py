"""Fast mode: the peak memory of one training step in closed form, without torch.

`fast_step_memory(spec, settings)` returns the same kind of `StepMemory` as
exact mode (`trace.exact_candidates`): live bytes by category at each region
of the step where the peak can fall. Nothing here imports torch,
transformers or peft (the CLI's fast path must start in well under a second),
so everything is derived from the `ModelSpec`:

- Model states are exact arithmetic over the model's parameter tensors
  (enumerated from `spec.linear_modules` plus the embedding tables and norm
  vectors): weights in their storage dtype, gradients for trainable tensors,
  optimizer states in the layout each optimizer allocates.
- Activations come from a small symbolic forward: each family's layer is
  written as the sequence of ops transformers 5 runs (`_Forward`), and every op
  records which of its tensors autograd saves for backward, following torch's
  derivative formulas (mm saves its input only if the weight needs a grad,
  `mul` saves the other operand, `relu`/`tanh`/`softmax` save their output,
  ...), autocast's casts (input and weight copies; leaf weights cached until
  autocast exits) and dtype promotion. What a layer saves, times the depth, is
  the activation memory (the same tensor saved by two ops counts once); which
  op reads each tensor last gives the transients. A layer's backward is
  replayed over the same tape in reverse: saved tensors freed op by op while
  weight gradients appear.
- The head and loss (logits, the fp32 upcast, log_softmax's saved output,
  accelerate's fp32 copy of the logits, the backward of all of that) and the
  embedding backward are short event sequences whose maxima are taken exactly.
- Optimizer temporaries follow the code path torch takes on the device
  (foreach on CUDA, single-tensor on CPU, in-place fused / bitsandbytes kernels).

The semantics follow exact mode, which runs the real step on fake tensors, so
that both modes agree; where exact mode's CUDA emulation departs from a real
GPU (see `_EXACT_CUDA_EMULATION`) the fast mode follows exact mode and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hf_memfit import optimizers
from hf_memfit.breakdown import CATEGORIES, StepMemory

# Element sizes by our dtype tags.
_SIZE = {"f32": 4, "bf16": 2, "f16": 2, "u8": 1, "bool": 1, "i64": 8}
_TAG = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}

# CUDACachingAllocator rounds every block to 512 bytes (kMinBlockSize).
_CUDA_BLOCK = 512

# Exact mode emulates CUDA on fake CPU tensors. Two CPU behaviours survive in
# it, and fast mode follows them so that both modes agree (they are real
# differences from a GPU; flip these to model the GPU instead):
# - dropout on a CPU tensor saves a mask of the input's dtype (`_dropout_impl`),
#   where CUDA's fused `native_dropout` saves a bool mask;
# - the SDPA stand-in is not autocast-wrapped, so under *-mixed it sees the
#   fp32 q/k that rotary embeddings produce and keeps them fp32, where CUDA
#   autocast would cast q, k and v to the compute dtype first.
_EXACT_CUDA_EMULATION = {"cpu_dropout_mask": True, "sdpa_autocast": False}


# ---------------------------------------------------------------------------
# Symbolic tensors and the forward recorder
# ---------------------------------------------------------------------------


class _T:
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
class _Ctx:
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


class _Forward:
    """Records the tensors a forward makes, and which ones autograd saves or Python holds.

    Each op below mirrors what the aten op (or the transformers code) does to
    memory: which new tensors it allocates, in what dtype, and which of its
    inputs or outputs it saves for backward.
    """

    def __init__(self, ctx: _Ctx):
        self.ctx = ctx
        self.tensors: list[_T] = []
        self.scope = "emb"
        # (tape position, scope, gradient numel, param dtype, compute-dtype copy or None) per trainable weight use
        self.grad_events: list[tuple[int, str, int, str, str | None]] = []

    # -- bookkeeping ---------------------------------------------------------

    def new(self, numel, dtype, rg=True, layout="bshd", weight_copy=False, inputs=()) -> _T:
        """A new tensor made by an op that reads `inputs`."""
        self.use(*inputs)
        t = _T(numel, dtype, rg, self.scope, layout=layout, idx=len(self.tensors), weight_copy=weight_copy)
        self.tensors.append(t)
        return t

    def use(self, *ts: _T | None) -> None:
        """The op about to run reads these tensors (Python keeps them alive until then)."""
        for t in ts:
            if t is not None:
                t = t.base or t
                t.last_use = len(self.tensors)

    def weight_grad(self, numel: int, dtype: str, cast: str | None = None) -> None:
        """A trainable weight is used here; its gradient appears when backward gets back to this point."""
        self.grad_events.append((len(self.tensors), self.scope, numel, dtype, cast))

    def param(self, numel, dtype, trainable) -> _T:
        return _T(numel, dtype, trainable, "param", alloc=False)

    def view(self, base: _T, numel, layout="bshd") -> _T:
        return _T(numel, base.dtype, base.rg, base.scope, alloc=False, base=base, layout=layout)

    def save(self, *ts: _T | None) -> None:
        for t in ts:
            if t is None:
                continue
            t = t.base or t
            if t.alloc:
                t.saved = True
                t.saves += 1
                if t.first_save is None:
                    t.first_save = len(self.tensors)

    def hold(self, *ts: _T | None) -> None:
        for t in ts:
            if t is None:
                continue
            t = t.base or t
            if t.alloc:
                t.held = True

    def bytes_of(self, t: _T) -> int:
        n = t.numel * _SIZE[t.dtype]
        if self.ctx.cuda:
            n = max(_CUDA_BLOCK, -(-n // _CUDA_BLOCK) * _CUDA_BLOCK)
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

    def cast(self, x: _T, dtype: str) -> _T:
        """`x.to(dtype)`: a copy when the dtype changes; its backward saves nothing."""
        if x.dtype == dtype:
            return x
        return self.new(x.numel, dtype, x.rg, layout=x.layout, inputs=(x,))

    def scale(self, x: _T) -> _T:
        """Multiply by a Python number (or a constant tensor): a new tensor, nothing saved."""
        return self.new(x.numel, x.dtype, x.rg, layout=x.layout, inputs=(x,))

    def add(self, a: _T, b: _T) -> _T:
        """`a + b`: a new tensor in the promoted dtype; add saves nothing."""
        return self.new(max(a.numel, b.numel), _promote(a.dtype, b.dtype), a.rg or b.rg, layout=a.layout,
                        inputs=(a, b))

    def mul(self, a: _T, b: _T) -> _T:
        """`a * b`: saves each operand that the other's gradient needs."""
        if b.rg:
            self.save(a)
        if a.rg:
            self.save(b)
        return self.new(max(a.numel, b.numel), _promote(a.dtype, b.dtype), a.rg or b.rg, layout=a.layout,
                        inputs=(a, b))

    def dropout(self, x: _T, p: float) -> _T:
        """Training-mode dropout with p > 0: the mask (saved) and the output.

        A CPU tensor takes `_dropout_impl`: noise of the input's dtype, saved by
        the multiply. CUDA's fused `native_dropout` saves a bool mask.
        """
        if not p:
            return x
        cpu_mask = not self.ctx.cuda or _EXACT_CUDA_EMULATION["cpu_dropout_mask"]
        mask = self.new(x.numel, x.dtype if cpu_mask else "bool", False)
        self.save(mask)
        return self.new(x.numel, x.dtype, x.rg, layout=x.layout, inputs=(x, mask))

    # -- activations ---------------------------------------------------------

    def activation(self, x: _T, kind: str) -> _T:
        if kind in ("gelu_new", "gelu_fast"):
            # NewGELUActivation: 0.5 * x * (1 + tanh(c * (x + 0.044715 * x**3))).
            # pow saves x; tanh saves its output; the final mul saves 0.5*x and (1 + tanh).
            self.save(x)
            half = self.scale(x)
            cube = self.new(x.numel, x.dtype, x.rg, inputs=(x,))
            inner = self.new(x.numel, x.dtype, x.rg, inputs=(x, cube))  # c * (x + 0.044715 * cube)
            th = self.new(x.numel, x.dtype, x.rg, inputs=(inner,))
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

    def linear(self, x: _T, fin: int, fout: int, name: str, bias: bool, *, trainable: bool | None = None,
               lora: bool = True) -> _T:
        """nn.Linear / Conv1D, with autocast's casts and an optional LoRA branch.

        Autocast casts the input and the fp32 weight (and bias) to the compute
        dtype; casts of trainable leaf weights are cached until autocast exits.
        mm saves its input when the weight needs a grad and the (cast) weight
        when the input does.
        """
        ctx = self.ctx
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

    def _lora(self, x: _T, base_out: _T, fin: int, fout: int) -> _T:
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

    def layer_norm(self, x: _T, h: int, trainable: bool | None = None) -> _T:
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

    def rms_norm(self, x: _T, h: int, style: str, trainable: bool | None = None) -> _T:
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
        if style == "gemma":
            w1 = self.new(h, "f32", trainable)  # 1 + weight.float()
            out = self.mul(normed, w1)
            return self.cast(out, x.dtype)
        normed = self.cast(normed, x.dtype)
        return self.mul(w, normed)

    # -- attention -----------------------------------------------------------------

    def kv_cache(self, k: _T, v: _T) -> tuple[_T, _T]:
        """DynamicLayer.update in training: cat([], k) copies k and v (in k's dtype); the cache holds them."""
        if not self.ctx.use_cache:
            return k, v
        kc = self.new(k.numel, k.dtype, k.rg, layout="bhsd", inputs=(k,))
        vc = self.new(v.numel, k.dtype, v.rg, layout="bhsd", inputs=(v,))
        self.hold(kc, vc)
        return kc, vc

    def attention(self, q: _T, k: _T, v: _T, heads: int, kv_heads: int, head_dim: int, *, dropout: float,
                  mask: _T | None = None, causal: bool = True, eager_style: str = "llama",
                  softcap: float | None = None) -> _T:
        """Attention core; returns the [b, s, heads*head_dim] input of the output projection."""
        ctx = self.ctx
        b = ctx.b
        s = k.numel // (b * kv_heads * head_dim)  # the keys' length (the encoder's, in cross-attention)
        rows = b * heads * (q.numel // (b * heads * head_dim))
        out_numel = rows * head_dim
        if ctx.attn == "eager":
            return self._eager(q, k, v, heads, kv_heads, head_dim, dropout, mask, causal, eager_style, softcap)
        if ctx.cuda:
            if _EXACT_CUDA_EMULATION["sdpa_autocast"] and ctx.ac:
                q, k, v = self.cast(q, ctx.ac), self.cast(k, ctx.ac), self.cast(v, ctx.ac)
            if kv_heads != heads:  # the kernels see k and v expanded to every head
                k = self.new(k.numel * heads // kv_heads, k.dtype, k.rg, inputs=(k,))
                v = self.new(v.numel * heads // kv_heads, v.dtype, v.rg, inputs=(v,))
            half = q.dtype in ("bf16", "f16")
            flash = ctx.flash_ok and mask is None and half and head_dim <= 256
            # flash / memory-efficient kernels save q, k, v, the output and the fp32 logsumexp
            # (memory-efficient pads s to a multiple of 32); no s x s matrix.
            q_len = rows // (b * heads)
            lse_s = q_len if flash else -(-q_len // 32) * 32
            out = self.new(out_numel, q.dtype, True, layout="bshd", inputs=(q, k, v, mask))
            self.save(q, k, v, out, self.new(b * heads * lse_s, "f32", False))
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
            scaled = self.new(rows * s, _promote(scaled.dtype, ctx.wdt), True, inputs=(scaled,))
        # softmax: llama/opt/neox/gemma ask for fp32 and cast back to q's dtype; gpt2/bert/t5
        # take CUDA autocast's fp32 softmax, then gpt2 casts to v's dtype.
        if style == "llama" or (ctx.ac and ctx.cuda):
            soft_in = self.cast(scaled, "f32")
            probs = self.new(rows * s, "f32", True, inputs=(soft_in,))
        else:
            soft_in = scaled
            probs = self.new(rows * s, scaled.dtype, True, inputs=(soft_in,))
        self.save(probs)
        back = {"llama": q.dtype, "gpt2": v.dtype}.get(style, probs.dtype)
        probs = self.cast(probs, back)
        probs = self.dropout(probs, dropout)
        pm, vm = (self.cast(probs, ctx.ac), self.cast(v, ctx.ac)) if ctx.ac else (probs, v)
        vm = self._bmm_operand(vm)
        self.save(pm, vm)  # matmul(probs, v) saves both
        out = self.new(rows * head_dim, ctx.ac or _promote(pm.dtype, vm.dtype), True, layout="bhsd",
                       inputs=(pm, vm))
        return self._merge_heads(out)

    def _bmm_operand(self, x: _T) -> _T:
        """4-D matmul folds [b, heads] into one batch dim for bmm. A [b, heads, s, d] tensor
        that is a transposed view of [b, s, heads*d] only folds without a copy when b == 1;
        otherwise matmul's reshape copies it, and bmm saves the copy."""
        if x.layout == "bshd" and self.ctx.b > 1:
            return self.new(x.numel, x.dtype, x.rg, layout="bhsd", inputs=(x,))
        return x

    def _merge_heads(self, out: _T) -> _T:
        """attn_output.transpose(1, 2).reshape(b, s, -1).contiguous(): a copy unless already [b, s, h, d]."""
        if out.layout == "bshd":
            return out
        return self.new(out.numel, out.dtype, out.rg, inputs=(out,))


# ---------------------------------------------------------------------------
# Per-family forward programs
# ---------------------------------------------------------------------------


def rope(f: _Forward, x: _T, cos_dtype: str, rotary_frac: float, cat_style: bool) -> _T:
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
    """Builds one family's forward on a `_Forward`: embedding, layers, final norm and head input.

    Each family module (`models/<family>.py`) subclasses it as `Forward`.
    """

    def __init__(self, spec, settings, f: _Forward):
        self.spec, self.settings, self.f = spec, settings, f
        self.ctx = f.ctx
        self.h = spec.hidden_size
        self.T = f.ctx.tokens

    def start_decoder(self):
        """Between an encoder-decoder's stacks: the decoder's own sequence length, where it differs."""

    # residual-stream dtype: the weights' storage dtype (autocast leaves adds alone)
    @property
    def rdt(self) -> str:
        return self.ctx.wdt

    def seq_cls_logits(self, head_in: _T, width: int, num_labels: int, trainable: bool) -> _T:
        """A decoder's `score` on every position (transformers picks the last one afterwards)."""
        return self.f.linear(head_in, width, num_labels, "score", False, trainable=trainable, lora=False)

    def token_embedding(self, width: int) -> _T:
        """The token-embedding lookup. With a frozen table made to require grad (peft's
        `enable_input_require_grads` under checkpointing) the output is a leaf the graph keeps."""
        ctx = self.ctx
        x = self.f.new(self.T * width, self.rdt, ctx.embeddings_need_grad)
        if ctx.embeddings_need_grad and not ctx.full_ft:
            self.f.save(x)
        return x


def _family(spec):
    """The hand-written family module (models/<family>.py) whose `Forward` fast mode runs."""
    from hf_memfit import models

    return models.family(spec.model_type)


# ---------------------------------------------------------------------------
# Parameters: the tensors, their dtypes, and what is trainable
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Param:
    """`count` parameter tensors of one shape. `shape` is (rows, cols) or (numel,)."""

    shape: tuple[int, ...]
    count: int
    dtype: str
    trainable: bool
    decay: bool  # the Trainer's weight-decay group (not biases or norms)
    kind: str  # embedding | layer | other | norm | head | lora | head_copy
    module: str = ""  # the linear module's name, for the weights of linear modules

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _embedding_tables(spec) -> list[tuple[int, int, bool]]:
    """(rows, cols, decay) of every embedding-like table: the family's own list, else the token table."""
    tables = getattr(_family(spec), "embedding_tables", None)
    return tables(spec) if tables is not None else [(spec.vocab_size, spec.hidden_size, True)]


def _lora_targets(spec, settings) -> frozenset:
    if not settings.uses_lora:
        return frozenset()
    if settings.lora_target_modules is not None:
        if "all-linear" in settings.lora_target_modules:
            # peft's "all-linear": every Linear / Conv1D but the output layer.
            return frozenset(m.name for m in spec.linear_modules(settings.task, settings.num_labels)
                             if m.scope != "head")
        return frozenset(settings.lora_target_modules)
    return frozenset(spec.default_lora_target_modules())


def _parameters(spec, settings, wdt: str) -> list[_Param]:
    """Every parameter tensor of the (peft-wrapped) model, in `model.parameters()` order."""
    task, labels = settings.task, settings.num_labels
    counts = spec.parameter_count(task, labels)
    linears = spec.linear_modules(task, labels)
    lora = settings.uses_lora
    base_trainable = not lora
    tied_head = task != "seq-cls" and spec.tie_word_embeddings
    params: list[_Param] = []
    accounted = 0
    for rows, cols, decay in _embedding_tables(spec):
        params.append(_Param((rows, cols), 1, wdt, base_trainable, decay, "embedding"))
        accounted += rows * cols
    body = [m for m in linears if m.scope != "head"]
    head = [m for m in linears if m.scope == "head"]
    for m in body:
        kind = "layer" if m.scope == "layer" else "other"
        params.append(_Param((m.out_features, m.in_features), m.count, wdt, base_trainable, True, kind, m.name))
        accounted += m.weight_numel * m.count
        if m.bias:
            params.append(_Param((m.out_features,), m.count, wdt, base_trainable, False, kind))
            accounted += m.out_features * m.count
    head_params = []
    if not tied_head:
        for m in head:
            head_params.append(_Param((m.out_features, m.in_features), 1, wdt, base_trainable, True, "head", m.name))
            accounted += m.weight_numel
            if m.bias:
                head_params.append(_Param((m.out_features,), 1, wdt, base_trainable, False, "head"))
                accounted += m.out_features
    # What is left is the norms' weight and bias vectors, hidden_size each.
    rest = counts["total"] - accounted
    h = spec.hidden_size
    if rest > 0:
        if rest % h == 0:
            params.append(_Param((h,), rest // h, wdt, base_trainable, False, "norm"))
        else:
            params.append(_Param((rest,), 1, wdt, base_trainable, False, "norm"))
    params += head_params
    if lora:
        r = settings.lora_r or 8  # peft's default rank
        targets = _lora_targets(spec, settings)
        for m in linears:
            if m.name not in targets or (m.scope == "head" and task == "seq-cls"):
                continue
            params.append(_Param((r, m.in_features), m.count, "f32", True, True, "lora"))
            params.append(_Param((m.out_features, r), m.count, "f32", True, True, "lora"))
        if task == "seq-cls":
            # peft's SEQ_CLS task wraps the classifier in ModulesToSaveWrapper: a trainable copy.
            for p in head_params or [_Param((m.out_features, m.in_features), 1, wdt, False, True, "head")
                                     for m in head]:
                params.append(_Param(p.shape, p.count, p.dtype, True, p.decay, "head_copy"))
            for m in head:
                if m.bias and not head_params:
                    params.append(_Param((m.out_features,), 1, wdt, True, False, "head_copy"))
    return params


_nbytes = optimizers.allocated_bytes  # one tensor's bytes, rounded to the caching allocator's blocks on CUDA


def _param_bytes(p: _Param, cuda: bool, dtype: str | None = None) -> int:
    return p.count * _nbytes(p.numel, _SIZE[dtype or p.dtype], cuda)


def _optimizer_tensors(params: list[_Param], settings, spec) -> list:
    """The trainable tensors as `optimizers.TensorGroup`s, in `model.parameters()` order."""
    from hf_memfit.optimizers import TensorGroup

    targets = _low_rank_targets(spec, settings)
    return [TensorGroup(p.shape, p.count, _SIZE[p.dtype], p.decay,
                        low_rank_target=len(p.shape) == 2 and p.module in targets, embedding=p.kind == "embedding")
            for p in params if p.trainable]


def _low_rank_targets(spec, settings) -> frozenset:
    """Module names whose weights GaLore / APOLLO project: `optim_target_modules` among the nn.Linear modules.

    The Trainer (`_setup_low_rank_optimizer`) takes only `nn.Linear` modules; GPT-2's
    Conv1D layers are not, so for GPT-2 only its untied heads could be targets.
    """
    if not settings.optim_target_modules:
        return frozenset()
    linears = spec.linear_modules(settings.task, settings.num_labels)
    conv1d_body = getattr(_family(spec), "CONV1D_BODY", False)  # GPT-2: the body's projections are Conv1D
    names = {m.name for m in linears if not (conv1d_body and m.scope != "head")}
    if settings.optim_target_modules == ("all-linear",):
        return frozenset(names)
    return frozenset(names & set(settings.optim_target_modules))


# ---------------------------------------------------------------------------
# Activations: run the symbolic forward once and summarise it
# ---------------------------------------------------------------------------


@dataclass
class _Stack:
    """One stack of identical layers, as the symbolic forward saw it."""

    name: str  # "s0" (decoder-only models; T5's encoder) or "s1" (T5's decoder)
    depth: int
    saved: int  # bytes one layer keeps for its backward
    held: int  # bytes one layer keeps only until the forward ends (KV-cache copies, autocast cache)
    first_saved: int  # what layer 0 keeps beyond an ordinary layer (T5's position-bias buckets; less
    first_held: int  # when the layer's input needs no grad, as under LoRA)
    transient: int  # most unsaved bytes alive at once inside the layer's forward
    carry: int  # the hidden state passed from layer to layer (kept per layer by checkpointing)
    gc_held: int  # per layer, under checkpointing: autocast's weight cache only
    saved_w: int = 0  # the autocast weight copies among `saved` (counted as weights)
    held_w: int = 0  # ... among `held`
    first_saved_w: int = 0  # ... among `first_saved` / `first_held`
    first_held_w: int = 0

    def total(self, held: bool) -> int:
        per = self.saved + (self.held if held else 0)
        first = self.first_saved + (self.first_held if held else 0)
        return first + per * self.depth

    def total_w(self, held: bool) -> int:
        per = self.saved_w + (self.held_w if held else 0)
        first = self.first_saved_w + (self.first_held_w if held else 0)
        return first + per * self.depth


@dataclass
class _Head:
    """The final norm, the head and the loss, with their backward."""

    saved: int  # kept for backward (lm_head input, log_softmax output, ...)
    held: int  # logits returned in the outputs, the autocast cache of the head weight
    fwd_extra: int  # most transient bytes during the loss / accelerate's fp32 copy
    bwd_peak: int  # most bytes beyond what is saved, during the head's backward
    grad_bytes: int  # the head weight's gradient (0 when frozen)
    bwd_after: int  # what the head's backward leaves for the layers (the hidden-state grad)
    saved_w: int = 0  # autocast weight copies among `saved` / `held`
    held_w: int = 0
    bwd_peak_w: int = 0  # change in weight copies alive at the head's backward peak
    bwd_peak_acts: int = 0  # change in saved activations at that peak (log_softmax's output, ...)
    fwd_grads: int = 0  # the head weight's gradient made inside the forward (Liger's fused loss)


@dataclass
class _Activations:
    pre_saved: int  # embedding output, rotary tables, ...
    pre_held: int
    stacks: list[_Stack]
    mid_saved: int  # T5: the encoder's final norm and the decoder's embedding
    mid_held: int
    final_saved: int  # the final norm
    final_held: int
    head: _Head
    pre_w: int  # autocast weight copies among pre/mid/final (saved, held)
    pre_held_w: int
    mid_w: int
    mid_held_w: int
    final_w: int
    final_held_w: int
    tape: _Forward  # the symbolic forward, for the layers' backward
    gc_tape: _Forward | None  # the same without the KV cache, for checkpointing's recompute


def _ctx(spec, settings) -> _Ctx:
    wdt = _TAG[settings.weights_dtype]
    ac = _TAG.get(settings.autocast_dtype) if settings.autocast_dtype else None
    if settings.load_in_4bit and wdt == "f32":
        wdt = _TAG[settings.compute_dtype]  # the base is built in the compute dtype (4-bit packing is applied later)
    attn = "eager" if settings.attn_implementation == "eager" else "sdpa"
    if getattr(_family(spec), "EAGER_ATTENTION_ONLY", False):
        attn = "eager"  # transformers has no SDPA path for this family (Gemma-2: its logit soft-capping)
    flash_ok = True
    if settings.gpu is not None:
        from hf_memfit.hardware import find_gpu

        flash_ok = find_gpu(settings.gpu).compute_capability >= (8, 0)
    use_cache = getattr(_family(spec), "USES_KV_CACHE", True) and not settings.gradient_checkpointing and \
        bool(spec.config.get("use_cache", True))
    # the rows the model sees: DPO's chosen + rejected, or one padding-free row (settings.rows / row_len)
    return _Ctx(b=settings.rows, s=settings.row_len, wdt=wdt, ac=ac, cuda=settings.device == "cuda",
                attn=attn, full_ft=not settings.uses_lora, lora_r=(settings.lora_r or 8) if settings.uses_lora else None,
                lora_targets=_lora_targets(spec, settings), use_cache=use_cache, flash_ok=flash_ok,
                checkpointing=settings.gradient_checkpointing, decoder_s=settings.decoder_seq_len,
                packed=settings.padding_free)


def _stack_summary(f: _Forward, name: str, depth: int, carry: _T, gc_f: _Forward | None) -> _Stack:
    l0, l1 = f"{name}.L0", f"{name}.L1"
    saved1, all1 = f.scope_bytes(l1, held=False), f.scope_bytes(l1, held=True)
    saved0, all0 = f.scope_bytes(l0, held=False), f.scope_bytes(l0, held=True)
    gc_held = 0
    if gc_f is not None:
        gc_held = sum(gc_f.bytes_of(t) for t in gc_f.tensors if t.scope == l1 and t.held)
    saved_w = f.scope_bytes(l1, held=False, weight_copies=True)
    all_w = f.scope_bytes(l1, held=True, weight_copies=True)
    saved0_w = f.scope_bytes(l0, held=False, weight_copies=True)
    all0_w = f.scope_bytes(l0, held=True, weight_copies=True)
    # Inside a layer's forward: its unsaved temporaries at their most; under checkpointing
    # nothing in the layer is saved, so everything lives only until its last read.
    transient = gc_f.live_peak(l1, keep_saved=False) if gc_f is not None else f.live_peak(l1, keep_saved=True)
    return _Stack(name, depth, saved1, all1 - saved1, saved0 - saved1, (all0 - saved0) - (all1 - saved1),
                  transient, f.bytes_of(carry), gc_held, saved_w, all_w - saved_w,
                  saved0_w - saved_w, (all0_w - saved0_w) - (all_w - saved_w))


@dataclass
class _LayerBackward:
    """The maximum inside one layer's backward: what is still saved, new gradients, transients."""

    acts: int
    grads: int
    temp: int
    layer_grads: int  # all of the layer's new gradients (0 when they accumulate into existing ones)
    acts_w: int = 0  # autocast weight copies among `acts`
    start: int = 0  # what the layer saved, all alive when its backward starts
    start_w: int = 0


def _layer_backward(f: _Forward, scope: str, accumulate: bool, residual_grad: int,
                    layerwise_step: dict[int, int] | None = None) -> _LayerBackward:
    """Replay one layer's backward over the forward tape, in reverse.

    Going back through the tape, the op at each position makes the gradient of
    its input from the gradient of its output (both alive), a linear also makes
    its weight's gradient (in the compute dtype first under autocast, then the
    fp32 copy), and once an op is done the tensors it saved are freed. The
    gradient flowing along the residual stream stays alive throughout.
    With `layerwise_step` (element count -> step temporaries of a tensor that size), each
    weight's gradient is stepped by its own optimizer as soon as it is made and freed
    (layerwise GaLore / APOLLO): it never joins the layer's gradients.
    """
    tensors = [t for t in f.tensors if t.scope == scope]
    if not tensors:
        return _LayerBackward(0, 0, residual_grad, 0)
    start, end = tensors[0].idx, tensors[-1].idx
    by_pos = {t.idx: t for t in tensors}
    frees: dict[int, int] = {}
    frees_w: dict[int, int] = {}
    live = live_w = 0
    for t in f.tensors:
        if t.saved and t.scope == scope:
            b = f.bytes_of(t)
            live += b
            pos = t.first_save if t.first_save is not None and t.first_save <= end else end + 1
            frees[pos] = frees.get(pos, 0) + b
            if t.weight_copy:
                live_w += b
                frees_w[pos] = frees_w.get(pos, 0) + b
    grads_at: dict[int, list] = {}
    for pos, sc, numel, dtype, cast in f.grad_events:
        if sc == scope:
            grads_at.setdefault(pos, []).append((numel, dtype, cast))
    live -= frees.pop(end + 1, 0)  # saved by the next layer: freed in its backward
    live_w -= frees_w.pop(end + 1, 0)
    start_live, start_w = live, live_w
    cuda = f.ctx.cuda
    new = 0
    best = _LayerBackward(live, 0, residual_grad, 0, live_w)
    for pos in range(end, start - 1, -1):
        t = by_pos.get(pos)
        tmp = residual_grad + (2 * f.bytes_of(t) if t is not None and t.rg and t.alloc else 0)
        stepped = 0
        for numel, dtype, cast in grads_at.get(pos, ()):
            g = _nbytes(numel, _SIZE[dtype], cuda)
            if cast and cast != dtype:
                tmp += _nbytes(numel, _SIZE[cast], cuda)
            if layerwise_step is not None:  # one gradient at a time with its step, then freed
                stepped = max(stepped, g + layerwise_step.get(numel, 0))
            elif accumulate:
                tmp += g  # computed, added in place into .grad, freed
            else:
                new += g
        tmp += stepped
        if live + new + tmp > best.acts + best.grads + best.temp:
            best = _LayerBackward(live, new, tmp, 0, live_w)
        live -= frees.get(pos, 0)
        live_w -= frees_w.get(pos, 0)
    best.layer_grads = new
    best.start, best.start_w = start_live, start_w
    return best


def _run_forward(spec, settings, ctx: _Ctx) -> tuple[_Forward, dict]:
    """The symbolic forward: embedding, three layers per stack, the final norm. Returns the head input too."""
    f = _Forward(ctx)
    fam = _family(spec).Forward(spec, settings, f)
    out = {}
    f.scope = "emb"
    x = fam.embed()
    if ctx.packed:  # masking_utils builds the packed rows' block-diagonal mask once, [1, 1, s, s] bool
        f.hold(f.new(ctx.b * ctx.s * ctx.s, "bool", False))
    if spec.is_encoder_decoder:
        for i in range(3):
            f.scope = f"s0.L{i}"
            x = fam.encoder_layer(x, i)
            out.setdefault("carry0", x) if i == 1 else None
        f.scope = "mid"
        enc = fam.encoder_final(x)
        fam.start_decoder()
        x = fam.embed()
        for i in range(3):
            f.scope = f"s1.L{i}"
            x = fam.decoder_layer(x, i, enc)
            out.setdefault("carry1", x) if i == 1 else None
    else:
        for i in range(3):
            f.scope = f"s0.L{i}"
            x = fam.layer(x, i)
            out.setdefault("carry0", x) if i == 1 else None
    f.scope = "final"
    out["head_in"] = fam.final(x)
    return f, out


def _head(spec, settings, ctx: _Ctx, f: _Forward, head_in: _T) -> _Head:
    """The head and the loss, forward and backward, as short event sequences."""
    f.scope = "head"
    T, cuda = ctx.tokens, ctx.cuda
    width = spec.embedding_dim or spec.hidden_size  # OPT's word_embed_proj_dim after project_out
    nb = lambda numel, dt: _nbytes(numel, _SIZE[dt], cuda)  # noqa: E731
    if settings.task == "seq-cls":
        # score / classifier on every position (decoder models) or on the pooled [CLS]
        # (BERT's pooler: dense + tanh + dropout): a few [b, labels] tensors.
        head_trainable = True  # fully trained, or peft's trainable copy (modules_to_save)
        logits = _family(spec).Forward(spec, settings, f).seq_cls_logits(head_in, width, settings.num_labels,
                                                                          head_trainable)
        f.hold(logits)
        saved = f.scope_bytes("head", held=False)
        held = f.scope_bytes("head", held=True) - saved
        saved_w = f.scope_bytes("head", held=False, weight_copies=True)
        held_w = f.scope_bytes("head", held=True, weight_copies=True) - saved_w
        small = 4 * nb(ctx.b * settings.num_labels, "f32")
        grad_in = nb(T * width, head_in.dtype)
        return _Head(saved, held, small, grad_in + small, 0, grad_in, saved_w, held_w)
    head_trainable = ctx.full_ft
    if settings.use_liger_kernel:
        return _liger_head(spec, settings, ctx, f, head_in, width, head_trainable)
    if settings.trainer != "trainer":
        return _trl_fused_head(spec, settings, ctx, head_in, width, head_trainable)
    logits = f.linear(head_in, width, spec.vocab_size, "lm_head", False, trainable=head_trainable, lora=False)
    L = logits.numel
    cdt = logits.dtype
    softcap = spec.final_logit_softcapping
    if softcap:
        # logits / cap -> tanh (saved) -> * cap
        th = f.new(L, cdt, True)
        f.save(th)
        logits = f.new(L, cdt, True)
    f.hold(logits)
    saved = f.scope_bytes("head", held=False)
    held = f.scope_bytes("head", held=True) - saved
    saved_w = f.scope_bytes("head", held=False, weight_copies=True)
    held_w = f.scope_bytes("head", held=True, weight_copies=True) - saved_w
    # The loss works on fp32 logits: the causal-LM loss calls logits.float(); T5's
    # CrossEntropyLoss gets fp32 from autocast (cross_entropy runs in fp32) but the raw
    # logits' dtype without it. log_softmax saves its output; nll_loss makes a scalar.
    loss_dt = "f32" if (settings.task == "causal-lm" or ctx.ac) else cdt
    Lc, L4 = nb(L, cdt), nb(L, loss_dt)
    labels = 2 * nb(T + ctx.b, "i64")  # padded and shifted labels
    upcast = L4 if cdt != loss_dt else 0
    during_loss = upcast + L4 + labels
    # After the model returns, accelerate's convert_to_fp32 copies the logits under autocast.
    after_loss = L4 + (nb(L, "f32") if ctx.ac else 0)
    # (soft-capping's transients never exceed the tanh output and the final logits it leaves)
    fwd_extra = max(during_loss, after_loss)
    # Backward (outputs deleted: logits, their copies and the autocast cache are gone), as
    # bytes beyond what the layers saved:
    # - nll_loss backward makes grad_logsm; log_softmax backward reads it and its saved
    #   output and makes the grad of the (upcast) logits;
    # - the upcast's backward casts that grad back to the logits' dtype;
    # - the head's mm backward makes the hidden-state grad and the weight grad (under
    #   autocast in the compute dtype, then its fp32 copy).
    # Each step: (activations still saved beyond the layers', temporaries, weight copies gone).
    steps = [(L4, 2 * L4, 0)]  # log_softmax's saved output, its grad in, its grad out
    cur = L4
    if cdt != loss_dt:
        steps.append((0, L4 + Lc, 0))
        cur = Lc
    if softcap:
        steps.append((0, cur + 2 * Lc, 0))  # tanh's backward reads its saved output
    hidden_grad = nb(T * width, cdt)
    grad_w = 0
    if head_trainable:
        wv = width * spec.vocab_size
        grad_w = nb(wv, ctx.wdt)
        if ctx.ac and ctx.wdt != ctx.ac:
            steps.append((0, cur + hidden_grad + nb(wv, cdt), 0))
            # the cast's backward, after mm released its saved input and weight copies
            steps.append((-saved, hidden_grad + nb(wv, cdt) + grad_w, -saved_w))
        else:
            steps.append((0, cur + hidden_grad + grad_w, 0))
    else:
        steps.append((0, cur + hidden_grad, 0))
    acts_extra, bwd_peak, peak_w = max(steps, key=lambda x: x[0] + x[1])
    return _Head(saved, held, fwd_extra, bwd_peak, grad_w, hidden_grad, saved_w, held_w, peak_w, acts_extra)


def _liger_head(spec, settings, ctx: _Ctx, f: _Forward, head_in: _T, width: int, trainable: bool) -> _Head:
    """The head and loss under Liger's fused linear cross-entropy (`use_liger_kernel=True`).

    Modelled from its algorithm (liger_kernel/ops/fused_linear_cross_entropy.py,
    `fused_linear_cross_entropy_forward`); the Triton kernel itself only writes the
    loss and, in place, the logits' gradient. The causal-LM forward Liger patches in
    never materialises the logits; inside the forward the loss function:
    - pads and shifts the labels (two int64 copies), keeps a fp32 loss per token
      and the ignore mask;
    - allocates grad_input = zeros_like(hidden) and grad_weight = zeros_like(lm_head
      weight) (the weight's dtype), both saved for backward, which only scales them;
    - walks the tokens in chunks of next_pow2(ceil(T / ceil(V / H))) rows: the
      chunk's logits (compute dtype) become their own gradient in place, then
      grad_input's rows are a chunk x H matmul and grad_weight accumulates
      grad_logits^T @ input. On CUDA sm80+ that accumulation is an in-place addmm;
      elsewhere (older GPUs, the CPU) Liger's fallback makes a V x H product in the
      compute dtype and its fp32 copy (`torch.mm(...).float()`), per chunk.
    Under autocast the weight's compute-dtype copy is cached, as for an ordinary head.
    """
    T, V, H = ctx.tokens, spec.vocab_size, width
    nb = lambda numel, dt: _nbytes(numel, _SIZE[dt], ctx.cuda)  # noqa: E731
    cdt = ctx.ac or head_in.dtype
    held = weight_copy = 0
    if ctx.ac and ctx.wdt != ctx.ac:
        weight_copy = nb(V * H, ctx.ac)
        if trainable:
            held = weight_copy  # autocast's cache of a trainable leaf's cast
    grad_input = nb(T * H, head_in.dtype)
    grad_weight = nb(V * H, ctx.wdt) if trainable else 0
    inc = -(-V // H)
    chunk = min(T, 1 << max(0, (-(-T // inc) - 1).bit_length()))
    labels = nb(ctx.b * (ctx.s + 1), "i64") + nb(T, "i64")  # padded, then the shifted contiguous copy
    per_token = nb(T, "f32") + nb(T, "bool")  # loss_1d and the ignore mask
    in_chunk = nb(chunk * H, cdt) if cdt != head_in.dtype else 0  # autocast's cast of the chunk
    logits = nb(chunk * V, cdt)
    step_grad_in = nb(chunk * H, cdt)
    sm80 = True
    if settings.gpu is not None:
        from hf_memfit.hardware import find_gpu

        sm80 = find_gpu(settings.gpu).compute_capability >= (8, 0)
    legacy = trainable and not (ctx.cuda and sm80 and cdt in ("bf16", "f16"))
    legacy_w = (nb(V * H, cdt) + (nb(V * H, "f32") if cdt != "f32" else 0)) if legacy else 0
    uncached = weight_copy if not held else 0  # a frozen head's weight is cast again for each matmul
    loop = in_chunk + logits + max(step_grad_in + uncached, legacy_w + in_chunk)
    fwd_extra = labels + per_token + loop
    return _Head(saved=grad_input, held=held, fwd_extra=fwd_extra, bwd_peak=0, grad_bytes=grad_weight,
                 bwd_after=grad_input, saved_w=0, held_w=held, fwd_grads=grad_weight)
# TRL 1.16's fused LM head (`add_fused_lm_head`, trl/trainer/utils.py; the kernel in
# trl/kernels/chunked_logprob.py), which TRL's SFT and DPO trainers patch into the model.
_TRL_TOKEN_CHUNK = 4096  # TOKEN_CHUNK_SIZE: tokens projected per tile
_TRL_VOCAB_CHUNK = 32768  # _CHUNKED_LOGPROB_CHUNK_SIZE: the scratch tile's width, whatever the vocabulary
# Per-token outputs each trainer asks the head for (the same table as step.TRL_HEAD_OUTPUTS).
_TRL_HEAD_OUTPUTS = {"sft": ("log_probs", "entropy", "is_top1"), "dpo": ("log_probs", "entropy", "mean_logits", "is_top1")}
# Without Triton (the CPU) torch ops fold each tile (`_forward_tile`, `_backward_tile`); their fp32
# temporaries of the tile's shape [tokens, min(vocab, chunk)] at their most, counted by exact mode
# running TRL 1.16's own code on fake tensors (head alone: fp32 and bf16 autocast, 126 to 4792 tokens,
# vocab 1000 and 5000): 3 in forward (+ 2 bool masks, a quarter each, for `is_top1`), 7.25 in backward.
# On CUDA the Triton kernels fold the tile in registers, in place.
_TRL_CPU_FORWARD_TILES = 3.0
_TRL_CPU_TOP1_TILES = 0.25
_TRL_CPU_BACKWARD_TILES = 7.25


def _trl_fused_head(spec, settings, ctx: _Ctx, head_in: _T, width: int, head_trainable: bool) -> _Head:
    """TRL's fused LM head and loss: per-token log-probs in tiles, never the logits.

    Forward: the shifted hidden states [N, H] (a copy; saved for backward), a
    scratch tile [min(N, 4096), 32768] in the compute dtype, seven fp32 running
    statistics per token, and on the CPU the torch fold's tile temporaries.
    Backward: the tile again, fp32 accumulators for the hidden-state and (when
    trained) the head-weight gradients, and the fold's temporaries.
    """
    cuda = ctx.cuda
    nb = lambda numel, dt: _nbytes(numel, _SIZE[dt], cuda)  # noqa: E731
    hd = head_in.dtype
    cd = ctx.ac or hd
    rows_tokens = ctx.b * (ctx.s - 1)  # labels shifted by one in every row
    tile_rows = min(rows_tokens, _TRL_TOKEN_CHUNK)
    tile_cols = min(spec.vocab_size, _TRL_VOCAB_CHUNK)
    scratch = nb(tile_rows * _TRL_VOCAB_CHUNK, cd)
    tile_f32 = nb(tile_rows * tile_cols, "f32")
    outputs = _TRL_HEAD_OUTPUTS[settings.trainer]
    fwd_tiles = 0 if cuda else int((_TRL_CPU_FORWARD_TILES + (_TRL_CPU_TOP1_TILES if "is_top1" in outputs else 0))
                                   * tile_f32)
    bwd_tiles = 0 if cuda else int(_TRL_CPU_BACKWARD_TILES * tile_f32)
    hidden = nb(rows_tokens * width, hd)
    hidden_cast = nb(tile_rows * width, cd) if cd != hd else 0
    # saved: the hidden states, log Z and the entropy (fp32), the targets (int64)
    saved = hidden + 2 * nb(rows_tokens, "f32") + nb(rows_tokens, "i64")
    # returned: log-probs, entropy, the label mask and top-1 hits per token, with their masked copies
    held = 4 * nb(rows_tokens, "f32") + 3 * nb(rows_tokens, "bool")
    # during the head: the final norm's output (the backbone's output, until the forward returns), the
    # running statistics, the clamped labels, the scratch tile and the fold's temporaries
    fwd_extra = nb(ctx.tokens * width, hd) + 7 * nb(rows_tokens, "f32") + nb(rows_tokens, "i64") + \
        scratch + hidden_cast + fwd_tiles
    grad_w = nb(spec.vocab_size * width, ctx.wdt) if head_trainable else 0
    accumulators = nb(rows_tokens * width, "f32") + (nb(spec.vocab_size * width, "f32") if head_trainable else 0)
    weight_cast = nb(tile_cols * width, cd) if ctx.wdt != cd else 0
    bwd_peak = scratch + bwd_tiles + accumulators + hidden_cast + weight_cast
    hidden_grad = nb(ctx.tokens * width, hd)  # the shift's backward pads the grad back to [b, s, H]
    return _Head(saved, held, fwd_extra, bwd_peak, grad_w, hidden_grad)


def _activations(spec, settings) -> _Activations:
    ctx = _ctx(spec, settings)
    f, out = _run_forward(spec, settings, ctx)
    gc_f = None
    if settings.gradient_checkpointing:
        # the recompute inside backward runs the layer as an ordinary forward (no KV cache)
        gc_f, _ = _run_forward(spec, settings, ctx)
    head = _head(spec, settings, f.ctx, f, out["head_in"])  # f.ctx: the decoder's, for seq2seq
    stacks = [_stack_summary(f, "s0", spec.num_layers, out["carry0"], gc_f)]
    if spec.is_encoder_decoder:
        stacks.append(_stack_summary(f, "s1", spec.num_decoder_layers, out["carry1"], gc_f))

    def part(scope):
        saved, every = f.scope_bytes(scope, held=False), f.scope_bytes(scope, held=True)
        saved_w, every_w = (f.scope_bytes(scope, held=False, weight_copies=True),
                            f.scope_bytes(scope, held=True, weight_copies=True))
        return saved, every - saved, saved_w, every_w - saved_w

    pre, mid, fin = part("emb"), part("mid"), part("final")
    return _Activations(
        pre_saved=pre[0], pre_held=pre[1], stacks=stacks, mid_saved=mid[0], mid_held=mid[1],
        final_saved=fin[0], final_held=fin[1], head=head,
        pre_w=pre[2], pre_held_w=pre[3], mid_w=mid[2], mid_held_w=mid[3], final_w=fin[2], final_held_w=fin[3],
        tape=f, gc_tape=gc_f,
    )


# ---------------------------------------------------------------------------
# The step: model states plus activations, region by region
# ---------------------------------------------------------------------------


def _row(weights, gradients, optimizer, activations, temporary, weight_copies=0) -> dict[str, int]:
    """One candidate. Autocast's weight copies are among `activations` here and reported as weights."""
    return {"weights": int(weights + weight_copies), "gradients": int(gradients), "optimizer": int(optimizer),
            "activations": int(max(0, activations - weight_copies)), "temporary": int(max(0, temporary)),
            "overhead": 0}


def fast_step_memory(spec, settings) -> StepMemory:
    """Closed-form peak candidates for one training step (fast mode; no torch).

    `spec` is a `ModelSpec`, `settings` a `TrainSettings` (its task is resolved
    here when None). Returns a `StepMemory` for one process on one device, no
    sharding: bytes by category at each region's maximum, plus the parameter
    facts (trainable / total params with LoRA, the largest tensor, and for
    4-bit the linear weights bitsandbytes would pack).

    Regions follow exact mode's names: "1.<micro>|fwd|pre" (embeddings),
    "|fwd|s<k>.last" (inside stack k's last layer), "|fwd|s<k>.post" (the end of
    the forward: logits and loss alive), "|bwd|pre" (the head's and the loss's
    backward), "|bwd|s<k>.first" / ".last" (the first and last layer of stack k
    in backward), "|bwd|s<k>.post" (the embedding's backward) and "1.<m>|opt"
    (clipping and the optimizer step). With gradient accumulation the "1.1|..."
    regions are the later micro-batches, which run with the gradients allocated.
    """
    if settings.task is None:
        settings = settings.validate(spec)
    ctx = _ctx(spec, settings)
    cuda = ctx.cuda
    params = _parameters(spec, settings, ctx.wdt)
    trainable = [p for p in params if p.trainable]
    W = sum(_param_bytes(p, cuda) for p in params)
    if settings.reference == "copy":  # DPO's frozen reference model: the base model again, without adapters
        W += sum(_param_bytes(p, cuda) for p in params if p.kind not in ("lora", "head_copy"))
    G = sum(_param_bytes(p, cuda) for p in trainable)
    opt_tensors = _optimizer_tensors(params, settings, spec)
    O = sum(optimizers.state_bytes(t, settings.optim, cuda, optim_args=settings.optim_args) for t in opt_tensors)
    opt_tmp = optimizers.tensors_step_temporary_bytes(opt_tensors, settings.optim, settings.device,
                                                      optim_args=settings.optim_args)
    acts = _activations(spec, settings)
    head = acts.head
    emb_grads = [_param_bytes(p, cuda) for p in params if p.trainable and p.kind == "embedding"]
    gc = settings.gradient_checkpointing

    # Offloaded checkpoints (activation_checkpointing_kwargs={"offload": True}): each layer's saved
    # input is copied to pinned host memory in the forward and back for the layer's recompute.
    kept_inputs = 0 if settings.offload_activations or settings.activation_offloading else 1
    # TRL's activation_offloading (step.TrlOffloadedActivations): every saved tensor of 1 KiB or more goes to
    # pinned host memory as it is saved and comes back when its backward node runs. Modelled here: nothing
    # saved outside the layer being run backward stays on the GPU (the checkpoints' inputs, the embeddings',
    # the other layers'); the head's saved tensors and the running layer's are counted whole (they come back
    # node by node: an upper bound), as is what the forward's last five offloaded tensors overlap with.
    trl_offload = settings.activation_offloading
    # Layerwise GaLore / APOLLO: each parameter is stepped by its own optimizer as soon as its gradient
    # is accumulated, inside backward, and the gradient is freed; no gradients outlive their step and
    # there is no step after backward. In a layer's backward (`_layer_backward`) each gradient is stepped
    # where it is made; the head's and the embeddings' at the end of their backward.
    layerwise = settings.optimizer.layerwise
    lw_layer_step = _layerwise_steps(trainable, opt_tensors, ("layer", "norm", "lora", "other"), settings)
    lw_head = _layerwise_footprint(trainable, opt_tensors, ("head", "head_copy"), settings)
    lw_emb = _layerwise_footprint(trainable, opt_tensors, ("embedding",), settings)

    def trl_kept(st: _Stack) -> int:
        """Per layer, what TRL's offloading leaves on the GPU (saved twice, or too small to offload)."""
        return 0 if gc else _trl_kept_bytes(acts.tape, f"{st.name}.L1")

    def stack_fwd(st: _Stack) -> tuple[int, int]:
        """Bytes (and weight copies among them) a whole stack holds at the end of its forward."""
        if gc:  # each checkpointed layer keeps its input; autocast still caches its weight copies
            return st.first_held + st.depth * (kept_inputs * st.carry + st.gc_held), st.depth * st.gc_held
        if trl_offload:  # saved tensors offloaded; autocast's weight copies stay in its cache until the forward ends
            held = st.total(True) - st.total(False)
            return held + st.total_w(False) + st.depth * trl_kept(st), st.total_w(True)
        return st.total(True), st.total_w(True)

    def stack_saved(st: _Stack) -> tuple[int, int]:
        """Bytes (and weight copies) a stack keeps for backward once the forward is over."""
        if gc:  # the checkpoints keep each layer's input, and what layer 0 passes on (T5's bias)
            return max(0, st.first_held) + kept_inputs * st.depth * st.carry, 0
        if trl_offload:
            return st.depth * trl_kept(st), 0
        return st.first_saved + st.depth * st.saved, st.first_saved_w + st.depth * st.saved_w

    candidates: dict[str, dict[str, int]] = {}
    micros = [0] if settings.gradient_accumulation_steps == 1 else [0, 1]
    last = acts.stacks[-1].name
    tied = settings.task != "seq-cls" and spec.tie_word_embeddings
    for m in micros:
        tag = f"1.{m}"
        g_live = G if m else 0
        # --- forward: saved and held tensors pile up -------------------------------
        fwd, fwd_w = acts.pre_saved + acts.pre_held, acts.pre_w + acts.pre_held_w
        candidates[f"{tag}|fwd|pre"] = _row(W, g_live, O, fwd, 0, fwd_w)
        for k, st in enumerate(acts.stacks):
            if k:
                fwd += acts.mid_saved + acts.mid_held
                fwd_w += acts.mid_w + acts.mid_held_w
            total, total_w = stack_fwd(st)
            # inside a layer: its unsaved temporaries (checkpointing saves nothing in the layer)
            layer_peak = st.transient
            if trl_offload:  # the last offloaded tensors, kept until their copy is done
                layer_peak += _trl_forward_stash(st, acts.tape, gc)
            candidates[f"{tag}|fwd|{st.name}.last"] = _row(W, g_live, O, fwd + total + layer_peak, 0,
                                                            fwd_w + total_w)
            fwd, fwd_w = fwd + total, fwd_w + total_w
        end = fwd + acts.final_saved + acts.final_held + head.saved + head.held + head.fwd_extra
        end_w = fwd_w + acts.final_w + acts.final_held_w + head.saved_w + head.held_w
        # Liger's head gradient exists from the loss on: the .grad-to-be in the first micro-batch,
        # a buffer added into .grad by backward in the later ones.
        head_g, head_a = (0, head.fwd_grads) if m else (head.fwd_grads, 0)
        candidates[f"{tag}|fwd|{last}.post"] = _row(W, g_live + head_g, O, end + head_a, 0, end_w)
        # --- backward: the head, then each stack top-down, then the embeddings --------
        stacks_saved = [stack_saved(st) for st in acts.stacks]
        below = (0 if trl_offload else acts.pre_saved + acts.mid_saved) + sum(x for x, _ in stacks_saved)
        below_w = (0 if trl_offload else acts.pre_w + acts.mid_w) + sum(x for _, x in stacks_saved)
        saved = below + acts.final_saved + head.saved
        saved_w = below_w + acts.final_w + head.saved_w
        candidates[f"{tag}|bwd|pre"] = _row(W, g_live + head_g, O, saved + head.bwd_peak_acts + head_a,
                                            head.bwd_peak, saved_w + head.bwd_peak_w)
        if layerwise and not tied and any(lw_head):
            # An untied head's gradient is stepped (and freed) by its hook as soon as the head's matmul
            # backward has made it (AccumulateGrad runs first among ready nodes): the head's saved tensors
            # are gone, the hidden states' gradient is there.
            step = _row(W, g_live + head_g, O, saved - head.saved + head_a, head.bwd_after + sum(lw_head),
                        saved_w - head.saved_w)
            if sum(step.values()) > sum(candidates[f"{tag}|bwd|pre"].values()):
                candidates[f"{tag}|bwd|pre"] = step
        # A tied weight's two gradients (head, embedding) meet in the autograd engine's input
        # buffer of its AccumulateGrad node: the head's waits there, as a temporary, until the
        # embedding's arrives; then their sum (made out of place) becomes, or is added into, .grad.
        if tied:
            grads, tied_tmp = g_live, head.grad_bytes
        else:  # an untied head's gradient becomes (or is added in place into) its .grad at once
            grads, tied_tmp = g_live + (0 if m or layerwise else head.grad_bytes), 0
        for k in reversed(range(len(acts.stacks))):
            st = acts.stacks[k]
            below -= stacks_saved[k][0]
            below_w -= stacks_saved[k][1]
            tape = acts.gc_tape if gc else acts.tape
            lb = _layer_backward(tape, f"{st.name}.L1", bool(m), st.carry + head.bwd_after, lw_layer_step)
            if gc:
                # Checkpointing keeps each layer's input. Backward first re-runs the layer's
                # forward (everything it saves, plus its output, beside the incoming grad),
                # then runs its backward; exact mode counts the recompute as temporary.
                recompute_end = max(lb.start + st.carry, tape.live_peak(f"{st.name}.L1", keep_saved=False,
                                                                         everything=True)) + st.carry + head.bwd_after
                inner, new_g = ((recompute_end, 0) if recompute_end >= lb.acts + lb.grads + lb.temp
                                else (lb.acts + lb.temp, lb.grads))
                kept = max(0, st.first_held)
                top = below + kept + (st.depth if kept_inputs else 1) * st.carry
                candidates[f"{tag}|bwd|{st.name}.first"] = _row(W, grads + new_g, O, top, inner + tied_tmp)
                candidates[f"{tag}|bwd|{st.name}.last"] = _row(
                    W, grads + (st.depth - 1) * lb.layer_grads + new_g, O, below + kept + st.carry,
                    inner + tied_tmp)
            else:
                rest = (st.depth - 1) * trl_kept(st) if trl_offload else st.first_saved + (st.depth - 1) * st.saved
                candidates[f"{tag}|bwd|{st.name}.first"] = _row(
                    W, grads + lb.grads, O, below + rest + lb.acts, lb.temp + tied_tmp,
                    below_w + st.first_saved_w + (st.depth - 1) * st.saved_w + lb.acts_w)
                candidates[f"{tag}|bwd|{st.name}.last"] = _row(
                    W, grads + (st.depth - 1) * lb.layer_grads + lb.grads, O, below + st.first_saved + lb.acts,
                    lb.temp + tied_tmp, below_w + st.first_saved_w + lb.acts_w)
            grads += st.depth * lb.layer_grads
            # Then the stack's embedding backward (T5's decoder reuses the shared table).
            if k == 0 or spec.is_encoder_decoder:  # T5's decoder reuses the shared table
                grads_now = G if (m or k == 0) else grads + tied_tmp
                if emb_grads:
                    # The embedding ops' saved tensors are gone by the dense backward.
                    emb_acts = below if k else 0
                    if tied:  # the buffered head grad, the table's new grad and their sum
                        emb_tmp = (2 + (1 if m else 0)) * max(emb_grads)
                    else:  # the table's grad becomes .grad (later micro-batches: added in place, freed)
                        emb_tmp = st.carry + (max(emb_grads) if m else 0)
                else:
                    # frozen table: the gradient only flows back to the embedding output when
                    # peft made it require grad (checkpointing), through the embedding's ops
                    emb_acts = below
                    emb_tmp = 2 * st.carry if ctx.embeddings_need_grad else 0
                if layerwise:  # only the table's own gradient; its step runs once the backward's buffers are freed
                    grads_now, emb_tmp = (lw_emb[0], max(emb_tmp, lw_emb[1])) if emb_grads else (0, emb_tmp)
                candidates[f"{tag}|bwd|{st.name}.post"] = _row(W, grads_now, O, emb_acts, emb_tmp,
                                                               below_w if k else 0)
        if m == micros[-1]:  # layerwise: the Trainer's `LayerWiseDummyOptimizer` steps nothing, no gradient is left
            candidates[f"{tag}|opt"] = _row(W, 0, O, 0, 0) if layerwise else _row(W, G, O, 0, opt_tmp)
    return StepMemory(
        candidates=candidates,
        trainable_params=sum(p.numel * p.count for p in trainable),
        total_params=sum(p.numel * p.count for p in params),
        largest_param_numel=max(p.numel for p in params),
        quantizable_linear_params=_quantizable(spec, settings)[0],
        largest_linear_numel=_quantizable(spec, settings)[1],
        host_bytes=_offloaded_checkpoint_bytes(acts, settings) + _trl_host_bytes(acts, settings),
    )


def _layerwise_steps(trainable: list[_Param], tensors: list, kinds: tuple[str, ...], settings) -> dict[int, int] | None:
    """Element count -> the most step temporaries of a layerwise optimizer over one tensor of these kinds that size.

    None when the optimizer is not layerwise (`_layer_backward` then accumulates gradients).
    """
    if not settings.optimizer.layerwise:
        return None
    steps: dict[int, int] = {}
    for p, t in zip(trainable, tensors):
        if p.kind in kinds:
            step = optimizers.tensors_step_temporary_bytes([t], settings.optim, settings.device,
                                                           optim_args=settings.optim_args)
            steps[p.numel] = max(steps.get(p.numel, 0), step)
    return steps


def _layerwise_footprint(trainable: list[_Param], tensors: list, kinds: tuple[str, ...], settings) -> tuple[int, int]:
    """(gradient, step temporaries) of the tensor of these kinds whose step inside backward holds the most.

    A layerwise optimizer steps one parameter at a time from its post-accumulate-grad hook: its
    gradient, then its own optimizer's step (`optimizers.tensors_step_temporary_bytes` of it alone).
    (0, 0) when the optimizer is not layerwise or no trainable tensor is of these kinds.
    """
    if not settings.optimizer.layerwise:
        return 0, 0
    cuda = settings.device == "cuda"
    best = (0, 0)
    for p, t in zip(trainable, tensors):
        if p.kind in kinds:
            grad = _nbytes(p.numel, _SIZE[p.dtype], cuda)
            step = optimizers.tensors_step_temporary_bytes([t], settings.optim, settings.device,
                                                           optim_args=settings.optim_args)
            if grad + step > sum(best):
                best = (grad, step)
    return best


# TRL 1.16 OffloadActivations: tensors under `min_offload_size` stay on the GPU; the last `max_fwd_stash_size`
# offloaded tensors are kept alive on the GPU until their copy is done (trl/models/activation_offloading.py).
TRL_MIN_OFFLOAD_BYTES = 1024
TRL_FORWARD_STASH = 5


def _trl_host_bytes(acts: _Activations, settings) -> int:
    """Pinned host memory TRL's activation offloading holds at the end of the forward: one copy of every tensor
    saved outside a checkpointed layer (1 KiB or more), each rounded up to a power of two by the host allocator.
    With checkpointing a layer saves only its input."""
    if not settings.activation_offloading:
        return 0
    tape = acts.tape

    def scope_host(scope: str) -> int:
        sizes = (t.numel * _SIZE[t.dtype] for t in tape.tensors if t.scope == scope and t.saved)
        return sum(pinned_host_bytes(n) for n in sizes if n >= TRL_MIN_OFFLOAD_BYTES)

    # the head's saved tensors are known only as a total here (TRL's fused head: the hidden states, two fp32
    # and one int64 per-token vector): taken without the power-of-two rounding of each
    host = scope_host("emb") + scope_host("mid") + scope_host("final") + acts.head.saved
    for st in acts.stacks:
        host += st.depth * (pinned_host_bytes(st.carry) if settings.gradient_checkpointing
                            else scope_host(f"{st.name}.L1"))
    return host


def _trl_kept_bytes(tape: _Forward, scope: str) -> int:
    """Bytes of `scope`'s tensors that TRL's offloading leaves on the GPU until backward: those saved by more
    than one op (the second save finds the storage already offloaded and in the stash, and keeps it), and
    those under `min_offload_size`."""
    return sum(tape.bytes_of(t) for t in tape.tensors if t.scope == scope and t.saved
               and (t.saves > 1 or t.numel * _SIZE[t.dtype] < TRL_MIN_OFFLOAD_BYTES))


def _trl_forward_stash(st: _Stack, tape: _Forward, gc: bool) -> int:
    """GPU bytes TRL's forward stash keeps beyond what the forward itself holds, in a stack's forward.

    With checkpointing the offloaded tensors are the layers' inputs, which the forward
    would have dropped: the last five of them. Without, the five largest tensors a
    layer saves (an upper bound: the stash holds the last five saved, some of which
    the forward still holds).
    """
    if gc:
        return min(TRL_FORWARD_STASH, st.depth) * st.carry
    sizes = sorted((tape.bytes_of(t) for t in tape.tensors if t.saved and t.scope == f"{st.name}.L1"
                    and tape.bytes_of(t) >= TRL_MIN_OFFLOAD_BYTES), reverse=True)
    return sum(sizes[:TRL_FORWARD_STASH])


def _offloaded_checkpoint_bytes(acts: _Activations, settings) -> int:
    """Pinned host memory for one micro-batch's offloaded checkpoint inputs (one hidden state per layer),
    each allocation rounded to a power of two by the CUDA host allocator."""
    if not (settings.offload_activations and settings.gradient_checkpointing):
        return 0
    return sum(st.depth * pinned_host_bytes(st.carry) for st in acts.stacks)


def pinned_host_bytes(nbytes: int) -> int:
    """What a pinned host allocation takes: CachingHostAllocator rounds it up to a power of two
    (ATen/core/CachingHostAllocator.h, `PowerOf2Ceil`, below `pinned_max_round_threshold`, unlimited by default)."""
    return 1 << max(0, (nbytes - 1).bit_length()) if nbytes > 0 else 0


def _quantizable(spec, settings) -> tuple[int, int]:
    """Linear weights bitsandbytes would pack to 4 bits (every Linear but the head and adapters), and the largest."""
    if not settings.load_in_4bit:
        return 0, 0
    mods = [m for m in spec.linear_modules(settings.task, settings.num_labels) if m.scope != "head"]
    return sum(m.weight_numel * m.count for m in mods), max((m.weight_numel for m in mods), default=0)

"""Fast mode: the peak memory of one training step in closed form, without torch.

`fast_step_memory(spec, settings)` returns the same kind of `StepMemory` as
exact mode (`exact.exact_candidates`): live bytes by category at each region
of the step where the peak can fall. Nothing here imports torch,
transformers or peft (the CLI's fast path must start in well under a second),
so everything is derived from the `ModelSpec`:

- Model states are exact arithmetic over the model's parameter tensors
  (enumerated from `spec.linear_modules` plus the embedding tables and norm
  vectors): weights in their storage dtype, gradients for trainable tensors,
  optimizer states in the layout each optimizer allocates.
- Activations come from a small symbolic forward: each family's layer is
  written as the sequence of ops transformers 5 runs (`models/forward.py`), and every op
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

The semantics follow exact mode, which runs the real step on fake tensors with
CUDA's behaviour emulated where it differs from the CPU's (`fake_patches`), so
that both modes agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_memfit import optimizers
from hf_memfit.estimator.breakdown import StepMemory
from hf_memfit.estimator.fast_heads import HeadMemory, head_memory
from hf_memfit.estimator.fast_params import (ParamGroup, family_of, lora_targets, optimizer_tensors, param_bytes,
                                             parameters, quantizable, unpacked_4bit)
from hf_memfit.estimator.pinned_host import pinned_host_bytes
from hf_memfit.models.forward import DTYPE_BYTES, DTYPE_TAG, ForwardTape, StepContext, SymTensor
from hf_memfit.optimizers import allocated_bytes


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
    # checkpointing: whether a layer's recompute saves its input (an offloaded checkpoint's copy, brought
    # back for the recompute, then stays on the device through the layer's backward; else it is freed after)
    recompute_saves_input: bool = True

    def total(self, held: bool) -> int:
        per = self.saved + (self.held if held else 0)
        first = self.first_saved + (self.first_held if held else 0)
        return first + per * self.depth

    def total_w(self, held: bool) -> int:
        per = self.saved_w + (self.held_w if held else 0)
        first = self.first_saved_w + (self.first_held_w if held else 0)
        return first + per * self.depth


@dataclass
class _Activations:
    pre_saved: int  # embedding output, rotary tables, ...
    pre_held: int
    stacks: list[_Stack]
    mid_saved: int  # T5: the encoder's final norm and the decoder's embedding
    mid_held: int
    final_saved: int  # the final norm
    final_held: int
    head: HeadMemory
    pre_w: int  # autocast weight copies among pre/mid/final (saved, held)
    pre_held_w: int
    mid_w: int
    mid_held_w: int
    final_w: int
    final_held_w: int
    tape: ForwardTape  # the symbolic forward, for the layers' backward
    gc_tape: ForwardTape | None  # the same without the KV cache, for checkpointing's recompute
    # Checkpointing: (the first layer's input if among `pre_saved`, where it is that layer's checkpoint input too;
    # whether an embedding op keeps it on the device when offloaded; the last layer's output, saved by the final norm)
    gc_stack_ends: tuple[int, bool, int] = (0, False, 0)


def _ctx(spec, settings) -> StepContext:
    wdt = DTYPE_TAG[settings.weights_dtype]
    ac = DTYPE_TAG.get(settings.autocast_dtype) if settings.autocast_dtype else None
    kbit_compute = None
    if settings.kbit_prepared:  # peft upcast what is not 4-bit to fp32; the 4-bit layers compute in half precision
        wdt, kbit_compute = "f32", DTYPE_TAG[settings.compute_dtype]
    elif settings.load_in_kbit and wdt == "f32":
        wdt = DTYPE_TAG[settings.compute_dtype]  # the base is built in the compute dtype (4-bit packing is applied later)
    attn = "eager" if settings.attn_implementation == "eager" else "sdpa"
    if getattr(family_of(spec), "EAGER_ATTENTION_ONLY", False):
        attn = "eager"  # transformers has no SDPA path for this family (Gemma-2: its logit soft-capping)
    flash_ok = True
    if settings.gpu is not None:
        from hf_memfit.hardware import find_gpu

        flash_ok = find_gpu(settings.gpu).compute_capability >= (8, 0)
    use_cache = getattr(family_of(spec), "USES_KV_CACHE", True) and not settings.gradient_checkpointing and \
        bool(spec.config.get("use_cache", True))
    # the rows the model sees: DPO's chosen + rejected, or one padding-free row (settings.rows / row_len)
    return StepContext(b=settings.rows, s=settings.row_len, wdt=wdt, ac=ac, cuda=settings.device == "cuda",
                attn=attn, full_ft=not settings.uses_lora, lora_r=(settings.lora_r or 8) if settings.uses_lora else None,
                lora_targets=lora_targets(spec, settings), use_cache=use_cache, flash_ok=flash_ok,
                checkpointing=settings.gradient_checkpointing, decoder_s=settings.decoder_seq_len,
                packed=settings.padding_free, kbit_compute=kbit_compute, unpacked_4bit=unpacked_4bit(spec), int8=settings.load_in_8bit)


def _stack_summary(f: ForwardTape, name: str, depth: int, carry: SymTensor, gc_f: ForwardTape | None) -> _Stack:
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


def _layer_backward(f: ForwardTape, scope: str, accumulate: bool, residual_grad: int,
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
    # A tiled op's input gradient is its gradient buffer: it replaces the output-sized one counted for every op.
    tiled = {pos: _tiled_backward(sub, sc, grad_buffer) - f.bytes_of(by_pos[pos])
             for pos, sc, sub, grad_buffer in f.tiled_backward if sc == scope}
    live -= frees.pop(end + 1, 0)  # saved by the next layer: freed in its backward
    live_w -= frees_w.pop(end + 1, 0)
    start_live, start_w = live, live_w
    cuda = f.ctx.cuda
    new = 0
    best = _LayerBackward(live, 0, residual_grad, 0, live_w)
    for pos in range(end, start - 1, -1):
        t = by_pos.get(pos)
        extra = f.backward_extra.get(pos, 0)
        x = f.norm_inputs.get(pos)
        if x is not None and t is not None and (x.base or x).last_use > pos:
            # An RMSNorm whose fp32 input is read again later (the residual stream): the engine sums the
            # product's piece (grad * rstd) into that input's waiting buffer before pow's backward runs.
            extra -= f.bytes_of(t)
        tmp = (residual_grad + (2 * f.bytes_of(t) if t is not None and t.rg and t.alloc else 0) + tiled.get(pos, 0)
               + extra)
        stepped = 0
        for numel, dtype, cast in grads_at.get(pos, ()):
            g = allocated_bytes(numel, DTYPE_BYTES[dtype], cuda)
            if cast and cast != dtype:
                tmp += allocated_bytes(numel, DTYPE_BYTES[cast], cuda)
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


def _tiled_backward(sub: ForwardTape, scope: str, grad_buffer: int) -> int:
    """The most a tiled op's backward adds (`ForwardTape.tiled`): its input's gradient buffer, plus one
    shard's recompute at its largest, the forward's saved and transient tensors or the shard's backward."""
    saved = sub.scope_bytes(scope, held=False)
    forward = saved + sub.live_peak(scope, keep_saved=True)
    back = _layer_backward(sub, scope, True, 0)
    return grad_buffer + max(forward, back.acts + back.grads + back.temp)


def _run_forward(spec, settings, ctx: StepContext) -> tuple[ForwardTape, dict]:
    """The symbolic forward: embedding, three layers per stack, the final norm. Returns the head input too."""
    f = ForwardTape(ctx)
    fam = family_of(spec).Forward(spec, settings, f)
    out = {}
    f.scope = "emb"
    x = out["input0"] = fam.embed()
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
    out["output_last"], out["head_in"] = x, fam.final(x)
    return f, out


def _activations(spec, settings) -> _Activations:
    ctx = _ctx(spec, settings)
    f, out = _run_forward(spec, settings, ctx)
    gc_f = None
    if settings.gradient_checkpointing:
        # the recompute inside backward runs the layer as an ordinary forward (no KV cache)
        gc_f, gc_out = _run_forward(spec, settings, ctx)
    head = head_memory(spec, settings, f.ctx, f, out["head_in"])  # f.ctx: the decoder's, for seq2seq
    stacks = [_stack_summary(f, "s0", spec.num_layers, out["carry0"], gc_f)]
    if spec.is_encoder_decoder:
        stacks.append(_stack_summary(f, "s1", spec.num_decoder_layers, out["carry1"], gc_f))
    for k, st in enumerate(stacks if gc_f is not None else ()):
        st.recompute_saves_input = gc_out[f"carry{k}"].saved  # the next layer's ops save this layer's output

    def part(scope):
        saved, every = f.scope_bytes(scope, held=False), f.scope_bytes(scope, held=True)
        saved_w, every_w = (f.scope_bytes(scope, held=False, weight_copies=True),
                            f.scope_bytes(scope, held=True, weight_copies=True))
        return saved, every - saved, saved_w, every_w - saved_w

    pre, mid, fin = part("emb"), part("mid"), part("final")
    x0, x1 = out["input0"], out["output_last"]
    saver = lambda t: f.tensors[t.first_save].scope if t.saved and (t.first_save or 0) < len(f.tensors) else None
    return _Activations(
        pre_saved=pre[0], pre_held=pre[1], stacks=stacks, mid_saved=mid[0], mid_held=mid[1],
        final_saved=fin[0], final_held=fin[1], head=head,
        pre_w=pre[2], pre_held_w=pre[3], mid_w=mid[2], mid_held_w=mid[3], final_w=fin[2], final_held_w=fin[3],
        tape=f, gc_tape=gc_f, gc_stack_ends=(f.bytes_of(x0) if x0.scope == "emb" and x0.saved else 0,
                                             saver(x0) == "emb", f.bytes_of(x1) if saver(x1) == "final" else 0),
    )


# --- The step: model states plus activations, region by region ---------------------------------


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
    params = parameters(spec, settings, ctx.wdt, ctx.kbit_compute)
    trainable = [p for p in params if p.trainable]
    W = sum(param_bytes(p, cuda) for p in params)
    if settings.reference == "copy":  # DPO's frozen reference model: the base model again, without adapters
        W += sum(param_bytes(p, cuda) for p in params if p.kind not in ("lora", "head_copy"))
    G = sum(param_bytes(p, cuda) for p in trainable)
    opt_tensors = optimizer_tensors(params, settings, spec)
    O = sum(optimizers.state_bytes(t, settings.optim, cuda, optim_args=settings.optim_args) for t in opt_tensors)
    opt_tmp = optimizers.tensors_step_temporary_bytes(opt_tensors, settings.optim, settings.device,
                                                      optim_args=settings.optim_args)
    acts = _activations(spec, settings)
    head = acts.head
    emb_grads = [param_bytes(p, cuda) for p in params if p.trainable and p.kind == "embedding"]
    gc = settings.gradient_checkpointing

    # Offloaded checkpoints (activation_checkpointing_kwargs={"offload": True}): each layer's saved
    # input is copied to pinned host memory in the forward and back for the layer's recompute.
    kept_inputs = 0 if settings.offload_activations or settings.activation_offloading else 1
    # TRL's activation_offloading (step_levers.TrlOffloadedActivations): every saved tensor of 1 KiB or more goes to
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
        first, by_emb, final_input = acts.gc_stack_ends if gc else (0, True, 0)
        pre_saved = acts.pre_saved - (first if kept_inputs or not by_emb else 0)
        below = (0 if trl_offload else pre_saved + acts.mid_saved) + sum(x for x, _ in stacks_saved)
        below_w = (0 if trl_offload else acts.pre_w + acts.mid_w) + sum(x for _, x in stacks_saved)
        saved = below + final_input + acts.final_saved + head.saved
        saved_w = below_w + acts.final_w + head.saved_w
        candidates[f"{tag}|bwd|pre"] = _row(W, g_live + head_g, O, saved + head.bwd_peak_acts + head_a,
                                            head.bwd_peak, saved_w + head.bwd_peak_w)
        # The final norm's backward, once the head's is done: with a fused head (Liger, TRL) that keeps
        # no logits it can be the larger (an RMSNorm's backward makes several hidden-sized fp32 temporaries).
        fb = _layer_backward(acts.tape, "final", bool(m), head.bwd_after)
        after_head = _row(W, g_live + head_g + fb.grads, O, below + final_input + fb.acts + head_a, fb.temp,
                          below_w + fb.acts_w)
        if sum(after_head.values()) > sum(candidates[f"{tag}|bwd|pre"].values()):
            candidates[f"{tag}|bwd|pre"] = after_head
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
            # The residual stream's gradient is one buffer: the engine sums each piece into it in place
            # (input_buffer.cpp `accumulate`; StorageTracker._engine_sums_in_place); the head's is gone by now.
            lb = _layer_backward(tape, f"{st.name}.L1", bool(m), st.carry, lw_layer_step)
            if gc:
                # Checkpointing keeps each layer's input. Backward first re-runs the layer's
                # forward (everything it saves, plus its output, beside the incoming grad),
                # then runs its backward; exact mode counts the recompute as temporary.
                recompute_end = max(lb.start + st.carry, tape.live_peak(f"{st.name}.L1", keep_saved=False,
                                                                         everything=True)) + st.carry + head.bwd_after
                inner, new_g = ((recompute_end, 0) if recompute_end >= lb.acts + lb.grads + lb.temp
                                else (lb.acts + lb.temp, lb.grads))
                kept = max(0, st.first_held)
                running = st.carry if kept_inputs or st.recompute_saves_input else 0
                top = below + kept + (st.depth * st.carry if kept_inputs else running)
                candidates[f"{tag}|bwd|{st.name}.first"] = _row(W, grads + new_g, O, top, inner + tied_tmp)
                candidates[f"{tag}|bwd|{st.name}.last"] = _row(
                    W, grads + (st.depth - 1) * lb.layer_grads + new_g, O, below + kept + running,
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
        quantizable_linear_params=quantizable(spec, settings)[0],
        largest_linear_numel=quantizable(spec, settings)[1],
        host_bytes=_offloaded_checkpoint_bytes(acts, settings) + _trl_host_bytes(acts, settings),
    )


def _layerwise_steps(trainable: list[ParamGroup], tensors: list, kinds: tuple[str, ...], settings) -> dict[int, int] | None:
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


def _layerwise_footprint(trainable: list[ParamGroup], tensors: list, kinds: tuple[str, ...], settings) -> tuple[int, int]:
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
            grad = allocated_bytes(p.numel, DTYPE_BYTES[p.dtype], cuda)
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
        sizes = (t.numel * DTYPE_BYTES[t.dtype] for t in tape.tensors if t.scope == scope and t.saved)
        return sum(pinned_host_bytes(n) for n in sizes if n >= TRL_MIN_OFFLOAD_BYTES)

    # the head's saved tensors are known only as a total here (TRL's fused head: the hidden states, two fp32
    # and one int64 per-token vector): taken without the power-of-two rounding of each
    host = scope_host("emb") + scope_host("mid") + scope_host("final") + acts.head.saved
    for st in acts.stacks:
        host += st.depth * (pinned_host_bytes(st.carry) if settings.gradient_checkpointing
                            else scope_host(f"{st.name}.L1"))
    return host


def _trl_kept_bytes(tape: ForwardTape, scope: str) -> int:
    """Bytes of `scope`'s tensors that TRL's offloading leaves on the GPU until backward: those saved by more
    than one op (the second save finds the storage already offloaded and in the stash, and keeps it), and
    those under `min_offload_size`."""
    return sum(tape.bytes_of(t) for t in tape.tensors if t.scope == scope and t.saved
               and (t.saves > 1 or t.numel * DTYPE_BYTES[t.dtype] < TRL_MIN_OFFLOAD_BYTES))


def _trl_forward_stash(st: _Stack, tape: ForwardTape, gc: bool) -> int:
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


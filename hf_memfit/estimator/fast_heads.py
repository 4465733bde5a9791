"""Fast mode's head and loss: the logits, their fp32 upcast and gradient, and the fused heads that avoid them.

`head_memory` picks the head the step runs: transformers' own (full logits, `ForCausalLMLoss`), Liger's
fused linear cross-entropy, or TRL's chunked log-prob head. Each is a short event sequence whose maxima
are taken exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_memfit.estimator.fast_params import family_of
from hf_memfit.models.forward import DTYPE_BYTES, ForwardTape, StepContext, SymTensor
from hf_memfit.optimizers import allocated_bytes


@dataclass
class HeadMemory:
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


def head_memory(spec, settings, ctx: StepContext, f: ForwardTape, head_in: SymTensor) -> HeadMemory:
    """The head and the loss, forward and backward, as short event sequences."""
    f.scope = "head"
    T, cuda = ctx.tokens, ctx.cuda
    width = spec.embedding_dim or spec.hidden_size  # OPT's word_embed_proj_dim after project_out
    nb = lambda numel, dt: allocated_bytes(numel, DTYPE_BYTES[dt], cuda)  # noqa: E731
    if settings.task == "seq-cls":
        # score / classifier on every position (decoder models) or on the pooled [CLS]
        # (BERT's pooler: dense + tanh + dropout): a few [b, labels] tensors.
        head_trainable = True  # fully trained, or peft's trainable copy (modules_to_save)
        logits = family_of(spec).Forward(spec, settings, f).seq_cls_logits(head_in, width, settings.num_labels,
                                                                          head_trainable)
        f.hold(logits)
        saved = f.scope_bytes("head", held=False)
        held = f.scope_bytes("head", held=True) - saved
        saved_w = f.scope_bytes("head", held=False, weight_copies=True)
        held_w = f.scope_bytes("head", held=True, weight_copies=True) - saved_w
        small = 4 * nb(ctx.b * settings.num_labels, "f32")
        grad_in = nb(T * width, head_in.dtype)
        return HeadMemory(saved, held, small, grad_in + small, 0, grad_in, saved_w, held_w)
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
    # CrossEntropyLoss gets fp32 from CPU autocast (cross_entropy runs in fp32) but the raw
    # logits' dtype without it. log_softmax saves its output; nll_loss makes a scalar.
    # CUDA autocast decomposes T5's cross_entropy instead (`fake_patches._cuda_cross_entropy`): log_softmax keeps
    # the logits' half dtype, and nll_loss gets, and saves, an fp32 copy of log_softmax's output.
    cuda_split = ctx.cuda and bool(ctx.ac) and settings.task != "causal-lm" and cdt != "f32"
    loss_dt = "f32" if (settings.task == "causal-lm" or ctx.ac) else cdt
    Lc, L4 = nb(L, cdt), nb(L, loss_dt)
    labels = 2 * nb(T + ctx.b, "i64")  # padded and shifted labels
    upcast = L4 if cdt != loss_dt else 0
    during_loss = (Lc if cuda_split else upcast) + L4 + labels
    # After the model returns, accelerate's convert_to_fp32 copies the logits under autocast.
    after_loss = (Lc if cuda_split else 0) + L4 + (nb(L, "f32") if ctx.ac else 0)
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
    if cuda_split:  # nll_loss's backward (its fp32 input saved), the cast of its grad, the half log_softmax's
        steps = [(Lc + L4, L4, 0), (Lc, L4 + Lc, 0), (Lc, 2 * Lc, 0)]
        cur = Lc
    else:
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
    return HeadMemory(saved, held, fwd_extra, bwd_peak, grad_w, hidden_grad, saved_w, held_w, peak_w, acts_extra)


def _liger_head(spec, settings, ctx: StepContext, f: ForwardTape, head_in: SymTensor, width: int, trainable: bool) -> HeadMemory:
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
    nb = lambda numel, dt: allocated_bytes(numel, DTYPE_BYTES[dt], ctx.cuda)  # noqa: E731
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
    return HeadMemory(saved=grad_input, held=held, fwd_extra=fwd_extra, bwd_peak=0, grad_bytes=grad_weight,
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


def _trl_fused_head(spec, settings, ctx: StepContext, head_in: SymTensor, width: int, head_trainable: bool) -> HeadMemory:
    """TRL's fused LM head and loss: per-token log-probs in tiles, never the logits.

    Forward: the shifted hidden states [N, H] (a copy; saved for backward), a
    scratch tile [min(N, 4096), 32768] in the compute dtype, seven fp32 running
    statistics per token, and on the CPU the torch fold's tile temporaries.
    Backward: the tile again, fp32 accumulators for the hidden-state and (when
    trained) the head-weight gradients, and the fold's temporaries.
    """
    cuda = ctx.cuda
    nb = lambda numel, dt: allocated_bytes(numel, DTYPE_BYTES[dt], cuda)  # noqa: E731
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
    return HeadMemory(saved, held, fwd_extra, bwd_peak, grad_w, hidden_grad)

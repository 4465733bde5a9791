"""ALST's TiledMLP on the fast mode's forward tape (`FamilyForward` calls `tiled_mlp`).

`estimator/step_levers.tile_mlps` installs the real one (DeepSpeed's `TiledMLP`) for exact mode and
the CPU measurement; this module writes what it does to memory in `ForwardTape` terms, and
`estimator/fast.py` replays its backward.
"""

from __future__ import annotations

from dataclasses import replace

# `ForwardTape`, `StepContext` and `SymTensor` are models/forward.py's; named in annotations only (no import:
# forward.py calls this module).


def tiled_mlp_shards(tokens: int, hidden_size: int) -> int:
    """How many sequence shards TiledMLP computes a layer's MLP in: about `hidden_size` tokens each.

    ALST's rule (arXiv 2506.13996 section 3.2; DeepSpeed's `TiledMLP` docstring,
    `num_shards = math.ceil(seqlen / hidden)`): the shard's intermediate activations are then
    no larger than a hidden state of `hidden_size` tokens times the MLP's expansion.
    """
    return max(1, -(-tokens // hidden_size))


def tiled(tape: ForwardTape, run, x: SymTensor, rows: int, seq: int, out_width: int, shards: int,
          recompute: StepContext) -> SymTensor:
    """DeepSpeed's `TiledMLP` (ALST) around `run(tape, x)`; `estimator/step_levers.tile_mlps` runs the real one.

    Forward: it saves `x` and runs `run` on `torch.chunk(x, shards, dim=-2)` under no_grad,
    one shard's intermediates alive at a time beside the outputs of the shards before it,
    then concatenates the outputs. Its backward (replayed in `estimator/fast.py`) makes a
    zero gradient the size of `x`, then recomputes each shard with grad and backpropagates
    it; autocast is not active in backward, so the recompute runs in `recompute`'s dtypes.
    """
    tape.save(x)
    shard_seq = -(-seq // shards)
    width = x.numel // (rows * seq)
    shard = tape.view(x, rows * shard_seq * width)
    before = tape.new(0, x.dtype, False)  # the outputs of the other shards, sized below
    tape.no_grad = True
    try:
        out = run(tape, shard)
    finally:
        tape.no_grad = False
    before.numel, before.dtype = rows * (seq - shard_seq) * out_width, out.dtype
    full = tape.new(rows * seq * out_width, out.dtype, True, inputs=(before, out))
    sub = type(tape)(recompute)
    sub.scope = tape.scope
    run(sub, sub.new(shard.numel, x.dtype, x.rg))
    for _, _, numel, dtype, _ in sub.grad_events:  # the weights' gradients, made in the recompute
        tape.grad_events.append((full.idx, tape.scope, numel, dtype, None))
    tape.tiled_backward.append((full.idx, tape.scope, sub, tape.bytes_of(x)))
    return full


def tiled_mlp(fam, mlp, x: SymTensor) -> SymTensor:
    """A family's `_mlp` (`mlp`, unbound) under ALST's TiledMLP: shards of about `hidden_size` tokens (`tiled`)."""
    main = fam.f

    def run(tape: ForwardTape, shard: SymTensor) -> SymTensor:
        fam.f, fam.ctx = tape, tape.ctx
        try:
            return mlp(fam, shard)
        finally:
            fam.f, fam.ctx = main, main.ctx

    ctx = main.ctx
    recompute = replace(ctx, ac=None, wdt=ctx.wdt)  # backward runs without autocast
    return tiled(main, run, x, ctx.b, ctx.s, fam.h, tiled_mlp_shards(ctx.s, fam.h), recompute)

"""Sequence parallelism: Ulysses (DeepSpeed ALST) and context parallelism (torch ring attention), per rank.

Ulysses (Jacobs et al. 2023, arXiv 2309.14509; ALST, arXiv 2506.13996; DeepSpeed 0.19
`runtime/sequence_parallel/ulysses_sp.py`, run by accelerate 1.15 as `ParallelismConfig(sp_size,
sp_backend="deepspeed")`): each of sp ranks holds 1/sp of every sequence. Everything outside attention
(embeddings, projections, MLP, norms, the head and the loss on the local shard, what checkpointing keeps)
runs on s/sp tokens. `UlyssesSPAttentionHF` exchanges q, k and v by all-to-all so that attention runs over
the full sequence with h/sp heads, and sends the output back the same way. What one rank holds:
- the step at s/sp tokens: both modes trace or compute exactly that (`local_step_settings`);
- model states over the whole world: ZeRO partitions over DeepSpeed's sequence-data-parallel group,
  dp x sp (`engine.py`: `dp_process_group=self.seq_data_parallel_group`), which `sharding.shard` already
  does over `world_size`;
- the all-to-all buffers around attention (`ulysses_terms`): while a layer's attention runs, the caller
  still holds its local q, k, v (`LlamaAttention.forward` keeps `query_states` ...), and the wrapper holds
  the gathered ones, [b, h/sp, s, d]: as many elements as the local ones, or more for k and v when sp > KV
  heads (DeepSpeed repeats them to one head per rank). The exchange of one tensor keeps two buffers of its
  size at once (the contiguous send buffer and `_dim_zero_all_to_all`'s output). The backward runs the
  same exchanges in reverse, with the gradients;
- the attention kernels' own memory: flash / memory-efficient SDPA keep out, logsumexp and (backward)
  dq_accum, all (b, h/sp, s) = (b, h, s/sp) elements: the local step's amount. Ulysses drops the mask
  (`uattn_wrapper`), so the kernel is flash on GPUs that have it. accelerate refuses eager attention,
  whose s x s scores would be sp times the local step's.

Context parallelism (torch 2.13 `distributed/tensor/experimental/_context_parallel/_attention.py`, as
accelerate 1.15 `_prepare_cp` sets it: `set_rotate_method("allgather")` by default): each of cp ranks
keeps q for its s/cp tokens (two chunks under the default load balancing) and all heads. What is added
to the local step (`ring_terms`):
- forward: k and v made contiguous and concatenated into one send buffer, the all-gathered K and V of the
  whole sequence (cp x the local k + v), and the partial outputs merged in fp32 (`_SDPAMerger`,
  `convert_to_f32=True`): out and logsumexp;
- backward: the K and V all-gathered again, fp32 accumulators for dq, dk, dv (`accum_dtype`), and the
  dk/dv exchange buffer (`_RotateMethod.ALL_TO_ALL`), fp32;
- model states: FSDP2 shards over dp_shard x cp, the whole world (`dp_shard_cp` mesh).
Nothing else differs from the local step: the ring's saved tensors are the local q, k, v, out, lse.
"""

from dataclasses import replace

from hf_memfit.estimator.breakdown import StepMemory
from hf_memfit.settings import TrainSettings


def local_step_settings(settings: TrainSettings) -> TrainSettings:
    """The step one rank runs outside attention: the sequence cut to seq_len / (sp x cp)."""
    if settings.seq_shards == 1:
        return settings
    changes = dict(seq_len=settings.local_seq_len, sp_size=1, cp_size=1)
    if settings.decoder_seq_len is not None:
        changes["decoder_seq_len"] = settings.decoder_seq_len // settings.seq_shards
    return settings.replace(**changes)


def _layer_region(region: str) -> bool:
    """Regions inside a stack's layers (forward or backward), where attention runs: not pre / post / opt."""
    parts = region.split("|")
    return len(parts) == 3 and parts[1] in ("fwd", "bwd") and parts[2].startswith("s") and not parts[2].endswith(".post")


def _attention_shapes(spec, settings: TrainSettings) -> tuple[int, int, int]:
    """(q bytes, one of k / v bytes as gathered, k bytes locally) for one layer on one rank, in the compute dtype."""
    dtype = 4 if settings.compute_dtype == "float32" else 2
    tokens = settings.rows * settings.local_seq_len
    q = tokens * spec.num_attention_heads * spec.head_dim * dtype
    k_local = tokens * spec.num_key_value_heads * spec.head_dim * dtype
    return q, k_local, dtype


def ulysses_terms(spec, settings: TrainSettings) -> dict[str, int]:
    """Bytes Ulysses adds to one layer's attention, forward and backward (see the module docstring)."""
    q, k_local, _ = _attention_shapes(spec, settings)
    sp = settings.sp_size
    # k / v after the exchange: kv/sp heads over the whole sequence, or one head each when sp > kv heads
    k_gathered = k_local * max(spec.num_key_value_heads, sp) // spec.num_key_value_heads
    gathered = q + 2 * k_gathered  # the wrapper's q, k, v beside the caller's local ones
    exchange = 2 * q  # one tensor's send buffer and its all-to-all output
    # saved for backward beyond the local step: the repeated k and v, when sp > KV heads
    saved = 2 * (k_gathered - k_local)
    return {"forward": gathered + exchange, "backward": gathered + exchange, "saved_per_layer": saved}


def ring_terms(spec, settings: TrainSettings) -> dict[str, int]:
    """Bytes torch's context-parallel SDPA (all-gather rotation) adds to one layer's attention."""
    q, k_local, dtype = _attention_shapes(spec, settings)
    cp = settings.cp_size
    kv = 2 * k_local
    fp32 = 4 / dtype
    forward = kv + kv + cp * kv + int(fp32 * q) + q  # contiguous k/v, send buffer, gathered K/V, fp32 merger out, a chunk's out
    backward = cp * kv + int(fp32 * (q + kv)) + int(fp32 * kv)  # gathered K/V, fp32 dq/dk/dv, dk/dv exchange
    return {"forward": forward, "backward": backward, "saved_per_layer": 0}


def with_sequence_terms(spec, settings: TrainSettings, step: StepMemory) -> StepMemory:
    """The local step plus what sequence parallelism adds at each layer region (temporaries and saved k/v)."""
    if settings.seq_shards == 1:
        return step
    terms = ulysses_terms(spec, settings) if settings.sp_size > 1 else ring_terms(spec, settings)
    # DeepSpeed reduces gradients in `seq_parallel_communication_data_type` under SP, fp32 by default
    # (runtime/constants.py, engine.py `communication_data_type`): a half-precision reduce bucket ("auto" = h^2
    # elements, deepspeed.py) is copied to fp32 and reduced in a second fp32 buffer (ALST's USAGE.md).
    half = settings.compute_dtype != "float32"
    reduce_fp32 = 2 * 4 * spec.hidden_size * spec.hidden_size if settings.sp_size > 1 and half else 0
    layers = spec.num_layers + (spec.num_decoder_layers or 0)
    saved_layers = 1 if settings.gradient_checkpointing else layers
    candidates = {}
    for region, row in step.candidates.items():
        row = dict(row)
        if _layer_region(region):
            phase = region.split("|")[1]
            row["temporary"] += terms["forward"] if phase == "fwd" else terms["backward"] + reduce_fp32
            row["activations"] += terms["saved_per_layer"] * saved_layers
        candidates[region] = row
    if settings.sp_size > 1:
        note = (f"Ulysses SP over {settings.sp_size} ranks: the step runs on {settings.local_seq_len} of "
                f"{settings.seq_len} tokens per row; attention runs on the full sequence with "
                f"{spec.num_attention_heads // settings.sp_size} of {spec.num_attention_heads} heads; its all-to-all "
                f"buffers add {terms['forward'] / 2**20:.1f} MiB at a layer's attention (modelled by formula)")
    else:
        note = (f"context parallelism over {settings.cp_size} ranks: the step runs on {settings.local_seq_len} of "
                f"{settings.seq_len} tokens per row; ring attention's all-gathered K/V and fp32 merge buffers add "
                f"{terms['forward'] / 2**20:.1f} MiB forward, {terms['backward'] / 2**20:.1f} MiB backward at a "
                "layer's attention (modelled by formula)")
    return replace(step, candidates=candidates, notes=list(step.notes) + [note])

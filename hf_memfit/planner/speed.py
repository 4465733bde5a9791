"""The speed model: a relative step time for each candidate, so the planner can rank what fits.

Compute from FLOPs and a utilisation curve in the tokens per micro-batch, the optimizer step, and the
communication and offload traffic of the layout; on the CPU, constants measured by
`benchmarks/planner.py --calibrate`. Only relative costs matter for the ranking.
"""


from hf_memfit.estimator.assemble import MemoryEstimate
from hf_memfit.models.spec import ModelSpec
from hf_memfit.settings import TrainSettings

# --- speed model constants (relative ranking, not wall-clock promises) -------
# Matmul efficiency grows with the tokens in a micro-batch (the M dimension of
# every GEMM); we model utilisation as t / (t + T_HALF). 512 tokens for half
# of peak is a planning figure in line with GEMM roofline curves on A100-class
# GPUs (cuBLAS reaches most of peak once M is in the low thousands).
TOKENS_FOR_HALF_UTILISATION = 512


# Each optimizer's step cost relative to fused AdamW on a GPU, and its throughput on the CPU, live with the
# rest of the optimizer model: `optimizers.Optimizer.gpu_step_factor` / `cpu_params_per_s`.
# Fused AdamW touches params, grads and two states, read and written: ~32 B/param (fp32).
ADAM_BYTES_MOVED_PER_PARAM = 32


# DeepSpeedCPUAdam updates roughly 1e9 parameters per second on a many-core
# host (ZeRO-Offload paper, Ren et al. 2021, Fig. 7 order of magnitude).
CPU_ADAM_PARAMS_PER_S = 1e9


# NVMe swap (ZeRO-Infinity): a few GB/s per drive (Rajbhandari et al. 2021).
NVME_BYTES_PER_S = 3e9


# Inter-node bandwidth per GPU when nothing better is known: 200 Gb/s InfiniBand.
INTER_NODE_BYTES_PER_S = 25e9


# Share of data-parallel communication hidden behind compute (bucketed overlap).
COMM_OVERLAP = 0.5


# --- CPU speed model (device="cpu") -------------------------------------------
# Measured with `python benchmarks/planner.py --calibrate` on a 2-core AMD EPYC VM (AVX-512), torch 2.13 CPU,
# 1 torch thread: microbenchmarks on plain tensors and a generic nn.TransformerEncoderLayer, none of them a model
# of the planner benchmark. Each figure is the median over 6-9 calibration runs of the best of each run's repeats
# (other jobs shared the CPU; they only add time). Only relative costs matter for the ranking. The GPU figures
# above do not carry over: see docs/benchmarks.md, "Planner choice vs real CPU runs".
# fp32 training FLOP rate of nn.TransformerEncoderLayer(256, 4 heads, FFN 1024, GELU, dropout 0.1), batch 8 x
# seq 128, forward + backward, FLOPs counted as `cpu_step_seconds` counts them: 45-67 GFLOP/s, median 58.5.
CPU_FLOPS_PER_S = 6e10


# Tokens per micro-batch at which a 256 -> 1024 -> 256 MLP block's forward + backward runs at half its best FLOP
# rate: least-squares fit of t / (t + T) over 16-4096 rows gave T = 14-26, median 22 (the GPU figure above is 512).
CPU_TOKENS_FOR_HALF_UTILISATION = 22


# That transformer layer under non-reentrant checkpointing (as `gradient_checkpointing_enable` wraps each block),
# timed interleaved with the plain layer: 1.48-1.54x its plain forward + backward time (1.39-1.57x over all runs).
# FLOPs alone say 8/6 = 1.33x; the recomputed dropout, softmax and norms cost more on a CPU than their FLOPs say.
CPU_CHECKPOINTED_LAYER_FACTOR = 1.5


def step_seconds(spec: ModelSpec, settings: TrainSettings, est: MemoryEstimate, gpu_info) -> float:
    """Predicted seconds per optimizer step: compute, optimizer, offload traffic and communication.

    A ranking model with documented constants, not a benchmark; FLOPs are
    counted by `micro_batch_flops`.
    """
    if settings.device == "cpu":
        return cpu_step_seconds(spec, settings, est)
    tflops = (gpu_info.matmul_tflops("bf16" if settings.precision.startswith("bf16") else
                                     "fp16" if settings.precision.startswith("fp16") else "tf32")
              if gpu_info else 100.0) * 1e12  # 100 TFLOP/s: a generic Ampere-class figure when no GPU is named
    hbm = gpu_info.hbm_bandwidth_bytes_per_s if gpu_info else 1.5e12
    pcie = gpu_info.pcie_bandwidth_bytes_per_s if gpu_info else 25e9
    nvlink = gpu_info.nvlink_bandwidth_bytes_per_s if gpu_info else 0.0
    params, trainable = est.total_params, est.trainable_params
    tokens_micro = settings.batch_size * settings.local_seq_len  # a sequence-parallel rank's share of each row
    micro_steps = settings.gradient_accumulation_steps
    flops = micro_batch_flops(spec, settings, est) / settings.seq_shards  # SP / CP split every FLOP evenly
    utilisation = tokens_micro / (tokens_micro + TOKENS_FOR_HALF_UTILISATION)
    compute = micro_steps * flops / (tflops * utilisation)

    optimizer = ADAM_BYTES_MOVED_PER_PARAM * trainable / hbm * settings.optimizer.gpu_step_factor
    world = settings.world_size
    w_bytes = 2 if settings.precision != "fp32" else 4
    if settings.offload_optimizer != "none" or settings.fsdp_offload:
        # Gradients down and updated weights up over PCIe; Adam on the host (DeepSpeedCPUAdam, or
        # torch's AdamW on FSDP's host shards).
        optimizer = 2 * w_bytes * trainable / world / pcie + trainable / world / CPU_ADAM_PARAMS_PER_S
        if settings.offload_optimizer == "nvme":
            optimizer += 16 * trainable / world / NVME_BYTES_PER_S  # fp32 master + states read and written
    offload_param = 0.0
    if settings.offload_param != "none":
        # Each micro-batch fetches every parameter for forward and again for backward.
        rate = pcie if settings.offload_param == "cpu" else min(pcie, NVME_BYTES_PER_S)
        offload_param = micro_steps * 2 * w_bytes * params / rate
    # Offloaded activation checkpoints: each micro-batch copies every layer's input to the host and back,
    # on the compute stream (transformers' save_on_cpu), so nothing overlaps them.
    offload_activations = micro_steps * 2 * offloaded_activation_bytes(spec, settings) / pcie
    if settings.activation_offloading:
        offload_activations += trl_offload_seconds(spec, settings, est, compute, pcie)
    if settings.fsdp_offload:
        # FSDP copies each rank's host shard in before every all-gather (forward and backward)
        # and each reduced gradient shard out.
        offload_param = micro_steps * 3 * w_bytes * params / world / pcie

    comm = 0.0
    if world > 1:
        link = nvlink or pcie
        if settings.num_nodes > 1:
            link = min(link, INTER_NODE_BYTES_PER_S)
        ring = (world - 1) / world
        grad_bytes = w_bytes * trainable
        if settings.fsdp == "shard_grad_op":
            # One all-gather per micro-batch (kept from forward to backward), reduce-scatter gradients.
            comm = micro_steps * (w_bytes * params + grad_bytes) * ring / link
        elif settings.fsdp == "no_shard":
            comm = micro_steps * 2 * grad_bytes * ring / link  # FSDP1 NO_SHARD all-reduces every micro-batch
        elif settings.zero_stage == 3 or settings.fsdp is not None:
            # All-gather parameters for forward and backward, reduce-scatter gradients, every micro-batch.
            comm = micro_steps * (2 * w_bytes * params + grad_bytes) * ring / link
        elif settings.zero_stage in (1, 2):
            comm = (micro_steps * grad_bytes + w_bytes * trainable) * ring / link
        else:
            comm = 2 * grad_bytes * ring / link  # DDP all-reduce once per optimizer step (no_sync while accumulating)
        comm *= 1 - COMM_OVERLAP
    # The sequence exchange sits between attention and the projections around it: nothing hides it.
    comm += micro_steps * sequence_exchange_bytes(spec, settings) / sequence_link_bytes_per_s(settings, gpu_info)
    return compute + optimizer + offload_param + offload_activations + comm


def sequence_link_bytes_per_s(settings: TrainSettings, gpu_info) -> float:
    """The link a sequence-parallel group talks over: NVLink (else PCIe) within a node, InfiniBand across nodes.

    Bandwidths per GPU, unidirectional: the GPU table's NVLink and PCIe figures (hardware.py, vendor
    datasheets) and INTER_NODE_BYTES_PER_S (200 Gb/s InfiniBand per GPU). A group spans nodes when it is
    larger than one node's GPUs (accelerate and DeepSpeed place consecutive ranks in one group).
    """
    pcie = gpu_info.pcie_bandwidth_bytes_per_s if gpu_info else 25e9
    link = (gpu_info.nvlink_bandwidth_bytes_per_s if gpu_info else 0.0) or pcie
    if settings.seq_shards > settings.num_gpus:
        link = min(link, INTER_NODE_BYTES_PER_S)
    return link


def sequence_exchange_bytes(spec: ModelSpec, settings: TrainSettings) -> float:
    """Bytes one rank sends per micro-batch to split its sequences (0 without SP / CP).

    Ulysses (DeepSpeed `UlyssesSPAttentionHF`): per layer, four all-to-alls forward (q, k, v in, the output
    back) and four in backward (their gradients), each sending (sp - 1) / sp of the local tensor; checkpointing
    re-runs the forward's four. Context parallelism (torch ring attention, all-gather rotation): per layer the
    forward all-gathers K and V ((cp - 1) x the local k + v received), and the backward gathers them again and
    exchanges the fp32 dK / dV.
    """
    if settings.seq_shards == 1:
        return 0.0
    dtype = 4 if settings.compute_dtype == "float32" else 2
    tokens = settings.rows * settings.local_seq_len
    q = tokens * spec.num_attention_heads * spec.head_dim * dtype
    kv = 2 * tokens * spec.num_key_value_heads * spec.head_dim * dtype
    layers = spec.num_layers + (spec.num_decoder_layers or 0)
    if settings.sp_size > 1:
        sp = settings.sp_size
        kv_sent = kv * max(spec.num_key_value_heads, sp) / spec.num_key_value_heads  # repeated when sp > KV heads
        forwards = 2 if settings.gradient_checkpointing else 1
        return layers * (forwards + 1) * (2 * q + kv_sent) * (sp - 1) / sp
    cp = settings.cp_size
    forwards = 2 if settings.gradient_checkpointing else 1
    return layers * ((forwards + 1) * (cp - 1) * kv + 2 * kv * (cp - 1) / cp)


def trl_offload_seconds(spec: ModelSpec, settings: TrainSettings, est: MemoryEstimate, compute: float,
                        pcie: float) -> float:
    """PCIe time TRL's `activation_offloading` adds to a step (trl/models/activation_offloading.py, TRL 1.16).

    Every offloaded tensor crosses PCIe twice per micro-batch: its pinned host copy (the estimate's host
    bytes, when nothing else is offloaded) out in the forward and back in backward. Forward copies run on
    TRL's side stream while the forward computes (the stash keeps five tensors alive for them): only what
    exceeds the forward's compute, taken as a third of the step's (2 of 6 FLOPs per weight and token), costs.
    In backward a node's tensors are fetched when the node starts and the compute stream waits for them: no
    overlap is assumed. A planning figure, not a GPU measurement.
    """
    host = est.cpu_bytes
    if settings.offload_optimizer != "none" or settings.offload_param != "none" or settings.fsdp_offload:
        # the host figure holds the ZeRO / FSDP shards too: count the layers' hidden states only
        host = offloaded_activation_bytes(spec, settings.replace(offload_activations=True))
    one_way = settings.gradient_accumulation_steps * host / pcie
    return max(0.0, one_way - compute / 3) + one_way


def offloaded_activation_bytes(spec: ModelSpec, settings: TrainSettings) -> int:
    """Bytes of checkpoint inputs one micro-batch offloads: one hidden state per checkpointed layer."""
    if not settings.offload_activations:
        return 0
    layers = spec.num_layers + (spec.num_decoder_layers or 0)
    act_bytes = 4 if settings.weights_dtype == "float32" else 2  # the residual stream stays fp32 under autocast
    return layers * settings.batch_size * settings.seq_len * spec.hidden_size * act_bytes


def micro_batch_flops(spec: ModelSpec, settings: TrainSettings, est: MemoryEstimate,
                       checkpointed_layer_factor: float | None = None) -> float:
    """FLOPs of one micro-batch's forward and backward: the matmuls only.

    Kaplan et al. 2020: 2 per weight per token forward, 4 backward (2 when the
    weights are frozen, as with LoRA: only input gradients), plus attention. Only
    linear modules count (the tied LM head included): embedding lookups cost no
    FLOPs, which matters for models whose parameters are mostly a vocabulary
    table (BERT). Checkpointing re-runs the repeated layers, not the head: by
    default one more forward of them (6 -> 8 FLOPs per weight per token, +33%,
    for a full fine-tune; 4 -> 6 with frozen weights); the CPU passes its
    measured factor. A frozen tower at the input (`models/freezable.py`: a VLM's vision tower, Whisper's
    encoder) runs its forward only: nothing before it needs a gradient, so autograd runs none of its
    backward and checkpointing recomputes none of it. Its linear weights are counted so; other frozen
    modules are timed as trained.
    """
    linears = spec.linear_modules(settings.task, settings.num_labels)
    layer_params = sum(m.weight_numel * m.count for m in linears if m.scope == "layer")
    other_params = sum(m.weight_numel * m.count for m in linears if m.scope != "layer")
    frozen_towers = min(layer_params, frozen_tower_linear_params(spec, settings))
    layer_params -= frozen_towers
    backward = 4 if est.trainable_params >= 0.5 * est.total_params else 2
    tokens_micro = settings.batch_size * settings.seq_len
    layers = spec.num_layers + (spec.num_decoder_layers or 0)
    attention = 12 * layers * spec.hidden_size * settings.seq_len  # per token, fwd+bwd (Kaplan)
    layer_flops = ((2 + backward) * layer_params + attention) * tokens_micro
    if settings.gradient_checkpointing:
        layer_flops *= checkpointed_layer_factor or (4 + backward) / (2 + backward)
    layer_flops += 2 * frozen_towers * tokens_micro
    if settings.tiled_mlp:
        # ALST's TiledMLP runs each MLP's forward once more: under no_grad in forward, then again with grad
        # in backward (DeepSpeed ulysses_sp.TiledMLP: "the forward occurs twice each iteration").
        attention_params = spec.hidden_size * spec.head_dim * 2 * (spec.num_attention_heads + spec.num_key_value_heads)
        mlp_params = max(0, layer_params - layers * attention_params)
        layer_flops += 2 * mlp_params * tokens_micro
    return layer_flops + (2 + backward) * other_params * tokens_micro


def frozen_tower_linear_params(spec: ModelSpec, settings: TrainSettings) -> int:
    """Linear weights of the input-side towers `settings` freezes (0 when it freezes none)."""
    if not settings.frozen:
        return 0
    return sum(m["linear_params"] for m in spec.freezable_modules(settings.task, settings.num_labels)
               if m["module"] in settings.frozen)


def cpu_step_seconds(spec: ModelSpec, settings: TrainSettings, est: MemoryEstimate) -> float:
    """`step_seconds` for device="cpu": one process, measured CPU constants (above).

    The optimizer step costs trainable parameters / the optimizer's measured
    throughput, which on the CPU separates 8-bit AdamW from fused AdamW by ~25x.
    """
    tokens_micro = settings.batch_size * settings.local_seq_len
    flops = micro_batch_flops(spec, settings, est, checkpointed_layer_factor=CPU_CHECKPOINTED_LAYER_FACTOR) / settings.seq_shards
    utilisation = tokens_micro / (tokens_micro + CPU_TOKENS_FOR_HALF_UTILISATION)
    compute = settings.gradient_accumulation_steps * flops / (CPU_FLOPS_PER_S * utilisation)
    return compute + est.trainable_params / settings.optimizer.cpu_params_per_s


def ideal_seconds(spec: ModelSpec, settings: TrainSettings, est: MemoryEstimate, gpu_info) -> float:
    """The same step with one micro-batch, no checkpointing, no offload: the speed ceiling."""
    ideal = settings.replace(batch_size=settings.batch_size * settings.gradient_accumulation_steps,
                             gradient_accumulation_steps=1, gradient_checkpointing=False,
                             optim="adamw_torch_fused" if settings.optimizer_family != "sgd" else settings.optim,
                             zero_stage=0 if settings.world_size == 1 else settings.zero_stage,
                             offload_optimizer="none", offload_param="none", fsdp_offload=False)
    return step_seconds(spec, ideal, est, gpu_info)

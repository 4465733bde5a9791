"""Model states across devices: DDP, DeepSpeed ZeRO-1/2/3, PyTorch FSDP (1 and 2), offload, 4-bit, paging.

Both estimator modes measure one process with no sharding. This module turns
each single-device peak candidate into what a rank holds under the chosen
parallelism. Activations and temporaries of the forward and backward do not
change with data parallelism; model states (weights, gradients, optimizer)
do. Sources: DeepSpeed `runtime/zero/config.py`, `stage_1_and_2.py`,
`stage3.py` and the ZeRO papers, as gathered in `shared/CUDA_MEMORY_FACTS.md`;
for FSDP, torch 2.13 `distributed/fsdp/_fully_shard/` (FSDP2) and
`_flat_param.py` / `_runtime_utils.py` (FSDP1), as accelerate 1.15 configures them.
"""

from dataclasses import dataclass, field

from hf_memfit.estimator.breakdown import StepMemory, is_optimizer_region
from hf_memfit.estimator.int8 import pack_8bit
from hf_memfit.settings import TrainSettings
from hf_memfit.units import format_count

# bitsandbytes NF4 with double quantisation (the QLoRA recipe): 4-bit codes,
# an 8-bit absmax per 64 weights and an fp32 absmax per 256 of those.
QLORA_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
# Without double quantisation: an fp32 absmax per 64 weights (bitsandbytes blocksize 64).
NF4_BYTES_PER_PARAM = 0.5 + 4 / 64
# FSDP keeps at most two units' parameters gathered: the one computing and the one prefetched (FSDP2
# prefetches one unit ahead in forward and backward; FSDP1's rate limiter, limit_all_gathers=True, allows
# two in-flight all-gathers). torch docs, "FSDP2" / FullyShardedDataParallel(limit_all_gathers).
FSDP_GATHERED_UNITS = 2
NCCL_BYTES_PER_COMMUNICATOR = int(0.6 * 1024**3)  # 0.5-0.7 GB per communicator on A100 (nccl#964)
# zero_optimization.sub_group_size: DeepSpeed's default, and what deepspeed.py writes for ZeRO-3.
SUB_GROUP_SIZE = 1_000_000_000


@dataclass
class RankMemory:
    """One rank's peak candidates on the device, and what lives off it."""

    candidates: dict[str, dict[str, int]]
    cpu_bytes: int = 0
    nvme_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    outside_allocator_bytes: int = 0  # NCCL buffers: counted by nvidia-smi, not by torch
    # Per region: bytes the caching allocator holds for the collectives' own streams beyond what is
    # live there (blocks are not reused across streams: c10/cuda/CUDACachingAllocator.cpp keys free
    # blocks by stream). Reserved, not allocated.
    stream_cached: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class WrapUnits:
    """How FSDP's transformer auto-wrap splits the model: one unit per repeated layer, the rest in the root.

    accelerate's TRANSFORMER_BASED_WRAP wraps each `_no_split_modules` layer, then the whole model
    (the root unit: embeddings, final norm, head).
    """

    num_layers: int
    layer_params: int  # the largest layer unit's parameters
    layer_trainable: int
    layer_quantizable: int  # its Linear weights, packed to 4 bits under --load-in-4bit
    root_params: int
    root_trainable: int


def wrap_units(spec, settings: TrainSettings, step: StepMemory) -> WrapUnits:
    """The FSDP units of `spec` under `settings` (LoRA adapters spread over the layers they live in)."""
    counts = spec.parameter_count(settings.task, settings.num_labels)
    layers = spec.num_layers + (spec.num_decoder_layers or 0)
    layer = max(counts.get("per_encoder_layer", 0), counts.get("per_decoder_layer", 0), counts["per_layer"])
    adapters = max(0, step.total_params - counts["total"])  # LoRA's A and B, inside the layers
    layer += -(-adapters // layers)
    root = max(0, step.total_params - counts["layers"] - adapters)
    quantizable = 0
    if settings.load_in_4bit:
        quantizable = sum(m.weight_numel * m.count for m in spec.linear_modules(settings.task, settings.num_labels)
                          if m.scope == "layer" and m.packed) // layers
    if settings.uses_lora:
        trainable_layer, trainable_root = -(-step.trainable_params // layers), 0
    else:
        trainable_layer, trainable_root = layer, root
    return WrapUnits(layers, layer, trainable_layer, quantizable, root, trainable_root)


def shard(step: StepMemory, settings: TrainSettings, hidden_size: int, units: WrapUnits | None = None) -> RankMemory:
    """Apply 4-bit packing, paging, and the data-parallel layout to every candidate.

    `units` (from `wrap_units`) is needed for FSDP layouts.
    """
    candidates = {region: dict(b) for region, b in step.candidates.items()}
    rank = RankMemory(candidates)
    if step.host_bytes:
        # Offloaded activation checkpoints: pinned host memory, one micro-batch's worth.
        rank.cpu_bytes += step.host_bytes
        rank.notes.append(f"activation checkpoints offloaded to pinned host memory: {step.host_bytes / 2**20:.0f} MiB")
    if settings.load_in_4bit:
        _pack_4bit(rank, step, settings)
    elif settings.load_in_8bit:
        pack_8bit(rank, step, settings, hidden_size)
    if settings.optim.startswith("paged_") and settings.device == "cuda":  # the CPU falls back to non-paged
        # Paged optimizers keep their states in CUDA managed memory, outside
        # torch's counters, and the driver pages them to the host under
        # pressure (bitsandbytes paged optimizers). Count them as host memory.
        optimizer = max(b["optimizer"] for b in candidates.values())
        for b in candidates.values():
            b["optimizer"] = 0
        rank.cpu_bytes += optimizer
        rank.notes.append("paged optimizer states live in CUDA managed memory and are paged to the host under pressure")
    dp = settings.world_size
    if settings.fsdp is not None:
        if units is None:
            raise ValueError("FSDP layouts need the model's wrap units (sharding.wrap_units)")
        _fsdp(rank, step, settings, units)
    elif settings.zero_stage == 0:
        if dp > 1:
            # DDP's reducer keeps gradient buckets: one more copy of the trainable
            # gradients (gradient_as_bucket_view=False, the torch and accelerate default).
            grad_bytes = max(b["gradients"] for b in candidates.values())
            for b in candidates.values():
                b["overhead"] += grad_bytes
    else:
        _zero(rank, step, settings, hidden_size)
    if dp > 1 and settings.device == "cuda":
        communicators = 1 if settings.num_nodes == 1 else 2  # intra- and inter-node rings
        rank.outside_allocator_bytes += communicators * NCCL_BYTES_PER_COMMUNICATOR
    return rank


def packed_4bit_bytes_per_param(settings: TrainSettings) -> float:
    """Bytes per 4-bit weight, its quantisation constants included."""
    return QLORA_BYTES_PER_PARAM if settings.bnb_4bit_use_double_quant else NF4_BYTES_PER_PARAM


def _quant_state_bytes(step: StepMemory, settings: TrainSettings) -> int:
    """The 4-bit quantisation constants (absmax, nested absmax): module state, never sharded."""
    return int(step.quantizable_linear_params * (packed_4bit_bytes_per_param(settings) - 0.5))


def _pack_4bit(rank: RankMemory, step: StepMemory, settings: TrainSettings) -> None:
    packed = packed_4bit_bytes_per_param(settings)
    saved = int(step.quantizable_linear_params * (settings.kbit_stand_in_bytes - packed))
    # bitsandbytes dequantises one weight at a time to the compute dtype for its matmul.
    dequant = 2 * step.largest_linear_numel
    for b in rank.candidates.values():
        b["weights"] = max(0, b["weights"] - saved)
        b["temporary"] += dequant
    quant = "with double quantisation" if settings.bnb_4bit_use_double_quant else "without double quantisation"
    storage = settings.bnb_4bit_quant_storage or (settings.compute_dtype if settings.shards_parameters else "uint8")
    linear = format_count(step.quantizable_linear_params)
    rank.notes.append(f"4-bit NF4 base {quant}: {packed:.3f} B/param for {linear} linear weights, stored as {storage}")
    if settings.kbit_prepared:
        unpacked = max(0, step.total_params - step.quantizable_linear_params - step.trainable_params)  # less adapters
        rank.notes.append(f"peft's prepare_model_for_kbit_training: the {format_count(unpacked)} parameters "
                          "bitsandbytes leaves unpacked (embeddings, LM head, norms; a mixture of experts' fused "
                          "experts too) upcast to fp32, so the residual stream is fp32 "
                          "(`--prepare-model-for-kbit-training no` if the script does not call it)")


def _zero(rank: RankMemory, step: StepMemory, settings: TrainSettings, hidden_size: int) -> None:
    """DeepSpeed ZeRO on `world_size` ranks, with the configs `deepspeed.py` writes (HF "auto" values).

    What one rank holds, read from DeepSpeed 0.19 (runtime/zero/stage_1_and_2.py, stage3.py):
    - the model in the compute dtype (the engine casts it and runs without autocast, so
      the step was traced in that dtype; see `estimator.traced_settings`): whole under
      ZeRO-1/2, a 1/dp partition plus the layers being gathered under ZeRO-3;
    - the optimizer over a flat fp32 master copy of the trainable partition (cloned even
      for an fp32 model): 4 B/param/dp plus the optimizer's state for a 1-D fp32 tensor;
      DeepSpeedCPUAdam (8 B/param) on the host when the optimizer is offloaded;
    - gradients: whole, in the model dtype, under ZeRO-1 (reduced at the boundary); a 1/dp
      partition under ZeRO-2 (`grads_in_partition`) and ZeRO-3 (`grad_partitions_flat_buffer`,
      in the model dtype since `grad_accum_dtype` defaults to it). With the optimizer offloaded
      they accumulate on the host (ZeRO-3 makes `self.device` the CPU; ZeRO-2 copies each
      reduced gradient out through `temp_grad_buffer_for_gpu_offload`, the largest parameter);
    - reduce buckets of `reduce_bucket_size` ("auto" = h^2) elements: two under ZeRO-1/2 with
      overlap_comm (`setup_buckets` double-buffers them), one under ZeRO-3;
    - at the step, without offload, the fp32 copy of the gradient partition (whole under
      ZeRO-1/2, one `sub_group_size` group at a time under ZeRO-3) and the wrapped optimizer's
      temporaries over that flat tensor (measured on real DeepSpeed: benchmarks/zero.py).
    """
    from hf_memfit.optimizers import flat_partition_state_bytes, step_temporary_bytes

    dp = settings.world_size
    stage = settings.zero_stage
    total, trainable = step.total_params, step.trainable_params
    w_bytes = 4 if settings.compute_dtype == "float32" else 2
    largest = step.largest_param_numel
    trainable_part = -(-trainable // dp)
    master = 4 * trainable_part  # fp32 master partition
    states = flat_partition_state_bytes(settings.optim, trainable_part)
    buckets = (2 if stage in (1, 2) else 1) * hidden_size * hidden_size * w_bytes

    partition = total * w_bytes // dp
    gathered = 0
    if settings.load_in_4bit:
        # The packed 4-bit base, stored in the compute dtype (`bnb_4bit_quant_storage`) so that ZeRO-3
        # partitions it like any parameter; its quantisation constants are module state, whole on every rank.
        weights = min(b["weights"] for b in rank.candidates.values())
        if stage == 3:
            quant = _quant_state_bytes(step, settings)
            partition = (weights - quant) // dp
            largest_packed = step.largest_linear_numel // 2  # 0.5 B per 4-bit weight
            gathered = 2 * (largest_packed + int(0.9 * hidden_size * hidden_size) * w_bytes)
            weights = partition + quant + gathered
    elif stage == 3:
        # The 1/dp partition, plus what is gathered at once: the module being computed and
        # the prefetch bucket ("auto" = 0.9 h^2), counted twice for the overlap of one
        # module's release with the next one's fetch. Parameters under the persistence
        # threshold ("auto" = 10 h elements: biases, norms) stay whole; they are negligible.
        gathered = 2 * (largest + int(0.9 * hidden_size * hidden_size)) * w_bytes
        weights = partition + gathered
    else:
        weights = total * w_bytes
    grads = trainable * w_bytes if stage == 1 else trainable_part * w_bytes  # where gradients exist
    optimizer = master + states
    # The step, one flat fp32 tensor at a time (the whole partition; ZeRO-3: one sub-group): its
    # fp32 gradient copy, and the wrapped optimizer's own temporaries on the path torch takes.
    flat = min(SUB_GROUP_SIZE, trainable_part) if stage == 3 else trainable_part
    step_temp = 4 * flat + step_temporary_bytes(settings.optim, flat, 4, largest_param_numel=flat,
                                                device=settings.device, one_flat_tensor=True)

    cpu = nvme = 0
    if settings.offload_optimizer != "none":
        # Host: fp32 master, CPU-Adam states, the fp32 gradient partition the step reads, and
        # the gradient accumulation buffer in the model dtype (about 18 B/param/dp for bf16).
        host_states = master + 8 * trainable_part
        host_grads = 4 * trainable_part + w_bytes * trainable_part
        if settings.offload_optimizer == "cpu":
            cpu += host_states + host_grads
        else:  # ZeRO-Infinity swaps master and states to NVMe; gradients stay in host memory
            nvme += host_states
            cpu += host_grads
        optimizer = 0
        grads = largest * w_bytes if stage < 3 else 0  # ZeRO-2's device staging buffer
        step_temp = largest * w_bytes  # one updated parameter copied back at a time
    if settings.offload_param != "none":
        if settings.offload_param == "cpu":
            cpu += partition
        else:
            nvme += partition
        weights -= partition

    for region, b in rank.candidates.items():
        b["weights"] = weights
        # ZeRO-3's flat gradient buffer is allocated at init. ZeRO-1/2 allocate their partition at
        # the first reduction in the backward, so it exists where the trace has gradients (layer
        # backward, later micro-batches).
        b["gradients"] = grads if stage == 3 or b["gradients"] else 0
        b["optimizer"] = optimizer
        b["overhead"] += buckets
        if is_optimizer_region(region):
            b["temporary"] = step_temp  # DeepSpeed's step replaces torch's step temporaries
            b["weights"] -= gathered  # ZeRO-3 gathers no layer for the step
            if stage < 3 and settings.offload_optimizer == "none":
                b["gradients"] = 0  # ZeRO-1/2 free the low-precision partition once its fp32 copy exists
    rank.cpu_bytes += cpu
    rank.nvme_bytes += nvme
    shards = {1: "optimizer states", 2: "optimizer states and gradients", 3: "optimizer states, gradients and parameters"}
    optimizer_text = ("DeepSpeedCPUAdam on the host" if settings.offload_optimizer != "none"
                      else f"fp32 master + {settings.optim} state on a flat fp32 partition")
    rank.notes.append(f"ZeRO-{stage} partitions {shards[stage]} over {dp} rank(s); {total - trainable:,} frozen "
                      f"params; optimizer: {optimizer_text}")


def _fsdp(rank: RankMemory, step: StepMemory, settings: TrainSettings, units: WrapUnits) -> None:
    """PyTorch FSDP as the Trainer runs it through accelerate (FSDP2 `fully_shard` by default, or FSDP1).

    What one rank holds, read from torch 2.13 (`distributed/fsdp/_fully_shard/`, FSDP1's
    `_flat_param.py` and `_runtime_utils.py`) and accelerate 1.15 (`FullyShardedDataParallelPlugin`):
    - parameters: a 1/dp shard of every unit, in the dtype the model was loaded in. There is no
      separate master copy: the sharded parameters are what the optimizer updates, so a bf16 model
      keeps bf16 shards and bf16 optimizer state, and a model loaded in fp32 for bf16-mixed keeps fp32
      ones. accelerate's mixed-precision policy sets param_dtype = reduce_dtype = the autocast dtype,
      so the gathered units are in the compute dtype: the root unit (embeddings, final norm, head) from
      its forward to the end of the backward (FSDP does not reshard the root after its forward), and
      FSDP_GATHERED_UNITS layer units (the one computing and the one prefetched). shard_grad_op
      (FSDP2 reshard_after_forward=False) keeps every layer gathered from its forward to its backward.
    - 4-bit (QLoRA): the packed weights, stored in the compute dtype, are sharded and gathered like any
      parameter (0.5 B per weight); their quantisation constants are module state, whole on every rank.
    - gradients: a 1/dp shard in the trainable parameters' dtype where the step has gradients; in the
      backward the computing unit's unsharded gradients and the root's (reduced when its backward
      ends), in the compute dtype. The reduce-scatter input and the all-gather output live in the
      collectives' own streams (see `stream_cached`).
    - the optimizer: torch's, over the shards: its state and its step temporaries are the single
      device's divided by dp.
    - no_shard (FSDP1): a whole replica per rank, gradients all-reduced in place per unit (no DDP
      bucket copy). hybrid_shard: sharded over one node's GPUs, replicated across nodes.
    - CPU offload (`CPUOffload(offload_params=True)` / `CPUOffloadPolicy`): the parameter, gradient and
      optimizer-state shards live on the host, where the optimizer steps.
    """
    dp = {"no_shard": 1, "hybrid_shard": settings.num_gpus}.get(settings.fsdp, settings.world_size)
    compute = 4 if settings.compute_dtype == "float32" else 2
    quant = _quant_state_bytes(step, settings) if settings.load_in_4bit else 0
    stored = min(b["weights"] for b in rank.candidates.values())  # the whole model, packed where 4-bit
    stored_per_param = (stored - quant) / max(1, step.total_params)
    shard = (stored - quant) // dp

    def unit_bytes(params: int, quantizable: int) -> int:
        return int(quantizable * 0.5 + (params - quantizable) * compute)

    layer = unit_bytes(units.layer_params, units.layer_quantizable)
    # Parameters are cast (gathered) for compute when they are sharded or stored wider than compute.
    gathers = dp > 1 or stored_per_param > compute + 0.01
    gathered_fwd_bwd = 0
    if gathers:
        layers_held = units.num_layers if settings.fsdp == "shard_grad_op" else FSDP_GATHERED_UNITS
        gathered_fwd_bwd = units.root_params * compute + layers_held * layer
    grad_full = max(b["gradients"] for b in rank.candidates.values())
    grad_shard = grad_full // dp
    # At most the root's and one layer's unsharded gradients, in the compute dtype, exist at once; the
    # step's own gradients (as traced) say how far the backward has got.
    unsharded_cap = (units.root_trainable + units.layer_trainable) * compute if gathers else 0
    to_compute = compute * step.trainable_params / grad_full if grad_full else 0.0
    optimizer_full = max(b["optimizer"] for b in rank.candidates.values())

    # On the CPU the "host" is the device: offloaded shards stay in the same memory, at the same times.
    offload = settings.fsdp_offload and settings.device == "cuda"
    cpu = 0
    if offload:
        cpu = shard + grad_shard + optimizer_full // dp
    for region, b in rank.candidates.items():
        phase = region.split("|")[1] if region.count("|") == 2 else ""
        in_model = phase in ("fwd", "bwd")
        b["weights"] = quant + (0 if offload else shard) + (gathered_fwd_bwd if in_model else 0)
        traced_grads = b["gradients"]
        if dp > 1 or offload:  # else a whole replica's gradients, as traced
            # sharded gradients appear unit by unit as the backward reduces them
            b["gradients"] = 0 if offload else traced_grads // dp
        if phase == "bwd":
            b["gradients"] += min(unsharded_cap, int(traced_grads * to_compute))
        b["optimizer"] = 0 if offload else b["optimizer"] // dp
        if is_optimizer_region(region):
            if offload:
                cpu_step = b["temporary"] // dp
                b["temporary"] = 0
                cpu = max(cpu, shard + grad_shard + optimizer_full // dp + cpu_step)
            else:
                b["temporary"] //= dp
    rank.cpu_bytes += cpu
    if gathers and settings.device == "cuda":
        # FSDP2 all-gathers into a flat buffer on its all-gather stream (two in flight) and copies out
        # to the parameters on the compute stream; both versions reduce-scatter from a flat copy of the
        # unit's gradients on their reduce-scatter stream (_fsdp_collectives.foreach_reduce; FSDP1's
        # post-backward stream). The caching allocator keeps those blocks for their streams.
        all_gather_pool = FSDP_GATHERED_UNITS * layer if settings.fsdp_version == 2 else 0
        reduce_scatter_pool = units.layer_trainable * compute
        pre_unshard_pool = _fsdp1_pre_unshard_pool(settings, units.root_params * compute, layer, dp,
                                                   staged=offload or stored_per_param > compute + 0.01)
        rank.stream_cached = {region: all_gather_pool + reduce_scatter_pool + pre_unshard_pool
                              for region in rank.candidates}
    strategy = {"full_shard": "parameters, gradients and optimizer states", "shard_grad_op":
                "parameters (whole from forward to backward), gradients and optimizer states",
                "hybrid_shard": f"parameters, gradients and optimizer states within each node ({dp} GPUs)",
                "no_shard": "nothing (a replica per rank)"}[settings.fsdp]
    rank.notes.append(f"FSDP{settings.fsdp_version} {settings.fsdp} shards {strategy} over {dp} rank(s); "
                      f"gathered in {settings.compute_dtype}: root unit {units.root_params:,} params + "
                      f"{'every layer' if settings.fsdp == 'shard_grad_op' else FSDP_GATHERED_UNITS} layer unit(s) "
                      f"of {units.layer_params:,}"
                      + ("; CPU offload: parameter, gradient and optimizer shards on the host" if settings.fsdp_offload else ""))


def _fsdp1_pre_unshard_pool(settings: TrainSettings, root: int, layer: int, dp: int, staged: bool) -> int:
    """Blocks FSDP1 keeps on its pre-unshard stream: each unit's shard, staged on the device to be all-gathered.

    FSDP1's `_unshard` (torch 2.13 `distributed/fsdp/_runtime_utils.py`) runs `FlatParamHandle.pre_unshard`
    on a separate pre-unshard stream. Under CPU offload it copies the unit's host shard to the device
    (`flat_param_to(self.device)`); with a mixed-precision param_dtype narrower than the stored shard it
    casts the shard into a fresh low-precision copy (`_use_low_precision_shard`). Either copy lives until
    the all-gather reading it ends (`_no_dispatch_record_stream` onto the unshard stream), and the caching
    allocator keeps its block in the pre-unshard stream's pool (free blocks are keyed by stream). In flight
    at once: the rate limiter's two all-gathers (`limit_all_gathers`) plus the copy `pre_unshard` makes
    before the limiter waits; the root's shard, made at the start of the forward, overlaps the first
    layer's. FSDP2 casts inside its all-gather copy-in (`_fsdp_collectives.foreach_all_gather`), which its
    all-gather pool covers, so this is FSDP1's alone.
    """
    if settings.fsdp_version != 1 or not staged or dp <= 1:
        return 0
    layer_shard, root_shard = layer // dp, root // dp  # `root`, `layer`: a unit's bytes in the compute dtype
    return max(root_shard + layer_shard, (FSDP_GATHERED_UNITS + 1) * layer_shard)

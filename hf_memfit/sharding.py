"""Model states across devices: DDP, DeepSpeed ZeRO-1/2/3 (FSDP full-shard ~ ZeRO-3), offload, 4-bit, paging.

Both estimator modes measure one process with no sharding. This module turns
each single-device peak candidate into what a rank holds under the chosen
parallelism. Activations and temporaries of the forward and backward do not
change with data parallelism; model states (weights, gradients, optimizer)
do. Sources: DeepSpeed `runtime/zero/config.py`, `stage_1_and_2.py`,
`stage3.py` and the ZeRO papers, as gathered in `shared/CUDA_MEMORY_FACTS.md`.
"""

from dataclasses import dataclass, field

from hf_memfit.breakdown import StepMemory, is_optimizer_region
from hf_memfit.settings import TrainSettings

# bitsandbytes NF4 with double quantisation (the QLoRA recipe): 4-bit codes,
# an 8-bit absmax per 64 weights and an fp32 absmax per 256 of those.
QLORA_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
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


def shard(step: StepMemory, settings: TrainSettings, hidden_size: int) -> RankMemory:
    """Apply 4-bit packing, paging, and the data-parallel layout to every candidate."""
    candidates = {region: dict(b) for region, b in step.candidates.items()}
    rank = RankMemory(candidates)
    if settings.load_in_4bit:
        _pack_4bit(rank, step, settings)
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
    if settings.zero_stage == 0:
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


def _pack_4bit(rank: RankMemory, step: StepMemory, settings: TrainSettings) -> None:
    traced_bytes = 4 if settings.weights_dtype == "float32" and not settings.autocast_dtype else 2
    saved = int(step.quantizable_linear_params * (traced_bytes - QLORA_BYTES_PER_PARAM))
    # bitsandbytes dequantises one weight at a time to the compute dtype for its matmul.
    dequant = 2 * step.largest_linear_numel
    for b in rank.candidates.values():
        b["weights"] = max(0, b["weights"] - saved)
        b["temporary"] += dequant
    rank.notes.append(f"4-bit NF4 base with double quantisation: {QLORA_BYTES_PER_PARAM:.3f} B/param for "
                      f"{step.quantizable_linear_params / 1e9:.2f}B linear weights")


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
    if settings.load_in_4bit:  # packed 4-bit base (never partitioned: validate() forbids ZeRO-3)
        weights = max(b["weights"] for b in rank.candidates.values())
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

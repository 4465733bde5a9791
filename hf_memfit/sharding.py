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
# A DeepSpeed "auto" bucket (transformers integrations/deepspeed.py) is hidden_size**2 elements.
NCCL_BYTES_PER_COMMUNICATOR = int(0.6 * 1024**3)  # 0.5-0.7 GB per communicator on A100 (nccl#964)


@dataclass
class RankMemory:
    """One rank's peak candidates on the device, and what lives off it."""

    candidates: dict[str, dict[str, int]]
    cpu_bytes: int = 0
    nvme_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    outside_allocator_bytes: int = 0  # NCCL buffers: counted by nvidia-smi, not by torch


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def shard(step: StepMemory, settings: TrainSettings, hidden_size: int) -> RankMemory:
    """Apply 4-bit packing, paging, and the data-parallel layout to every candidate."""
    candidates = {region: dict(b) for region, b in step.candidates.items()}
    rank = RankMemory(candidates)
    if settings.load_in_4bit:
        _pack_4bit(rank, step, settings)
    if settings.optim.startswith("paged_"):
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
    """DeepSpeed ZeRO on `world_size` ranks, with the HF integration's "auto" values.

    Under DeepSpeed the engine keeps the model in the compute dtype (bf16/fp16)
    and the optimizer keeps an fp32 master copy, instead of torch AMP's fp32
    weights under autocast.
    """
    dp = settings.world_size
    stage = settings.zero_stage
    total, trainable = step.total_params, step.trainable_params
    half = settings.compute_dtype != "float32"
    w_bytes = 2 if half else 4
    frozen = total - trainable
    # Optimizer state bytes per trainable parameter, as the single-device trace saw them.
    single_opt = max(b["optimizer"] for b in rank.candidates.values())
    state_bytes = single_opt / max(trainable, 1)
    master = 4 * trainable if half else 0  # fp32 master weights (DeepSpeed bf16/fp16 optimizer)
    optimizer_total = single_opt + master
    bucket = hidden_size * hidden_size * w_bytes  # reduce_bucket_size "auto" = h^2 elements
    overlap = 2  # overlap_comm doubles the reduce bucket; our configs (deepspeed.py) turn it on at every stage

    weights = total * w_bytes if not settings.load_in_4bit else max(b["weights"] for b in rank.candidates.values())
    gradients = trainable * w_bytes
    persistent = 0
    if stage == 3:
        # Parameters are partitioned; a layer or two are gathered at a time
        # (prefetch bucket "auto" = 0.9 h^2), and parameters under the
        # persistence threshold ("auto" = 10 h elements) stay whole.
        gathered = 2 * (step.largest_param_numel + int(0.9 * hidden_size * hidden_size)) * w_bytes
        persistent = 0
        weights = total * w_bytes // dp + gathered
    device_grads = gradients if stage == 1 else gradients // dp
    device_opt = int(optimizer_total // dp)
    step_temp = 4 * trainable // dp  # fp32 gradient partition built for the step

    cpu = nvme = 0
    if settings.offload_optimizer != "none":
        # ZeRO-Offload: fp32 master, states and fp32 grads on the host
        # (about 18 B/param/dp with Adam), a device buffer the size of the largest parameter.
        host = device_opt + step_temp + 2 * trainable // dp
        if settings.offload_optimizer == "cpu":
            cpu += host
        else:
            nvme += device_opt
            cpu += host - device_opt
        device_opt = 0
        step_temp = step.largest_param_numel * 4
    if settings.offload_param != "none":
        gathered = weights - total * w_bytes // dp
        host_weights = total * w_bytes // dp
        if settings.offload_param == "cpu":
            cpu += host_weights
        else:
            nvme += host_weights
        weights = gathered + persistent

    for region, b in rank.candidates.items():
        b["weights"] = weights
        b["gradients"] = device_grads
        b["optimizer"] = device_opt
        b["overhead"] += bucket * overlap * (2 if stage >= 2 else 1)
        if is_optimizer_region(region):
            b["temporary"] = step_temp  # DeepSpeed's optimizer replaces torch's step temporaries
    rank.cpu_bytes += cpu
    rank.nvme_bytes += nvme
    shards = {1: "optimizer states", 2: "optimizer states and gradients", 3: "optimizer states, gradients and parameters"}
    rank.notes.append(f"ZeRO-{stage} partitions {shards[stage]} over {dp} rank(s); frozen params: {frozen}; "
                      f"optimizer state {state_bytes:.1f} B/param + fp32 master")

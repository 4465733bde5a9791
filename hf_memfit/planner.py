"""`plan()`: the fastest training configuration that fits a memory budget, with its reasons.

The search is exhaustive over a small grid, because fast-mode estimates cost
about a millisecond each: micro-batch (a divisor of the per-rank batch, so the
global batch is kept exactly) x gradient checkpointing x optimizer (within the
AdamW family) x ZeRO stage and offload (only as allowed). Precision and
attention are not searched: bf16 mixed where the GPU has bf16, else fp16 with
loss scaling; flash-attention-2 where installed and supported, else SDPA. Each
fitting candidate gets a predicted step time from a speed model (below), and
the fastest wins. LoRA and the sequence length are never changed: they change
the training; when nothing fits, the error says that they would help.
"""

import importlib.util
import math
from dataclasses import dataclass, field

from hf_memfit.errors import MemFitError, check_all
from hf_memfit.estimator import MemoryEstimate, assemble, estimate_settings
from hf_memfit.settings import TrainSettings
from hf_memfit.spec import ModelSpec, resolve_model
from hf_memfit.units import GiB, format_bytes, parse_bytes

# The optimizer family, fastest first. 8-bit AdamW stores 2 B/param of state
# instead of 8 (bitsandbytes), paged 8-bit lets the driver move it to the host.
ADAM_LADDER = ("adamw_torch_fused", "adamw_bnb_8bit", "paged_adamw_8bit")

# --- speed model constants (relative ranking, not wall-clock promises) -------
# Matmul efficiency grows with the tokens in a micro-batch (the M dimension of
# every GEMM); we model utilisation as t / (t + T_HALF). 512 tokens for half
# of peak is a planning figure in line with GEMM roofline curves on A100-class
# GPUs (cuBLAS reaches most of peak once M is in the low thousands).
TOKENS_FOR_HALF_UTILISATION = 512
# bitsandbytes' 8-bit AdamW step is memory-bound like fused AdamW but does
# block-wise (de)quantisation; we charge 25% more step time (a planning figure)
# and paging another 25% for page migrations under pressure.
EIGHT_BIT_STEP_FACTOR = 1.25
PAGED_STEP_FACTOR = 1.25
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
# seq 128, forward + backward, FLOPs counted as `_cpu_step_seconds` counts them: 45-67 GFLOP/s, median 58.5.
CPU_FLOPS_PER_S = 6e10
# Tokens per micro-batch at which a 256 -> 1024 -> 256 MLP block's forward + backward runs at half its best FLOP
# rate: least-squares fit of t / (t + T) over 16-4096 rows gave T = 14-26, median 22 (the GPU figure above is 512).
CPU_TOKENS_FOR_HALF_UTILISATION = 22
# That transformer layer under non-reentrant checkpointing (as `gradient_checkpointing_enable` wraps each block),
# timed interleaved with the plain layer: 1.48-1.54x its plain forward + backward time (1.39-1.57x over all runs).
# FLOPs alone say 8/6 = 1.33x; the recomputed dropout, softmax and norms cost more on a CPU than their FLOPs say.
CPU_CHECKPOINTED_LAYER_FACTOR = 1.5
# Optimizer step throughput in parameters per second, each optimizer built as the HF Trainer builds it, over
# 4.2M fp32 parameters in 16 tensors. torch's fused AdamW: 0.75-1.65e9 (median 1.2e9); bitsandbytes' 8-bit AdamW,
# paged or not: 4.1-5.0e7 (median 4.6e7), about 25x slower: its CPU path dequantizes both states to fp32 tensors
# and runs the update in separate torch ops (the GPU figures charge it only 1.25x). Paging means nothing on the CPU
# (bitsandbytes falls back to the non-paged optimizer): paged 8-bit measured the same as 8-bit. adamw_torch (the
# single-tensor loop torch picks for CPU tensors): 3.0-5.6e8; adafactor: 3.8-5.2e8; sgd: 1.8-4.3e9 (median 3.8e9).
# Optimizers not listed fall back to adamw_torch's figure.
CPU_OPTIMIZER_PARAMS_PER_S = {
    "adamw_torch_fused": 1.2e9,
    "adamw_torch": 5e8,
    "adamw_bnb_8bit": 4.5e7,
    "adamw_8bit": 4.5e7,
    "paged_adamw_8bit": 4.5e7,
    "adafactor": 4.5e8,
    "sgd": 3.8e9,
}


@dataclass
class Plan:
    """A training configuration, with the TrainingArguments it maps to and why."""

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    num_gpus: int
    num_nodes: int
    gradient_checkpointing: bool
    bf16: bool
    fp16: bool
    torch_dtype: str
    optim: str
    attn_implementation: str
    deepspeed: dict | None
    per_device_eval_batch_size: int
    reasons: list[str]
    predicted_tokens_per_second_relative: float
    predicted_step_seconds: float
    settings: TrainSettings = field(repr=False)
    budget_bytes: int = 0

    def to_dict(self) -> dict:
        return {
            "per_device_train_batch_size": self.per_device_train_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "num_gpus": self.num_gpus,
            "num_nodes": self.num_nodes,
            "gradient_checkpointing": self.gradient_checkpointing,
            "bf16": self.bf16,
            "fp16": self.fp16,
            "torch_dtype": self.torch_dtype,
            "optim": self.optim,
            "attn_implementation": self.attn_implementation,
            "deepspeed": self.deepspeed,
            "per_device_eval_batch_size": self.per_device_eval_batch_size,
            "zero_stage": self.settings.zero_stage,
            "offload_optimizer": self.settings.offload_optimizer,
            "offload_param": self.settings.offload_param,
            "reasons": list(self.reasons),
            "predicted_tokens_per_second_relative": round(self.predicted_tokens_per_second_relative, 4),
            "budget_bytes": self.budget_bytes,
        }

    def training_arguments(self) -> dict:
        """The TrainingArguments fields this plan sets."""
        kwargs = {
            "per_device_train_batch_size": self.per_device_train_batch_size,
            "per_device_eval_batch_size": self.per_device_eval_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "gradient_checkpointing": self.gradient_checkpointing,
            "bf16": self.bf16,
            "fp16": self.fp16,
            "optim": self.optim,
        }
        if self.gradient_checkpointing:
            kwargs["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
        return kwargs


@dataclass
class Candidate:
    settings: TrainSettings
    estimate: MemoryEstimate
    step_seconds: float
    fits: bool
    why_not: str = ""


@dataclass
class PlanResult:
    plan: Plan
    estimate: MemoryEstimate
    alternatives: list[Candidate]
    candidates_tried: int

    def to_dict(self) -> dict:
        return {
            "plan": self.plan.to_dict(),
            "estimate": self.estimate.to_dict(),
            "alternatives": [_alternative_dict(c, self.plan) for c in self.alternatives],
        }


def _alternative_dict(c: Candidate, plan: Plan) -> dict:
    s = c.settings
    return {
        "per_device_train_batch_size": s.batch_size,
        "gradient_accumulation_steps": s.gradient_accumulation_steps,
        "gradient_checkpointing": s.gradient_checkpointing,
        "optim": s.optim,
        "zero_stage": s.zero_stage,
        "offload_optimizer": s.offload_optimizer,
        "offload_param": s.offload_param,
        "fits": c.fits,
        "device_total_bytes": c.estimate.device_total_bytes,
        "predicted_step_seconds": round(c.step_seconds, 4),
        "why_not": c.why_not,
    }


def plan(model: str | ModelSpec, *, seq_len: int, global_batch_size: int, gpu_memory: str | int | None = None,
         gpu: str | None = None, task: str | None = None, num_labels: int = 2, num_gpus: int = 1, num_nodes: int = 1,
         lora_r: int | None = None, lora_alpha: int | None = None, lora_target_modules=None,
         load_in_4bit: bool = False, allow_offload: str = "cpu", cpu_memory: str | int | None = None,
         nvme_path: str | None = None, headroom: float = 0.05, keep_optimizer: bool = False,
         optim: str = "adamw_torch_fused", device: str = "cuda", mode: str = "fast",
         precision: str | None = None, deepspeed_layout: tuple[int, str, str] | None = None,
         attn_implementation: str | None = None, trainer: str = "trainer", padding_free: bool = False,
         reference_model: str | None = None, decoder_seq_len: int | None = None) -> PlanResult:
    """Pick the fastest configuration that trains `model` within the memory budget.

    The budget is `gpu_memory` (a size such as "12GiB", or "auto" for the local
    GPU's free memory) or the memory of the named `gpu`. The global batch
    (micro-batch x accumulation x GPUs) is kept exactly. `precision` pins the
    precision (the trainer passes the loaded model's); by default it is chosen
    from the GPU. `deepspeed_layout` = (zero_stage, offload_optimizer,
    offload_param) fixes the layout to a DeepSpeed config the user already has
    (the trainer passes it); the rest is searched around it.
    `attn_implementation` pins the attention (the trainer passes the loaded
    model's); `trainer`, `padding_free`, `reference_model` and
    `decoder_seq_len` describe the step as `TrainSettings` does. Raises
    `MemFitError` when the request is invalid or nothing fits, saying what would.
    """
    spec = model if isinstance(model, ModelSpec) else resolve_model(model)
    gpu_info = _gpu_info(gpu)
    budget = _budget(gpu_memory, gpu_info)
    usable = int(budget * (1 - headroom))
    world = num_gpus * num_nodes
    problems = []
    if not 0 <= headroom < 1:
        problems.append(f"`--headroom` must be in [0, 1), got {headroom}")
    if allow_offload not in ("none", "cpu", "nvme"):
        problems.append(f"`--allow-offload` must be none, cpu or nvme; got {allow_offload!r}")
    if not isinstance(global_batch_size, int) or global_batch_size <= 0:
        problems.append(f"`--global-batch-size` must be a positive integer, got {global_batch_size!r}")
    elif global_batch_size % world:
        lower = global_batch_size // world * world
        problems.append(f"`--global-batch-size {global_batch_size}` cannot be split over {world} GPUs "
                        f"({num_gpus} x {num_nodes} nodes); use a multiple of {world}"
                        + (f", e.g. {lower} or {lower + world}" if lower else f", e.g. {world}"))
    if allow_offload == "nvme" and not nvme_path and device == "cuda":
        problems.append("`--allow-offload nvme` needs `--nvme-path DIR` (a fast local NVMe mount)")
    check_all(problems)
    cpu_limit = parse_bytes(cpu_memory, "--cpu-memory") if cpu_memory is not None else None

    if isinstance(lora_target_modules, str):
        lora_target_modules = tuple(t for t in lora_target_modules.split(",") if t)
    if precision is None:
        precision, precision_reason = _precision(gpu_info, device, load_in_4bit)
    else:
        precision_reason = f"precision {precision}: as the model was loaded"
    if attn_implementation is None:
        attn, attn_reason = _attention(gpu_info, device)
    else:
        attn, attn_reason = attn_implementation, f"attention {attn_implementation}: as the model was loaded"
    base = TrainSettings(
        batch_size=1, seq_len=seq_len, task=task, num_labels=num_labels, precision=precision, optim=optim,
        attn_implementation=attn, lora_r=lora_r, lora_alpha=lora_alpha,
        lora_target_modules=tuple(lora_target_modules) if lora_target_modules else None,
        load_in_4bit=load_in_4bit, num_gpus=num_gpus, num_nodes=num_nodes, device=device,
        gpu=gpu_info.name if gpu_info else None, mode="fast", trainer=trainer, padding_free=padding_free,
        reference_model=reference_model, decoder_seq_len=decoder_seq_len,
    ).validate(spec)

    per_rank = global_batch_size // world
    grid = _grid(base, per_rank, allow_offload, keep_optimizer, world, deepspeed_layout)
    candidates = [_evaluate(spec, s, usable, cpu_limit, gpu_info) for s in grid]
    fitting = sorted((c for c in candidates if c.fits), key=lambda c: c.step_seconds)
    if mode == "exact":
        fitting = _confirm_exact(spec, fitting, usable, cpu_limit)
    if not fitting:
        raise MemFitError(_nothing_fits(spec, base, candidates, usable, budget, allow_offload, world, per_rank))
    best = fitting[0]
    alternatives = _runners_up(best, fitting, candidates)
    ideal = _ideal_seconds(spec, best.settings, best.estimate, gpu_info)
    largest = max(spec.vocab_size * (spec.embedding_dim or spec.hidden_size),
                  max((m.weight_numel for m in spec.linear_modules(base.task, num_labels)), default=0))
    chosen = _make_plan(best, candidates, usable, budget, ideal, [precision_reason, attn_reason], nvme_path,
                        keep_optimizer, largest)
    return PlanResult(chosen, best.estimate, alternatives, len(candidates))


def _gpu_info(gpu: str | None):
    if gpu is None:
        return None
    from hf_memfit.hardware import find_gpu

    return find_gpu(gpu)


def _budget(gpu_memory, gpu_info) -> int:
    if gpu_memory is None and gpu_info is None:
        raise MemFitError("give a memory budget: `--gpu-memory 12GiB`, `--gpu NAME` or `--gpu-memory auto`")
    if isinstance(gpu_memory, str) and gpu_memory.strip().lower() == "auto":
        from hf_memfit.hardware import gpu_memory_auto

        return gpu_memory_auto()
    if gpu_memory is not None:
        return parse_bytes(gpu_memory, "--gpu-memory")
    return gpu_info.memory_bytes


def _precision(gpu_info, device: str, load_in_4bit: bool) -> tuple[str, str]:
    if device == "cpu":
        return "fp32", "fp32: planning for the CPU, where mixed precision is rarely faster"
    if gpu_info is None:
        return "bf16-mixed", "bf16 mixed precision: assuming an Ampere-or-newer GPU (pass `--gpu NAME` to be specific)"
    if gpu_info.supports_bf16:
        return "bf16-mixed", f"bf16 mixed precision: the {gpu_info.name} has bf16 tensor cores"
    return "fp16-mixed", f"fp16 mixed precision with loss scaling: the {gpu_info.name} has no bf16"


def _attention(gpu_info, device: str) -> tuple[str, str]:
    if device == "cpu":
        return "sdpa", "attention sdpa: the CPU's fused SDPA kernel"
    flash_ok = gpu_info is None or gpu_info.supports_flash_attention
    if flash_ok and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2", "attention flash_attention_2: installed and supported by the GPU"
    if flash_ok:
        return "sdpa", "attention sdpa (its flash kernel): flash-attn is not installed, SDPA keeps the same O(s) memory"
    return "sdpa", "attention sdpa (memory-efficient kernel): this GPU predates flash attention (sm80+)"


def _grid(base: TrainSettings, per_rank: int, allow_offload: str, keep_optimizer: bool, world: int,
          fixed_layout: tuple[int, str, str] | None = None):
    micro_batches = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
    optims = (base.optim,) if keep_optimizer or base.optim not in ADAM_LADDER else ADAM_LADDER
    if fixed_layout is not None:  # the user's own DeepSpeed config: its optimizer section, if any, wins anyway
        stage, off_opt, off_param = fixed_layout
        for micro in micro_batches:
            for checkpointing in (False, True):
                yield base.replace(batch_size=micro, gradient_accumulation_steps=per_rank // micro,
                                   gradient_checkpointing=checkpointing, zero_stage=stage,
                                   offload_optimizer=off_opt, offload_param=off_param)
        return
    layouts = [(0, "none", "none")]
    # DeepSpeed layouts are GPU plans: on the CPU one process holds everything, so there is nothing to shard.
    on_gpu = base.device == "cuda"
    if world > 1 and on_gpu:
        layouts += [(1, "none", "none"), (2, "none", "none"), (3, "none", "none")]
    if allow_offload in ("cpu", "nvme") and not base.load_in_4bit and on_gpu:
        layouts += [(2, "cpu", "none"), (3, "cpu", "none"), (3, "cpu", "cpu")]
    if allow_offload == "nvme" and not base.load_in_4bit and on_gpu:
        layouts += [(3, "nvme", "nvme")]
    for micro in micro_batches:
        for checkpointing in (False, True):
            for zero_stage, off_opt, off_param in layouts:
                for optim in optims:
                    if zero_stage and optim != "adamw_torch_fused":
                        continue  # under ZeRO the states are already sharded; 8-bit states stay a plain-torch knob
                    if base.load_in_4bit and zero_stage == 3:
                        continue
                    yield base.replace(batch_size=micro, gradient_accumulation_steps=per_rank // micro,
                                       gradient_checkpointing=checkpointing, optim=optim, zero_stage=zero_stage,
                                       offload_optimizer=off_opt, offload_param=off_param)


def _evaluate(spec, settings: TrainSettings, usable: int, cpu_limit: int | None, gpu_info) -> Candidate:
    est = estimate_settings(spec, settings)
    used = est.device_total_bytes
    fits = used <= usable
    why = "" if fits else f"needs {format_bytes(used)}, over the {format_bytes(usable)} usable"
    if fits and cpu_limit is not None and est.cpu_bytes > cpu_limit:
        fits, why = False, f"needs {format_bytes(est.cpu_bytes)} of host memory, over `--cpu-memory` {format_bytes(cpu_limit)}"
    return Candidate(settings, est, step_seconds(spec, settings, est, gpu_info), fits, why)


def _confirm_exact(spec, fitting: list[Candidate], usable: int, cpu_limit) -> list[Candidate]:
    """Re-estimate the fastest fitting candidates in exact mode; keep the first that still fits."""
    for candidate in fitting[:5]:
        exact = estimate_settings(spec, candidate.settings.replace(mode="exact"))
        if exact.device_total_bytes <= usable and (cpu_limit is None or exact.cpu_bytes <= cpu_limit):
            candidate.estimate = exact
            return [candidate] + [c for c in fitting if c is not candidate]
    return []


# --- speed model ----------------------------------------------------------------

def step_seconds(spec: ModelSpec, settings: TrainSettings, est: MemoryEstimate, gpu_info) -> float:
    """Predicted seconds per optimizer step: compute, optimizer, offload traffic and communication.

    A ranking model with documented constants, not a benchmark; FLOPs are
    counted by `_micro_batch_flops`.
    """
    if settings.device == "cpu":
        return _cpu_step_seconds(spec, settings, est)
    tflops = (gpu_info.matmul_tflops("bf16" if settings.precision.startswith("bf16") else
                                     "fp16" if settings.precision.startswith("fp16") else "tf32")
              if gpu_info else 100.0) * 1e12  # 100 TFLOP/s: a generic Ampere-class figure when no GPU is named
    hbm = gpu_info.hbm_bandwidth_bytes_per_s if gpu_info else 1.5e12
    pcie = gpu_info.pcie_bandwidth_bytes_per_s if gpu_info else 25e9
    nvlink = gpu_info.nvlink_bandwidth_bytes_per_s if gpu_info else 0.0
    params, trainable = est.total_params, est.trainable_params
    tokens_micro = settings.batch_size * settings.seq_len
    micro_steps = settings.gradient_accumulation_steps
    flops = _micro_batch_flops(spec, settings, est)
    utilisation = tokens_micro / (tokens_micro + TOKENS_FOR_HALF_UTILISATION)
    compute = micro_steps * flops / (tflops * utilisation)

    optimizer = ADAM_BYTES_MOVED_PER_PARAM * trainable / hbm
    if "8bit" in settings.optim:
        optimizer *= EIGHT_BIT_STEP_FACTOR * (PAGED_STEP_FACTOR if settings.optim.startswith("paged") else 1)
    world = settings.world_size
    w_bytes = 2 if settings.precision != "fp32" else 4
    if settings.offload_optimizer != "none":
        # Gradients down and updated weights up over PCIe; Adam on the host.
        optimizer = 2 * w_bytes * trainable / world / pcie + trainable / world / CPU_ADAM_PARAMS_PER_S
        if settings.offload_optimizer == "nvme":
            optimizer += 16 * trainable / world / NVME_BYTES_PER_S  # fp32 master + states read and written
    offload_param = 0.0
    if settings.offload_param != "none":
        # Each micro-batch fetches every parameter for forward and again for backward.
        rate = pcie if settings.offload_param == "cpu" else min(pcie, NVME_BYTES_PER_S)
        offload_param = micro_steps * 2 * w_bytes * params / rate

    comm = 0.0
    if world > 1:
        link = nvlink or pcie
        if settings.num_nodes > 1:
            link = min(link, INTER_NODE_BYTES_PER_S)
        ring = (world - 1) / world
        grad_bytes = w_bytes * trainable
        if settings.zero_stage == 3:
            # All-gather parameters for forward and backward, reduce-scatter gradients, every micro-batch.
            comm = micro_steps * (2 * w_bytes * params + grad_bytes) * ring / link
        elif settings.zero_stage in (1, 2):
            comm = (micro_steps * grad_bytes + w_bytes * trainable) * ring / link
        else:
            comm = 2 * grad_bytes * ring / link  # DDP all-reduce once per optimizer step (no_sync while accumulating)
        comm *= 1 - COMM_OVERLAP
    return compute + optimizer + offload_param + comm


def _micro_batch_flops(spec: ModelSpec, settings: TrainSettings, est: MemoryEstimate,
                       checkpointed_layer_factor: float | None = None) -> float:
    """FLOPs of one micro-batch's forward and backward: the matmuls only.

    Kaplan et al. 2020: 2 per weight per token forward, 4 backward (2 when the
    weights are frozen, as with LoRA: only input gradients), plus attention. Only
    linear modules count (the tied LM head included): embedding lookups cost no
    FLOPs, which matters for models whose parameters are mostly a vocabulary
    table (BERT). Checkpointing re-runs the repeated layers, not the head: by
    default one more forward of them (6 -> 8 FLOPs per weight per token, +33%,
    for a full fine-tune; 4 -> 6 with frozen weights); the CPU passes its
    measured factor.
    """
    linears = spec.linear_modules(settings.task, settings.num_labels)
    layer_params = sum(m.weight_numel * m.count for m in linears if m.scope == "layer")
    other_params = sum(m.weight_numel * m.count for m in linears if m.scope != "layer")
    backward = 4 if est.trainable_params >= 0.5 * est.total_params else 2
    tokens_micro = settings.batch_size * settings.seq_len
    layers = spec.num_layers + (spec.num_decoder_layers or 0)
    attention = 12 * layers * spec.hidden_size * settings.seq_len  # per token, fwd+bwd (Kaplan)
    layer_flops = ((2 + backward) * layer_params + attention) * tokens_micro
    if settings.gradient_checkpointing:
        layer_flops *= checkpointed_layer_factor or (4 + backward) / (2 + backward)
    return layer_flops + (2 + backward) * other_params * tokens_micro


def _cpu_step_seconds(spec: ModelSpec, settings: TrainSettings, est: MemoryEstimate) -> float:
    """`step_seconds` for device="cpu": one process, measured CPU constants (above).

    The optimizer step costs trainable parameters / the optimizer's measured
    throughput, which on the CPU separates 8-bit AdamW from fused AdamW by ~25x.
    """
    tokens_micro = settings.batch_size * settings.seq_len
    flops = _micro_batch_flops(spec, settings, est, checkpointed_layer_factor=CPU_CHECKPOINTED_LAYER_FACTOR)
    utilisation = tokens_micro / (tokens_micro + CPU_TOKENS_FOR_HALF_UTILISATION)
    compute = settings.gradient_accumulation_steps * flops / (CPU_FLOPS_PER_S * utilisation)
    rate = CPU_OPTIMIZER_PARAMS_PER_S.get(settings.optim, CPU_OPTIMIZER_PARAMS_PER_S["adamw_torch"])
    return compute + est.trainable_params / rate


def _ideal_seconds(spec: ModelSpec, settings: TrainSettings, est: MemoryEstimate, gpu_info) -> float:
    """The same step with one micro-batch, no checkpointing, no offload: the speed ceiling."""
    ideal = settings.replace(batch_size=settings.batch_size * settings.gradient_accumulation_steps,
                             gradient_accumulation_steps=1, gradient_checkpointing=False,
                             optim="adamw_torch_fused" if settings.optimizer_family != "sgd" else settings.optim,
                             zero_stage=0 if settings.world_size == 1 else settings.zero_stage,
                             offload_optimizer="none", offload_param="none")
    return step_seconds(spec, ideal, est, gpu_info)


# --- explaining the choice ----------------------------------------------------------

def _runners_up(best: Candidate, fitting: list[Candidate], candidates: list[Candidate]) -> list[Candidate]:
    """Two fitting runners-up that differ in a knob, and the closest configuration that did not fit."""
    picked: list[Candidate] = []
    seen = {_knobs(best.settings)}
    for c in fitting[1:]:
        if _knobs(c.settings) not in seen:
            c.why_not = f"{100 * (c.step_seconds / best.step_seconds - 1):.0f}% slower: {_difference(best.settings, c.settings)}"
            picked.append(c)
            seen.add(_knobs(c.settings))
        if len(picked) == 2:
            break
    faster_misfits = [c for c in candidates if not c.fits and c.step_seconds < best.step_seconds]
    if faster_misfits:
        closest = min(faster_misfits, key=lambda c: c.estimate.device_total_bytes)
        picked.append(closest)
    return picked


def _knobs(s: TrainSettings) -> tuple:
    return (s.gradient_checkpointing, s.optim, s.zero_stage, s.offload_optimizer, s.offload_param)


def _difference(chosen: TrainSettings, other: TrainSettings) -> str:
    parts = []
    if other.batch_size != chosen.batch_size:
        parts.append(f"micro-batch {other.batch_size}")
    if other.gradient_checkpointing != chosen.gradient_checkpointing:
        parts.append("checkpointing " + ("on" if other.gradient_checkpointing else "off"))
    if other.optim != chosen.optim:
        parts.append(other.optim)
    if (other.zero_stage, other.offload_optimizer, other.offload_param) != \
            (chosen.zero_stage, chosen.offload_optimizer, chosen.offload_param):
        parts.append(_layout_text(other))
    return ", ".join(parts) or "same knobs"


def _layout_text(s: TrainSettings) -> str:
    if not s.zero_stage:
        return "DDP" if s.world_size > 1 else "no ZeRO"
    text = f"ZeRO-{s.zero_stage}"
    if s.offload_optimizer != "none":
        text += f" + optimizer offload to {s.offload_optimizer}"
    if s.offload_param != "none":
        text += f" + parameter offload to {s.offload_param}"
    return text


def _lookup(candidates: list[Candidate], settings: TrainSettings) -> Candidate | None:
    for c in candidates:
        if c.settings == settings:
            return c
    return None


def _make_plan(best: Candidate, candidates, usable: int, budget: int, ideal_seconds: float, fixed_reasons: list[str],
               nvme_path: str | None, keep_optimizer: bool, largest_param_numel: int) -> Plan:
    s, est = best.settings, best.estimate
    reasons = [f"budget: {format_bytes(usable)} usable of {format_bytes(budget)}; plan peaks at "
               f"{format_bytes(est.device_total_bytes)} ({100 * est.device_total_bytes / usable:.0f}% of usable)"]
    global_batch = s.batch_size * s.gradient_accumulation_steps * s.world_size
    bigger = [c for c in candidates if c.settings.batch_size > s.batch_size and _knobs(c.settings) == _knobs(s)]
    batch_reason = f"micro-batch {s.batch_size} x accumulation {s.gradient_accumulation_steps} x {s.world_size} GPU(s) = global batch {global_batch}"
    if bigger:
        nxt = min(bigger, key=lambda c: c.settings.batch_size)
        batch_reason += (f"; micro-batch {nxt.settings.batch_size} would need {format_bytes(nxt.estimate.device_total_bytes)}"
                         if not nxt.fits else f"; micro-batch {nxt.settings.batch_size} fits but is predicted slower")
    reasons.append(batch_reason)
    if s.gradient_checkpointing:
        without = _lookup(candidates, s.replace(gradient_checkpointing=False))
        if without is not None and not without.fits:
            reasons.append(f"gradient checkpointing on: without it the peak would be "
                           f"{format_bytes(without.estimate.device_total_bytes)}, "
                           f"{format_bytes(without.estimate.device_total_bytes - usable)} over budget "
                           f"(activations {format_bytes(without.estimate.breakdown['activations'])})")
        else:
            reasons.append("gradient checkpointing on: it allows a larger micro-batch, which the speed model ranks faster "
                           "despite ~33% recompute")
    else:
        reasons.append(f"gradient checkpointing off: activations ({format_bytes(est.breakdown['activations'])}) fit; "
                       "skipping ~33% recompute")
    precision_reason, attn_reason = fixed_reasons
    reasons.append(precision_reason)
    if keep_optimizer:
        reasons.append(f"optimizer {s.optim}: kept as asked (`--keep-optimizer`)")
    elif s.optim == "adamw_torch_fused":
        reasons.append("optimizer adamw_torch_fused: full-precision AdamW states fit; the fastest step")
    else:
        fused = _lookup(candidates, s.replace(optim="adamw_torch_fused"))
        detail = (f"; fused AdamW would need {format_bytes(fused.estimate.device_total_bytes)}" if fused and not fused.fits else "")
        reasons.append(f"optimizer {s.optim}: 8-bit states take ~2 B/param instead of 8{detail}")
    reasons.append(attn_reason)
    if s.zero_stage:
        plain = _lookup(candidates, s.replace(zero_stage=0, offload_optimizer="none", offload_param="none"))
        detail = (f"; without it the peak would be {format_bytes(plain.estimate.device_total_bytes)}"
                  if plain is not None and not plain.fits else "")
        reasons.append(f"DeepSpeed {_layout_text(s)}{detail}"
                       + (f"; host memory needed {format_bytes(est.cpu_bytes)}" if est.cpu_bytes else ""))
    elif s.world_size > 1:
        reasons.append("DDP: model states fit on every GPU, so no sharding traffic")
    deepspeed = None
    if s.zero_stage:
        from hf_memfit.deepspeed import deepspeed_config

        deepspeed = deepspeed_config(s.zero_stage, s.offload_optimizer, s.offload_param, nvme_path=nvme_path,
                                     precision=s.precision, largest_param_numel=largest_param_numel)
    # The dtype to load the weights in: the stored dtype (fp32 under *-mixed autocast), and the
    # compute dtype for the parts of a 4-bit model bitsandbytes does not pack.
    torch_dtype = s.weights_dtype if not s.load_in_4bit else ("bfloat16" if s.precision.startswith("bf16") else "float16")
    return Plan(
        per_device_train_batch_size=s.batch_size,
        gradient_accumulation_steps=s.gradient_accumulation_steps,
        num_gpus=s.num_gpus,
        num_nodes=s.num_nodes,
        gradient_checkpointing=s.gradient_checkpointing,
        bf16=s.precision.startswith("bf16"),
        fp16=s.precision.startswith("fp16"),
        torch_dtype=torch_dtype,
        optim=s.optim,
        attn_implementation=s.attn_implementation or "sdpa",
        deepspeed=deepspeed,
        per_device_eval_batch_size=s.batch_size,
        reasons=reasons,
        predicted_tokens_per_second_relative=min(1.0, ideal_seconds / best.step_seconds),
        predicted_step_seconds=best.step_seconds,
        settings=s,
        budget_bytes=budget,
    )


def _nothing_fits(spec, base: TrainSettings, candidates, usable: int, budget: int, allow_offload: str, world: int,
                  per_rank: int) -> str:
    """The one-line error when no candidate fits: the smallest footprint, and which remedies would fit.

    Remedies are tried from the least to the most change to the training: offload,
    more GPUs, LoRA, QLoRA, then a shorter sequence (the longest power-of-two
    fraction that fits). Each is checked with the same estimator, so every
    suggestion printed is one that fits.
    """
    smallest = min(candidates, key=lambda c: c.estimate.device_total_bytes)
    on_gpu = base.device == "cuda"
    lean = dict(gradient_checkpointing=True, zero_stage=0, offload_optimizer="none", offload_param="none")
    offload = dict(zero_stage=3, offload_optimizer="cpu", offload_param="cpu", optim="adamw_torch_fused")

    def need(global_batch: int = per_rank * world, **changes) -> int:
        """The smallest footprint with `changes`, over micro-batch 1 or the whole per-rank batch."""
        settings = base.replace(**{**lean, **changes})
        ranks = settings.world_size
        sizes = []
        for micro in sorted({1, global_batch // ranks}):
            trial = settings.replace(batch_size=micro, gradient_accumulation_steps=global_batch // ranks // micro)
            sizes.append(estimate_settings(spec, trial).device_total_bytes)
        return min(sizes)

    remedies: list[tuple[str, dict]] = []
    if on_gpu and allow_offload == "none" and not base.load_in_4bit:
        remedies.append(("`--allow-offload cpu`", offload))
    if on_gpu and base.num_nodes == 1:
        for gpus in (2 * world, 4 * world, 8 * world):
            if gpus <= 8 and per_rank * world % gpus == 0:
                layout = offload if allow_offload != "none" else dict(zero_stage=3, optim="adamw_torch_fused")
                remedies.append((f"`--num-gpus {gpus}` with ZeRO-3", dict(layout, num_gpus=gpus)))
    if not base.uses_lora:
        remedies.append(("LoRA `--lora-r 16`", dict(lora_r=16, optim="adamw_torch_fused")))
    qlora = dict(lora_r=base.lora_r or 16, load_in_4bit=True, optim="adamw_torch_fused",
                 precision="bf16-mixed" if base.precision == "fp32" else base.precision)
    if on_gpu and not base.load_in_4bit:
        remedies.append(("QLoRA `--load-in-4bit --lora-r 16`", qlora))
    helps = []
    for text, changes in remedies:
        if "num_gpus" in changes and any("--num-gpus" in h for h in helps):
            continue  # the fewest GPUs that fit is enough to name
        size = need(**changes)
        if size <= usable:
            helps.append(f"{text} ({format_bytes(size)})")
    # A shorter sequence changes the data, so it comes last: alone (with offload where the
    # user allowed it), then, only if nothing else fits, together with offload or QLoRA.
    can_offload = on_gpu and not base.load_in_4bit
    shorter = [("", [{}] + ([offload] if can_offload and allow_offload != "none" else []))]
    if can_offload and allow_offload == "none":
        shorter.append(("`--allow-offload cpu` with ", [offload]))
    if can_offload:
        shorter.append(("QLoRA with ", [qlora]))
    for prefix, variants in shorter:
        if prefix and helps:
            break
        seq, size = base.seq_len // 2, None
        while seq >= 16:
            size = min(need(seq_len=seq, **changes) for changes in variants)
            if size <= usable:
                break
            seq //= 2
        if seq >= 16:
            helps.append(f"{prefix}a shorter sequence `--seq-len {seq}` ({format_bytes(size)})")
    suggestion = "; ".join(helps) if helps else "a larger GPU"
    return (f"nothing fits in {format_bytes(usable)} ({format_bytes(budget)} less headroom): the smallest footprint "
            f"found is {smallest.estimate.device_total_bytes / GiB:.1f} GiB ({_difference_text(smallest.settings)}); "
            f"what would fit: {suggestion}")


def _difference_text(s: TrainSettings) -> str:
    return (f"micro-batch {s.batch_size}, checkpointing {'on' if s.gradient_checkpointing else 'off'}, {s.optim}, "
            f"{_layout_text(s)}")

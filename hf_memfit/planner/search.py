"""`plan()`: the fastest training configuration that fits a memory budget, with its reasons.

The search is exhaustive over a small grid, because fast-mode estimates cost
about a millisecond each: micro-batch (a divisor of the per-rank batch, so the
global batch is kept exactly) x gradient checkpointing x optimizer (within the
AdamW family) x layout: DDP, ZeRO-1/2/3 and PyTorch FSDP (full_shard,
shard_grad_op), with offload only as allowed. Precision and
attention are not searched: bf16 mixed where the GPU has bf16, else fp16 with
loss scaling; flash-attention-2 where installed and supported, else SDPA. Each
fitting candidate gets a predicted step time from a speed model (below), and
the fastest wins. LoRA and the sequence length are never changed: they change
the training; when nothing fits, the error says that they would help.
"""

import importlib.util
import math
from dataclasses import dataclass, field

from hf_memfit import optimizers
from hf_memfit.errors import MemFitError, check_all
from hf_memfit.estimator.assemble import MemoryEstimate, estimate_settings
from hf_memfit.settings import TrainSettings
from hf_memfit.models.spec import ModelSpec, resolve_model
from hf_memfit.units import GiB, format_bytes, parse_bytes

# What runs the step when ZeRO offloads the optimizer: deepspeed.py writes an
# `optimizer` section (AdamW), which DeepSpeed builds as DeepSpeedCPUAdam on the host.
OFFLOADED_OPTIMIZER = "DeepSpeedCPUAdam"

# The AdamW ladder, fastest first (`optimizers.ADAMW_LADDER`): 8-bit AdamW stores ~2 B/param of state
# instead of 8 (bitsandbytes), paged 8-bit lets the driver move it to the host, torchao's 8-bit and 4-bit
# AdamW (~2 and ~1 B/param) quantize the states the same way. On the CPU the ladder stops at bitsandbytes:
# torchao compiles one update per tensor shape with torch.compile (37 s for the first one on this 2-core
# machine, a C++ toolchain required), which no per-step speed figure can rank fairly.
ADAM_LADDER = optimizers.ADAMW_LADDER
CPU_ADAM_LADDER = ("adamw_torch_fused", "adamw_bnb_8bit", "paged_adamw_8bit")

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
# 4.2M fp32 parameters in 16 tensors: `optimizers.Optimizer.cpu_params_per_s` (torch's fused AdamW 1.2e9,
# bitsandbytes' 8-bit AdamW 4.5e7 (its CPU path dequantizes both states to fp32 tensors), adamw_torch 5e8, ...).


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
    fsdp: dict | None = None  # TrainingArguments `fsdp` / `fsdp_config` when the plan shards with FSDP
    optim_args: str | None = None  # TrainingArguments.optim_args ("bf16_stochastic_round=True" for pure bf16)
    use_liger_kernel: bool = False
    offload_activations: bool = False  # gradient_checkpointing_kwargs={"offload": True}
    optim_target_modules: list[str] | None = None  # GaLore / APOLLO

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
            "optim_args": self.optim_args,
            "use_liger_kernel": self.use_liger_kernel,
            "offload_activations": self.offload_activations,
            "optim_target_modules": self.optim_target_modules,
            "attn_implementation": self.attn_implementation,
            "deepspeed": self.deepspeed,
            "fsdp": self.fsdp,
            "per_device_eval_batch_size": self.per_device_eval_batch_size,
            "zero_stage": self.settings.zero_stage,
            "offload_optimizer": self.settings.offload_optimizer,
            "offload_param": self.settings.offload_param,
            "fsdp_strategy": self.settings.fsdp,
            "fsdp_version": self.settings.fsdp_version if self.settings.fsdp else None,
            "fsdp_offload": self.settings.fsdp_offload,
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
        if self.optim_args:
            kwargs["optim_args"] = self.optim_args
        if self.use_liger_kernel:
            kwargs["use_liger_kernel"] = True
        if self.optim_target_modules:
            # the Trainer reads "all-linear" only as a string (in a list it is a module name)
            targets = list(self.optim_target_modules)
            kwargs["optim_target_modules"] = "all-linear" if targets == ["all-linear"] else targets
        if self.gradient_checkpointing:
            kwargs["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
            if self.offload_activations:
                kwargs["gradient_checkpointing_kwargs"]["offload"] = True
        if self.fsdp is not None:
            kwargs.update(self.fsdp)
        if self.deepspeed is not None:  # the plan's peak depends on this layout (TrainingArguments takes a dict)
            kwargs["deepspeed"] = self.deepspeed
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
        "fsdp": s.fsdp,
        "fsdp_version": s.fsdp_version if s.fsdp else None,
        "fsdp_offload": s.fsdp_offload,
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
         fsdp_layout: tuple[str, int, bool] | None = None, bnb_4bit_use_double_quant: bool = True,
         bnb_4bit_quant_storage: str | None = None, allow_pure_bf16: bool = False, allow_optimizers=(),
         expandable_segments: bool = False, progress=None, use_liger_kernel: bool | None = None,
         attn_implementation: str | None = None, trainer: str = "trainer", padding_free: bool = False,
         reference_model: str | None = None, decoder_seq_len: int | None = None,
         activation_offloading: bool = False, optim_target_modules=None, optim_args: str | None = None) -> PlanResult:
    """Pick the fastest configuration that trains `model` within the memory budget.

    The budget is `gpu_memory` (a size such as "12GiB", or "auto" for the local
    GPU's free memory) or the memory of the named `gpu`. The global batch
    (micro-batch x accumulation x GPUs) is kept exactly. `precision` pins the
    precision (the trainer passes the loaded model's); by default it is chosen
    from the GPU. `deepspeed_layout` = (zero_stage, offload_optimizer,
    offload_param) fixes the layout to a DeepSpeed config the user already has
    (the trainer passes it); `fsdp_layout` = (strategy, version, offload) to an
    FSDP one; the rest is searched around it. `cpu_memory` is
    the host RAM per node for offloaded state: a size, "auto" (this machine)
    or "none"; unset, it is "auto" with `gpu_memory="auto"` and unchecked
    otherwise. Fast-mode choices within `CONFIRM_IN_EXACT_MARGIN` of the
    budget are re-estimated in exact mode before they are chosen (`mode="exact"`
    confirms every choice); `progress(text)` hears about those slower steps.

    Levers that change the training are used only when allowed:
    `allow_pure_bf16` lets the plan drop the fp32 master weights (bf16 weights,
    gradients and torchao's low-bit AdamW with bf16 stochastic rounding) when no
    mixed-precision plan fits; `allow_optimizers` names optimizers the planner may
    switch to beyond the AdamW ladder (galore_adamw, apollo_adamw, adafactor, ...).
    Liger's fused linear cross-entropy (same loss, no logits) is searched for the
    causal-LM families it patches when `liger_kernel` is installed, or when
    `use_liger_kernel` is True; False never searches it.
    `attn_implementation` pins the attention (the trainer passes the loaded
    model's); `trainer`, `padding_free`, `reference_model` and
    `decoder_seq_len` describe the step as `TrainSettings` does; so does
    `activation_offloading` (TRL's, kept as set: it is the user's choice).
    `optim_target_modules` / `optim_args` go with a GaLore / APOLLO `optim` the run
    already has (TrainingArguments' names; "all-linear" or module names).
    Raises `MemFitError` when the request is invalid or nothing fits, saying what would.
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
    if isinstance(allow_optimizers, str):
        allow_optimizers = tuple(o.strip() for o in allow_optimizers.split(",") if o.strip())
    allow_optimizers = tuple(allow_optimizers or ())
    unknown = [o for o in allow_optimizers if o not in optimizers.OPTIMIZERS]
    if unknown:
        problems.append(f"`--allow-optimizers` {', '.join(unknown)} not modelled; use names from "
                        f"{', '.join(optimizers.OPTIMIZERS)}")
    check_all(problems)
    host = _host_limit(cpu_memory, gpu_memory)

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
        gpu=gpu_info.name if gpu_info else None, mode="fast", expandable_segments=expandable_segments,
        bnb_4bit_use_double_quant=bnb_4bit_use_double_quant, bnb_4bit_quant_storage=bnb_4bit_quant_storage,
        trainer=trainer, padding_free=padding_free, reference_model=reference_model, decoder_seq_len=decoder_seq_len,
        activation_offloading=activation_offloading, optim_args=optim_args,
        optim_target_modules=_target_modules(optim_target_modules),
    ).validate(spec)
    fixed_layout = None
    if deepspeed_layout is not None and fsdp_layout is not None:
        raise MemFitError("a run shards with DeepSpeed or with FSDP, not both: drop one of the two configs")
    if deepspeed_layout is not None:
        fixed_layout = dict(zip(("zero_stage", "offload_optimizer", "offload_param"), deepspeed_layout))
    elif fsdp_layout is not None:
        fixed_layout = dict(zip(("fsdp", "fsdp_version", "fsdp_offload"), fsdp_layout))
    if fixed_layout is not None:
        base.replace(**fixed_layout).validate(spec)  # one line naming the problem, before any search

    per_rank = global_batch_size // world
    optims = _allowed_optimizers(base, allow_optimizers, keep_optimizer)
    if allow_pure_bf16 and base.precision == "bf16" and not base.uses_lora and not keep_optimizer:
        # A model already loaded in bf16 for full fine-tuning (the trainer passes its dtype): the same
        # stochastic-rounding optimizers as a pure-bf16 plan.
        base = base.replace(optim_args=optimizers.BF16_STOCHASTIC_ROUND_ARGS)
        optims = optimizers.PURE_BF16_LADDER
    liger = _liger_searched(spec, base, use_liger_kernel)
    # Offloading activation checkpoints is host offload too: searched on GPUs unless `--allow-offload none`.
    offload_acts = base.device == "cuda" and allow_offload != "none"
    grid = _with_activation_offload(_with_liger(_grid(base, per_rank, allow_offload, keep_optimizer, world,
                                                      fixed_layout, optims, _low_rank_targets(spec, base)),
                                                liger), offload_acts)
    candidates = [_evaluate(spec, s, usable, host, gpu_info) for s in grid]
    fitting = _fitting_last_resort_last(candidates)
    fast_total = fitting[0].estimate.device_total_bytes if fitting else 0
    fitting = _confirm_exact(spec, fitting, usable, host, everything=mode == "exact", progress=progress)
    pure_base = _pure_bf16_base(base, gpu_info, deepspeed_layout)
    if not fitting and allow_pure_bf16 and pure_base is not None:
        # Only once no mixed-precision plan fits: pure bf16 changes the numerics.
        pure = [_evaluate(spec, s, usable, host, gpu_info)
                for s in _with_activation_offload(_with_liger(_pure_bf16_grid(pure_base, per_rank), liger),
                                                  offload_acts)]
        candidates += pure
        fitting = _fitting_last_resort_last(pure)
        fast_total = fitting[0].estimate.device_total_bytes if fitting else 0
        fitting = _confirm_exact(spec, fitting, usable, host, everything=mode == "exact", progress=progress)
    if not fitting:
        raise MemFitError(_nothing_fits(spec, base, candidates, usable, budget, allow_offload, world, per_rank,
                                        host, optims, pure_bf16_base=pure_base if not allow_pure_bf16 else None))
    best = fitting[0]
    alternatives = _runners_up(best, fitting, candidates)
    ideal = _ideal_seconds(spec, best.settings, best.estimate, gpu_info)
    largest = max(spec.vocab_size * (spec.embedding_dim or spec.hidden_size),
                  max((m.weight_numel for m in spec.linear_modules(base.task, num_labels)), default=0))
    if best.settings.precision == "bf16" and base.precision != "bf16":
        precision_reason = _pure_bf16_reason(best, candidates, host)
    chosen = _make_plan(best, candidates, usable, budget, ideal, [precision_reason, attn_reason], nvme_path,
                        keep_optimizer, largest, host, fast_total)
    if best.settings.activation_offloading:
        chosen.reasons.append(_trl_offload_reason(spec, best, usable, host, gpu_info))
    return PlanResult(chosen, best.estimate, alternatives, len(candidates))


@dataclass(frozen=True)
class HostLimit:
    """Host RAM per node that offloaded and paged state must fit in, and where the figure came from."""

    bytes: int | None  # None: not checked
    source: str

    def check(self, est: MemoryEstimate) -> str:
        """'' when `est`'s host memory per node fits, else why not."""
        need = host_bytes_per_node(est)
        if self.bytes is None or need <= self.bytes:
            return ""
        return (f"needs {format_bytes(need)} of host memory per node, over the {format_bytes(self.bytes)} "
                f"of {self.source}")


def host_bytes_per_node(est: MemoryEstimate) -> int:
    """Host memory one node needs: each of its ranks holds `cpu_bytes` (offloaded or paged state)."""
    return est.cpu_bytes * est.settings.num_gpus


def _host_limit(cpu_memory, gpu_memory) -> HostLimit:
    """`--cpu-memory`: a size per node, `auto` (this machine's RAM), or `none`.

    Unset, it is `auto` when the plan is for this machine's own GPU (`--gpu-memory
    auto`, and always in `MemFitTrainer`), else not checked, and the plan says so.
    """
    if cpu_memory is None:
        planning_here = isinstance(gpu_memory, str) and gpu_memory.strip().lower() == "auto"
        cpu_memory = "auto" if planning_here else "none"
    if isinstance(cpu_memory, str) and cpu_memory.strip().lower() == "none":
        return HostLimit(None, "not checked: pass `--cpu-memory SIZE` per node, or `auto`")
    if isinstance(cpu_memory, str) and cpu_memory.strip().lower() == "auto":
        from hf_memfit.hardware import host_memory_auto

        return HostLimit(host_memory_auto(), "this machine's RAM (`--cpu-memory auto`)")
    return HostLimit(parse_bytes(cpu_memory, "--cpu-memory"), "`--cpu-memory` per node")


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


def _liger_searched(spec: ModelSpec, base: TrainSettings, use_liger_kernel: bool | None) -> bool:
    """Whether to search Liger's fused loss: a causal LM of a family it patches, installed or asked for, on a GPU."""
    from hf_memfit.settings import LIGER_MODEL_TYPES

    if use_liger_kernel is False or base.device != "cuda" or base.task != "causal-lm":
        return False
    if spec.model_type not in LIGER_MODEL_TYPES:
        return False
    return bool(use_liger_kernel) or importlib.util.find_spec("liger_kernel") is not None


def _fitting_last_resort_last(candidates: list[Candidate]) -> list[Candidate]:
    """The fitting candidates, fastest first; offloaded activation checkpoints only when nothing else fits.

    Offloaded checkpoints hold pinned host memory (one hidden state per layer per rank, which host RAM that is
    not checked may not have) and slow every step by copies on the compute stream; the speed model can rank
    them first on a bigger micro-batch, but the plan keeps them as a last resort and says what they would do.
    """
    fitting = sorted((c for c in candidates if c.fits), key=lambda c: c.step_seconds)
    on_device = [c for c in fitting if not c.settings.offload_activations]
    return on_device or fitting


def _with_activation_offload(grid, searched: bool):
    """Each configuration, and (when searched) its checkpointed ones with the checkpoints offloaded to the host."""
    for settings in grid:
        yield settings
        if searched and settings.gradient_checkpointing and not settings.activation_offloading:
            yield settings.replace(offload_activations=True)


def _with_liger(grid, liger: bool):
    """Each configuration, and (when searched) the same with Liger's fused linear cross-entropy."""
    for settings in grid:
        yield settings
        if liger:
            yield settings.replace(use_liger_kernel=True)


def _target_modules(targets) -> tuple[str, ...] | None:
    """TrainingArguments.optim_target_modules ("all-linear", "q_proj,v_proj" or a list) as a tuple."""
    if not targets:
        return None
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    return tuple(targets)


def _allowed_optimizers(base: TrainSettings, allowed: tuple[str, ...], keep_optimizer: bool) -> tuple[str, ...]:
    """The optimizers to search: the AdamW ladder (unless kept), plus those the user allowed."""
    if keep_optimizer:
        return (base.optim,)
    ladder = ADAM_LADDER if base.device == "cuda" else CPU_ADAM_LADDER
    optims = ladder if base.optim in ADAM_LADDER else (base.optim,)
    for name in allowed:
        o = optimizers.OPTIMIZERS[name]
        if o.low_rank and base.uses_lora:
            continue  # low-rank optimizers are for full fine-tuning
        if o.layerwise and base.world_size > 1:
            continue  # the Trainer refuses layerwise optimizers under DDP
        if name not in optims:
            optims += (name,)
    return optims


def _low_rank_targets(spec: ModelSpec, base: TrainSettings) -> tuple[str, ...]:
    """GaLore / APOLLO's `optim_target_modules` when the planner picks one: the layers' linear modules (attention
    and MLP), as both papers apply them."""
    return tuple(sorted({m.name for m in spec.linear_modules(base.task, base.num_labels) if m.scope == "layer"}))


def _pure_bf16_base(base: TrainSettings, gpu_info, fixed_layout) -> TrainSettings | None:
    """The base settings with bf16 weights, or None where pure bf16 cannot apply (LoRA, no bf16 GPU, ZeRO)."""
    if base.uses_lora or base.precision == "bf16" or fixed_layout is not None:
        return None
    if base.device == "cuda" and gpu_info is not None and not gpu_info.supports_bf16:
        return None
    return base.replace(precision="bf16", optim_args=optimizers.BF16_STOCHASTIC_ROUND_ARGS,
                        optim_target_modules=None)  # torchao's AdamW: a GaLore / APOLLO run's targets do not apply


def _pure_bf16_grid(pure: TrainSettings, per_rank: int):
    """Pure bf16: torchao's low-bit AdamW with stochastic rounding, no ZeRO (DeepSpeed keeps an fp32 master)."""
    for micro in [m for m in range(1, per_rank + 1) if per_rank % m == 0]:
        for checkpointing in (False, True):
            for optim in optimizers.PURE_BF16_LADDER:
                yield pure.replace(batch_size=micro, gradient_accumulation_steps=per_rank // micro,
                                   gradient_checkpointing=checkpointing, optim=optim)


def _pure_bf16_reason(best: "Candidate", candidates: list["Candidate"], host: "HostLimit") -> str:
    """Why the plan dropped the fp32 master weights, and why stochastic rounding."""
    mixed = [c for c in candidates if c.settings.precision != "bf16"]
    host_bound = [c for c in mixed if "host memory" in c.why_not]
    why = "no mixed-precision plan fits"
    if host_bound and host.bytes is not None:
        least = min(host_bound, key=lambda c: host_bytes_per_node(c.estimate))
        why += (f": those that fit the GPU need at least {format_bytes(host_bytes_per_node(least.estimate))} of "
                f"host memory per node, over the {format_bytes(host.bytes)} of {host.source}")
    elif mixed:
        least = min(mixed, key=lambda c: c.estimate.device_total_bytes)
        why += f": the smallest needs {format_bytes(least.estimate.device_total_bytes)}"
    return (f"pure bf16 weights, allowed by `--allow-pure-bf16` ({why}): weights and gradients take 2 B/param and "
            f"there is no fp32 master copy, so {best.settings.optim} runs with "
            f"`optim_args=\"{optimizers.BF16_STOCHASTIC_ROUND_ARGS}\"`: without a master copy an update smaller than "
            "bf16's resolution (8 significant bits, ~0.4% of the weight) would be rounded away; stochastic "
            "rounding keeps it right on average; the weights load in bf16 and train with `bf16=False` (no "
            "autocast, which would run layer norms and softmax in fp32 over them)")


def _grid(base: TrainSettings, per_rank: int, allow_offload: str, keep_optimizer: bool, world: int,
          fixed_layout: dict | None = None, optims: tuple[str, ...] | None = None,
          low_rank_targets: tuple[str, ...] = ()):
    micro_batches = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
    if optims is None:
        optims = (base.optim,) if keep_optimizer or base.optim not in ADAM_LADDER else ADAM_LADDER
    if fixed_layout is not None:  # the user's own DeepSpeed or FSDP config: its optimizer section, if any, wins anyway
        for micro in micro_batches:
            for checkpointing in (False, True):
                yield base.replace(batch_size=micro, gradient_accumulation_steps=per_rank // micro,
                                   gradient_checkpointing=checkpointing, **fixed_layout)
        return
    for micro in micro_batches:
        for checkpointing in (False, True):
            for layout in _layouts(base, allow_offload, world):
                for optim in optims:
                    if (layout.get("zero_stage") or layout.get("fsdp")) and optim != "adamw_torch_fused":
                        continue  # sharded layouts already split the states; 8-bit states stay a plain-torch knob
                    low_rank = optimizers.OPTIMIZERS[optim].low_rank
                    if optimizers.OPTIMIZERS[optim].layerwise and (per_rank // micro > 1 or world > 1):
                        continue  # stepped inside backward: the Trainer refuses accumulation and DDP with them
                    yield base.replace(batch_size=micro, gradient_accumulation_steps=per_rank // micro,
                                       gradient_checkpointing=checkpointing, optim=optim, **layout,
                                       optim_target_modules=(base.optim_target_modules or low_rank_targets)
                                       if low_rank else None)


def _layouts(base: TrainSettings, allow_offload: str, world: int) -> list[dict]:
    """The data-parallel layouts the planner may choose from, as TrainSettings fields.

    Sharded layouts are GPU plans: on the CPU one process holds everything. FSDP runs
    as the Trainer runs it by default (FSDP2), under a distributed launch only (one
    GPU: DeepSpeed's offload covers it). DeepSpeed offload is not offered for 4-bit
    models; FSDP's CPU offload is (peft's "FSDP+QLoRA" recipe), and 4-bit weights are
    sharded with the quant storage in the compute dtype.
    """
    none = dict(zero_stage=0, offload_optimizer="none", offload_param="none", fsdp=None, fsdp_offload=False)
    layouts = [none]
    if base.device != "cuda":
        return layouts
    if world > 1:
        layouts += [none | dict(zero_stage=stage) for stage in (1, 2, 3)]
        layouts += [none | dict(fsdp="full_shard", fsdp_version=2), none | dict(fsdp="shard_grad_op", fsdp_version=2)]
    if allow_offload in ("cpu", "nvme"):
        if not base.load_in_4bit:
            layouts += [none | dict(zero_stage=2, offload_optimizer="cpu"), none | dict(zero_stage=3, offload_optimizer="cpu"),
                        none | dict(zero_stage=3, offload_optimizer="cpu", offload_param="cpu")]
        if world > 1:
            layouts += [none | dict(fsdp="full_shard", fsdp_version=2, fsdp_offload=True)]
    if allow_offload == "nvme" and not base.load_in_4bit:
        layouts += [none | dict(zero_stage=3, offload_optimizer="nvme", offload_param="nvme")]
    return layouts


def _evaluate(spec, settings: TrainSettings, usable: int, host: HostLimit, gpu_info) -> Candidate:
    est = estimate_settings(spec, settings)
    why = _why_not(est, usable, host)
    return Candidate(settings, est, step_seconds(spec, settings, est, gpu_info), not why, why)


def _why_not(est: MemoryEstimate, usable: int, host: HostLimit) -> str:
    """'' when the estimate fits the device and the host, else why not (with its numbers)."""
    if est.device_total_bytes > usable:
        return f"needs {format_bytes(est.device_total_bytes)}, over the {format_bytes(usable)} usable"
    return host.check(est)


# Fast mode agrees with exact mode to within a few percent on the device total
# (docs/benchmarks.md, "Fast vs exact"); a fast-mode choice closer to the budget
# than this is confirmed in exact mode before it is chosen.
CONFIRM_IN_EXACT_MARGIN = 0.05
# At most this many near-budget candidates are traced before giving up on them.
MAX_EXACT_CONFIRMATIONS = 5


def _confirm_exact(spec, fitting: list[Candidate], usable: int, host: HostLimit, *, everything: bool,
                   progress=None) -> list[Candidate]:
    """The fitting candidates, fastest first, with the first one confirmed in exact mode where needed.

    A candidate needs confirming when `everything` (plan --mode exact) or when its
    fast estimate is within CONFIRM_IN_EXACT_MARGIN of `usable`. A confirmed one
    carries its exact estimate; one that exact mode rejects is marked as not
    fitting, with the exact figure, so nothing printed later calls it a fit.
    """
    traced = 0
    for i, candidate in enumerate(fitting):
        if not everything and candidate.estimate.device_total_bytes <= (1 - CONFIRM_IN_EXACT_MARGIN) * usable:
            return fitting[i:]
        if traced == MAX_EXACT_CONFIRMATIONS:
            break
        if progress is not None:
            progress(f"confirming in exact mode: micro-batch {candidate.settings.batch_size}, "
                     f"fast estimate {format_bytes(candidate.estimate.device_total_bytes)} of "
                     f"{format_bytes(usable)} usable")
        exact = estimate_settings(spec, candidate.settings.replace(mode="exact"))
        traced += 1
        candidate.estimate = exact
        why = _why_not(exact, usable, host)
        if not why:
            return fitting[i:]
        candidate.fits, candidate.why_not = False, f"exact mode: {why}"
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
    return compute + optimizer + offload_param + offload_activations + comm


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
    return compute + est.trainable_params / settings.optimizer.cpu_params_per_s


def _ideal_seconds(spec: ModelSpec, settings: TrainSettings, est: MemoryEstimate, gpu_info) -> float:
    """The same step with one micro-batch, no checkpointing, no offload: the speed ceiling."""
    ideal = settings.replace(batch_size=settings.batch_size * settings.gradient_accumulation_steps,
                             gradient_accumulation_steps=1, gradient_checkpointing=False,
                             optim="adamw_torch_fused" if settings.optimizer_family != "sgd" else settings.optim,
                             zero_stage=0 if settings.world_size == 1 else settings.zero_stage,
                             offload_optimizer="none", offload_param="none", fsdp_offload=False)
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
    return (s.gradient_checkpointing, s.optim) + _layout_key(s) + (s.precision, s.use_liger_kernel, s.offload_activations)


def _layout_key(s: TrainSettings) -> tuple:
    return (s.zero_stage, s.offload_optimizer, s.offload_param, s.fsdp, s.fsdp_version, s.fsdp_offload)


def _difference(chosen: TrainSettings, other: TrainSettings) -> str:
    parts = []
    if other.batch_size != chosen.batch_size:
        parts.append(f"micro-batch {other.batch_size}")
    if other.gradient_checkpointing != chosen.gradient_checkpointing:
        parts.append("checkpointing " + ("on" if other.gradient_checkpointing else "off"))
    if other.optim != chosen.optim:
        parts.append(other.optim)
    if other.precision != chosen.precision:
        parts.append("pure bf16" if other.precision == "bf16" else other.precision)
    if other.use_liger_kernel != chosen.use_liger_kernel:
        parts.append("Liger " + ("on" if other.use_liger_kernel else "off"))
    if other.offload_activations != chosen.offload_activations:
        parts.append("activation offload " + ("on" if other.offload_activations else "off"))
    if _layout_key(other) != _layout_key(chosen):
        parts.append(_layout_text(other))
    return ", ".join(parts) or "same knobs"


def _layout_text(s: TrainSettings) -> str:
    if s.fsdp is not None:
        return f"FSDP{s.fsdp_version} {s.fsdp}" + (" + CPU offload" if s.fsdp_offload else "")
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
               nvme_path: str | None, keep_optimizer: bool, largest_param_numel: int, host: HostLimit,
               fast_total: int) -> Plan:
    s, est = best.settings, best.estimate
    reasons = [f"budget: {format_bytes(usable)} usable of {format_bytes(budget)}; plan peaks at "
               f"{format_bytes(est.device_total_bytes)} ({100 * est.device_total_bytes / usable:.0f}% of usable)"]
    if est.settings.mode == "exact":
        reasons.append(f"confirmed in exact mode (the real model traced on fake tensors): "
                       f"{format_bytes(est.device_total_bytes)}"
                       + (f"; the fastest fast-mode choice ({format_bytes(fast_total)}) was within "
                          f"{100 * CONFIRM_IN_EXACT_MARGIN:.0f}% of the budget" if fast_total else ""))
    if est.cpu_bytes:
        need = host_bytes_per_node(est)
        checked = (f"fits the {format_bytes(host.bytes)} of {host.source}" if host.bytes is not None
                   else host.source)
        reasons.append(f"host memory: {format_bytes(est.cpu_bytes)} per GPU, {format_bytes(need)} per node "
                       f"({s.num_gpus} GPU(s)); {checked}")
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
    if s.offload_optimizer != "none":
        reasons.append(f"optimizer: DeepSpeed's {OFFLOADED_OPTIMIZER} on the host ({s.offload_optimizer} offload), from "
                       "the config's `optimizer` section; the Trainer's `optim` is not used")
    else:
        reasons.append(_optimizer_reason(s, candidates, keep_optimizer))
    activation_reason = _activation_offload_reason(best, candidates)
    if activation_reason:
        reasons.append(activation_reason)
    if s.use_liger_kernel:
        plain = _lookup(candidates, s.replace(use_liger_kernel=False))
        detail = (f"; without it the peak would be {format_bytes(plain.estimate.device_total_bytes)}"
                  if plain is not None and not plain.fits else
                  "; it fits without it too, but only with a smaller micro-batch or more recompute"
                  if plain is not None else "")
        reasons.append("Liger fused linear cross-entropy (`use_liger_kernel=True`): the loss runs over chunks of "
                       "tokens and never materialises the logits or their fp32 copies" + detail)
    reasons.append(attn_reason)
    allocator_reason = _expandable_segments_reason(est)
    if allocator_reason:
        reasons.append(allocator_reason)
    if s.zero_stage or s.fsdp is not None:
        plain = _lookup(candidates, s.replace(zero_stage=0, offload_optimizer="none", offload_param="none", fsdp=None,
                                              fsdp_offload=False))
        detail = (f"; without it the peak would be {format_bytes(plain.estimate.device_total_bytes)}"
                  if plain is not None and not plain.fits else "")
        engine = "DeepSpeed " if s.zero_stage else ""
        reasons.append(f"{engine}{_layout_text(s)}{detail}")
    elif s.world_size > 1:
        reasons.append("DDP: model states fit on every GPU, so no sharding traffic")
    deepspeed = fsdp = None
    if s.fsdp is not None:
        from hf_memfit.planner.accelerate import trainer_fsdp_arguments

        fsdp = trainer_fsdp_arguments(s)
    if s.zero_stage:
        from hf_memfit.planner.deepspeed import deepspeed_config

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
        # Pure bf16 weights train without autocast, as estimated: `bf16=True` would make the Trainer
        # autocast over them, and CUDA autocast runs its float32 ops (layer_norm, softmax, ...) in fp32.
        # Under ZeRO the flag fills DeepSpeed's `bf16.enabled: "auto"` instead, and DeepSpeed's bf16
        # mode does not autocast (the step is traced so: sharding.py).
        bf16=s.precision == "bf16-mixed" or (s.precision == "bf16" and s.zero_stage > 0),
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
        fsdp=fsdp,
        optim_args=s.optim_args,
        use_liger_kernel=s.use_liger_kernel,
        offload_activations=s.offload_activations,
        optim_target_modules=list(s.optim_target_modules) if s.optim_target_modules else None,
    )


def _trl_offload_reason(spec, best: Candidate, usable: int, host: "HostLimit", gpu_info) -> str:
    """What TRL's `activation_offloading` (as the run sets it) does to this plan: host memory, GPU freed, PCIe time."""
    s, est = best.settings, best.estimate
    without = _evaluate(spec, s.replace(activation_offloading=False), usable, host, gpu_info)
    freed = without.estimate.device_total_bytes - est.device_total_bytes
    copy_s = best.step_seconds - without.step_seconds
    if freed > 0:
        effect = f"it frees {format_bytes(freed)} on the GPU" + ("" if without.fits else
                                                                   ", which this micro-batch needs")
    else:  # the stash and the tensors it keeps (saved twice, small) outweigh what it moves at this peak
        effect = f"at this peak it frees nothing on the GPU ({format_bytes(-freed)} more than without)"
    return (f"TRL activation_offloading (as set): {format_bytes(est.cpu_bytes)} of saved activations in pinned host "
            f"memory per GPU; {effect}; its PCIe copies cost about {copy_s:.2f} s per step "
            f"({100 * copy_s / best.step_seconds:.0f}% of the step)" +
            ("" if freed > 0 else "; it does not pay here: set `activation_offloading=False`"))


def _activation_offload_reason(best: Candidate, candidates) -> str:
    """Why the checkpoints are (or are not) offloaded to the host: what it frees on the GPU and what the copies cost."""
    s = best.settings
    if not s.gradient_checkpointing:
        return ""
    other = _lookup(candidates, s.replace(offload_activations=not s.offload_activations))
    if other is None:
        return ""
    on, off = (best, other) if s.offload_activations else (other, best)
    freed = off.estimate.device_total_bytes - on.estimate.device_total_bytes
    copy_s = on.step_seconds - off.step_seconds
    share = f"{100 * copy_s / on.step_seconds:.0f}% of the step"
    if s.offload_activations:
        why = (f"without it the peak would be {format_bytes(off.estimate.device_total_bytes)}" if not off.fits else
               "it lets this micro-batch fit")
        return (f"activation checkpoints offloaded to pinned host memory (`activation_checkpointing_kwargs="
                f"{{\"offload\": True}}`): {why}; it frees {format_bytes(freed)} on the GPU and costs "
                f"{copy_s:.2f} s of PCIe copies per step ({share})")
    if freed <= 0:
        return ""
    return (f"activation checkpoints stay on the GPU: offloading them would free {format_bytes(freed)} but add "
            f"{copy_s:.2f} s of PCIe copies per step ({share}) on the compute stream and pin host memory, and a "
            "plan fits without it")


# The plan recommends expandable segments when the caching allocator's predicted slack is more than this share
# of the peak: a planning threshold, the same 5% by which the estimator's two modes are held to agree.
EXPANDABLE_SEGMENTS_HINT_SHARE = 0.05


def _expandable_segments_reason(est: MemoryEstimate) -> str:
    """A reason recommending PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True where fragmentation is predicted."""
    from hf_memfit.estimator.cuda_overhead import EXPANDABLE_SEGMENTS_SLACK_BYTES

    s = est.settings
    slack = est.peak_reserved_bytes - est.peak_allocated_bytes
    if s.device != "cuda" or s.expandable_segments or slack <= EXPANDABLE_SEGMENTS_HINT_SHARE * est.device_total_bytes:
        return ""
    return (f"allocator: {format_bytes(slack)} of the peak is the caching allocator's predicted fragmentation; "
            f"set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to cut it to about "
            f"{format_bytes(EXPANDABLE_SEGMENTS_SLACK_BYTES)} (`--expandable-segments` plans with it)")


def _optimizer_reason(s: TrainSettings, candidates, keep_optimizer: bool) -> str:
    """Why this optimizer: what its state costs per parameter, and what the faster one would have needed."""
    o = s.optimizer
    if keep_optimizer:
        return f"optimizer {s.optim}: kept as asked (`--keep-optimizer`)"
    if s.optim == "adamw_torch_fused":
        return "optimizer adamw_torch_fused: full-precision AdamW states fit; the fastest step"
    library = {"bnb": "bitsandbytes", "torchao": "torchao", "galore": "galore-torch",
               "apollo": "apollo-torch"}.get(o.implementation, o.implementation)
    if o.family in ("adam8bit", "adam4bit"):
        what = f"{o.state_bits}-bit AdamW states ({library}) take ~{2 * o.state_bits / 8:g} B/param instead of 8"
    elif o.low_rank:
        what = (f"{o.name} ({library}; it changes the training dynamics, so it is used only when the run asks for "
                f"it or `--allow-optimizers` names it) keeps AdamW states only for a rank-"
                f"{optimizers.low_rank_rank(s.optim_args)} projection of the gradients of "
                f"{', '.join(s.optim_target_modules or ())}")
        if o.layerwise:
            what += ("; layerwise: each parameter is stepped by its own optimizer inside backward and its gradient "
                     "freed at once, so the whole model's gradients are never held together (which is why it "
                     "needs gradient accumulation 1 and one GPU)")
    elif o.family == "adafactor":
        what = "Adafactor (allowed by `--allow-optimizers`) keeps factored row and column second moments, no momentum"
    else:
        what = f"{o.name}"
    # The faster optimizers of the ladder that did not fit this configuration, the nearest one named.
    ladder = optimizers.PURE_BF16_LADDER if s.precision == "bf16" and s.optim_args else ADAM_LADDER
    earlier = ladder[:ladder.index(s.optim)] if s.optim in ladder else ("adamw_torch_fused",)
    detail = ""
    for name in reversed(earlier):
        c = _lookup(candidates, s.replace(optim=name, optim_target_modules=None))
        if c is not None and not c.fits:
            detail = f"; {name} would need {format_bytes(c.estimate.device_total_bytes)}"
            break
    return f"optimizer {s.optim}: {what}{detail}"


def _nothing_fits(spec, base: TrainSettings, candidates, usable: int, budget: int, allow_offload: str, world: int,
                  per_rank: int, host: HostLimit, optims: tuple[str, ...], *,
                  pure_bf16_base: TrainSettings | None = None) -> str:
    """The one-line error when no candidate fits: what binds (device or host), and which remedies would fit.

    Remedies are tried from the least to the most change to the training: offload,
    more GPUs, LoRA, QLoRA, more host memory, then a shorter sequence (the longest
    that fits). Each is checked with the same estimator and the same device and
    host limits as the plan, over the same optimizers, so every suggestion printed
    is one that fits.
    """
    smallest = min(candidates, key=lambda c: c.estimate.device_total_bytes)
    on_device = [c for c in candidates if c.estimate.device_total_bytes <= usable]
    on_gpu = base.device == "cuda"
    optims = tuple(o for o in optims if not optimizers.OPTIMIZERS[o].low_rank)  # no targets to project here
    if base.optimizer.low_rank:  # the run's own GaLore / APOLLO: the remedies are searched over AdamW instead
        base = base.replace(optim="adamw_torch_fused", optim_target_modules=None)
        optims = optims or ADAM_LADDER
    lean = dict(gradient_checkpointing=True, zero_stage=0, offload_optimizer="none", offload_param="none")
    offload = dict(zero_stage=3, offload_optimizer="cpu", offload_param="cpu", optim="adamw_torch_fused")

    def best_fit(global_batch: int = per_rank * world, **changes) -> MemoryEstimate | None:
        """The smallest fitting footprint with `changes`: micro-batch 1 or the whole per-rank batch, each optimizer."""
        settings = base.replace(**{**lean, **changes})
        ranks = settings.world_size
        choices = (settings.optim,) if "optim" in changes else optims
        # The plan also offloads activation checkpoints as a last resort wherever host offload is allowed.
        offloads = (False, True) if on_gpu and (allow_offload != "none" or "offload_optimizer" in changes) else (False,)
        fitting = []
        for optim in choices:
            for micro in sorted({1, global_batch // ranks}):
                for offload_activations in offloads:
                    trial = settings.replace(optim=optim, batch_size=micro, offload_activations=offload_activations,
                                             gradient_accumulation_steps=global_batch // ranks // micro)
                    est = estimate_settings(spec, trial)
                    if not _why_not(est, usable, host):
                        fitting.append(est)
        return min(fitting, key=lambda e: e.device_total_bytes, default=None)

    if on_device:  # the GPU could hold some of them: host memory is what binds
        lightest = min(on_device, key=lambda c: host_bytes_per_node(c.estimate))
        head = (f"nothing fits: {_difference_text(lightest.settings)} would take "
                f"{format_bytes(lightest.estimate.device_total_bytes)} of the {format_bytes(usable)} usable on the GPU, "
                f"but it {lightest.why_not}")
    else:
        head = (f"nothing fits in {format_bytes(usable)} ({format_bytes(budget)} less headroom): the smallest "
                f"footprint found is {format_bytes(smallest.estimate.device_total_bytes)} "
                f"({_difference_text(smallest.settings)})")
    helps = []
    if pure_bf16_base is not None:
        # The least change that keeps a full fine-tune: bf16 weights, no fp32 master (see `_pure_bf16_grid`).
        fits = [c for c in (_evaluate(spec, s, usable, host, None)
                            for s in _pure_bf16_grid(pure_bf16_base, per_rank)
                            if s.batch_size in (1, per_rank)) if c.fits]
        if fits:
            least = min(fits, key=lambda c: c.estimate.device_total_bytes)
            helps.append(f"`--allow-pure-bf16` ({format_bytes(least.estimate.device_total_bytes)}: bf16 weights, "
                         f"{least.settings.optim} with bf16 stochastic rounding"
                         + (", no host memory" if not least.estimate.cpu_bytes else "") + ")")
    remedies: list[tuple[str, dict]] = []
    if on_gpu and allow_offload == "none" and not base.load_in_4bit:
        remedies.append(("`--allow-offload cpu`", offload))
    if on_gpu and base.num_nodes == 1 and not base.load_in_4bit:  # 4-bit weights are not partitioned by ZeRO-3
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
    for text, changes in remedies:
        if "num_gpus" in changes and any("--num-gpus" in h for h in helps):
            continue  # the fewest GPUs that fit is enough to name
        est = best_fit(**changes)
        if est is not None:
            helps.append(f"{text} ({format_bytes(est.device_total_bytes)})")
    if on_device and host.bytes is not None:
        need = min(host_bytes_per_node(c.estimate) for c in on_device)
        helps.append(f"a node with at least {format_bytes(need)} of RAM (`--cpu-memory {math.ceil(need / GiB)}GiB`)")
    # A shorter sequence changes the data, so it comes last: alone (with offload where the
    # user allowed it), then, only if nothing else fits, together with offload or QLoRA.
    # It shrinks activations only, so it cannot help when host memory binds.
    can_offload = on_gpu and not base.load_in_4bit
    shorter = [("", [{}] + ([offload] if can_offload and allow_offload != "none" else []))]
    if can_offload and allow_offload == "none":
        shorter.append(("`--allow-offload cpu` with ", [offload]))
    if can_offload:
        shorter.append(("QLoRA with ", [qlora]))
    for prefix, variants in ([] if on_device else shorter):
        if prefix and helps:
            break
        found = _longest_fitting_seq(base.seq_len, lambda seq: _first_fit(best_fit, seq, variants))
        if found is not None:
            seq, est = found
            helps.append(f"{prefix}a shorter sequence `--seq-len {seq}` ({format_bytes(est.device_total_bytes)})")
    suggestion = "; ".join(helps) if helps else "a larger GPU"
    return f"{head}; what would fit: {suggestion}"


def _first_fit(best_fit, seq: int, variants: list[dict]) -> MemoryEstimate | None:
    fits = [est for changes in variants if (est := best_fit(seq_len=seq, **changes)) is not None]
    return min(fits, key=lambda e: e.device_total_bytes, default=None)


def _longest_fitting_seq(seq_len: int, fit, shortest: int = 16) -> tuple[int, MemoryEstimate] | None:
    """The longest sequence below `seq_len` for which `fit(seq)` finds a fit (a multiple of 16, or 64 above 256)."""
    low, est = seq_len // 2, None
    while low >= shortest and (est := fit(low)) is None:
        low //= 2
    if low < shortest:
        return None
    high = min(2 * low, seq_len)  # does not fit (or is the sequence asked for)
    step = 64 if low >= 256 else 16
    while high - low > step:  # bisect between a length that fits and one that does not
        mid = (low + high) // 2 // step * step
        if mid <= low:
            break
        trial = fit(mid)
        if trial is None:
            high = mid
        else:
            low, est = mid, trial
    return low, est


def _difference_text(s: TrainSettings) -> str:
    return (f"micro-batch {s.batch_size} x accumulation {s.gradient_accumulation_steps}, checkpointing "
            f"{'on' if s.gradient_checkpointing else 'off'}, {s.optim}, {_layout_text(s)}")

"""`plan()`: the fastest training configuration that fits a memory budget, with its reasons.

The search is exhaustive over a small grid, because fast-mode estimates cost
about a millisecond each: micro-batch (a divisor of the per-rank batch, so the
global batch is kept exactly) x gradient checkpointing x optimizer (within the
AdamW family) x layout: DDP, ZeRO-1/2/3 and PyTorch FSDP (full_shard,
shard_grad_op), with offload only as allowed. Precision and
attention are not searched: bf16 mixed where the GPU has bf16, else fp16 with
loss scaling; flash-attention-2 where installed and supported, else SDPA. Each
fitting candidate gets a predicted step time from the speed model (`speed.py`), and
the fastest wins. LoRA and the sequence length are never changed: they change
the training; when nothing fits, the error says that they would help.
"""

import functools
import importlib.util

from hf_memfit import optimizers
from hf_memfit.errors import MemFitError, NothingFits, check_all
from hf_memfit.estimator.assemble import fit_group
from hf_memfit.estimator.worker_pool import keeps_workers
from hf_memfit.models.spec import ModelSpec, resolve_model
from hf_memfit.planner.candidates import (
    Candidates,
    HostLimit,
    confirm_in_exact_mode,
    evaluate_candidate,
    needs_confirming,
)
from hf_memfit.planner.lazy_grid import search_grid
from hf_memfit.planner.explain import (
    make_plan,
    nothing_fits,
    pure_bf16_reason,
    runners_up,
    trl_offload_reason,
)
from hf_memfit.planner.grid import (
    allowed_optimizers,
    liger_searched,
    low_rank_targets,
    tiled_mlp_searched,
    parse_target_modules,
    pure_bf16_base,
    pure_bf16_grid,
    sequence_layout_variants,
    sequence_splits,
    settings_grid,
    with_activation_offload,
    with_liger,
    with_tiled_mlp,
)
from hf_memfit.planner.freezing import freeze_options, freeze_reason, freeze_remedy, newly_frozen
from hf_memfit.planner.result import PlanResult
from hf_memfit.planner.speed import ideal_seconds
from hf_memfit.settings import TrainSettings
from hf_memfit.units import parse_bytes


DEFAULT_HEADROOM = 0.05  # the fraction of the budget a plan keeps free (`--headroom`)


@keeps_workers  # the search's fits trace on workers whose caches stay warm from one fit to the next
def plan(model: str | ModelSpec, *, seq_len: int, global_batch_size: int, gpu_memory: str | int | None = None,
         gpu: str | None = None, task: str | None = None, num_labels: int = 2, num_gpus: int = 1, num_nodes: int = 1,
         lora_r: int | None = None, lora_alpha: int | None = None, lora_target_modules=None,
         lora_target_regex: str | None = None,
         load_in_4bit: bool = False, load_in_8bit: bool = False, allow_offload: str = "cpu", cpu_memory: str | int | None = None,
         nvme_path: str | None = None, headroom: float = DEFAULT_HEADROOM, keep_optimizer: bool = False,
         optim: str = "adamw_torch_fused", device: str = "cuda", mode: str = "fast",
         precision: str | None = None, deepspeed_layout: tuple[int, str, str] | None = None,
         fsdp_layout: tuple[str, int, bool] | None = None, bnb_4bit_use_double_quant: bool = True,
         bnb_4bit_quant_storage: str | None = None, allow_pure_bf16: bool = False, allow_optimizers=(),
         expandable_segments: bool = False, progress=None, use_liger_kernel: bool | None = None,
         attn_implementation: str | None = None, trainer: str = "trainer", padding_free: bool = False,
         reference_model: str | None = None, decoder_seq_len: int | None = None,
         activation_offloading: bool = False, optim_target_modules=None, optim_args: str | None = None,
         sp_size: int | str = "auto", cp_size: int | str = 1, confirm_in_exact: bool = True,
         tiled_mlp: bool | None = None, inputs: dict | None = None,
         prepare_model_for_kbit_training: bool | None = None, not_fitting: dict | None = None,
         ssm_kernels: str | None = None, allow_freeze: bool = False) -> PlanResult:
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
    `allow_freeze` lets the plan freeze the model's towers beside what it trains (a VLM's vision tower, a
    wav2vec2 / HuBERT feature encoder, Whisper's encoder; found by structure, `planner/freezing.py`) when no
    plan that trains every module fits; before pure bf16 when both are allowed.
    Liger's fused linear cross-entropy (same loss, no logits) is searched for the
    causal-LM families it patches when `liger_kernel` is installed, or when
    `use_liger_kernel` is True; False never searches it.
    `attn_implementation` pins the attention (the trainer passes the loaded
    model's); `trainer`, `padding_free`, `reference_model` and
    `decoder_seq_len` describe the step as `TrainSettings` does; so does
    `activation_offloading` (TRL's, kept as set: it is the user's choice).
    `optim_target_modules` / `optim_args` go with a GaLore / APOLLO `optim` the run
    already has (TrainingArguments' names; "all-linear" or module names). `inputs` holds the image / audio
    `TrainSettings` fields (image_size, images_per_sample, audio_seconds, label_len); for those tasks
    `seq_len` may be None (made from the inputs).
    `sp_size` / `cp_size` split each sequence over ranks: Ulysses (DeepSpeed) / context parallelism
    (FSDP2); a number fixes it, "auto" lets the plan search it (`grid.sequence_splits`: when the sequence is
    long or nothing fits without). The global batch is micro-batch x accumulation x world / (sp x cp).
    `tiled_mlp` searches ALST's TiledMLP: None (default) on a GPU once a row spans two shards of
    `hidden_size` tokens, True always, False never (it adds an MLP forward per step, so it is chosen only
    where it makes a plan fit or a larger micro-batch pay).
    `ssm_kernels` is the state-space kernel path a Mamba / hybrid model runs ("cuda": mamba-ssm and
    causal-conv1d; "torch": transformers' fallback); None: the kernels on a GPU, the fallback on the CPU.
    `confirm_in_exact=False` skips the exact-mode confirmation of near-budget choices (a search over
    many plans, such as `--seq-len max`, confirms only the one it returns).
    `not_fitting` (for such a search over lengths) maps settings, less their `seq_len`, to the shortest length
    at which they did not fit: those are left out at that length and longer (a setting's memory grows with the
    sequence), and those that do not fit here are added. When nothing fits and some were left out, the
    `NothingFits` says only that (the remedies are not searched).
    Raises `MemFitError` when the request is invalid, `NothingFits` (a `MemFitError`) when nothing fits,
    saying what would.
    """
    spec = model if isinstance(model, ModelSpec) else resolve_model(model)
    gpu_info = _gpu_info(gpu)
    budget = _budget(gpu_memory, gpu_info)
    usable = int(budget * (1 - headroom))
    world = num_gpus * num_nodes
    problems = []
    for name, value in (("sp-size", sp_size), ("cp-size", cp_size)):
        if str(value) != "auto" and not (str(value).isdigit() and int(value) > 0):
            problems.append(f"`--{name}` must be auto or a positive integer, got {value!r}")
    fixed_shards = 1
    if not problems:
        fixed_shards = (int(sp_size) if str(sp_size) != "auto" else 1) * (int(cp_size) if str(cp_size) != "auto" else 1)
    replicas = world // fixed_shards if world % fixed_shards == 0 else world
    if not 0 <= headroom < 1:
        problems.append(f"`--headroom` must be in [0, 1), got {headroom}")
    if allow_offload not in ("none", "cpu", "nvme"):
        problems.append(f"`--allow-offload` must be none, cpu or nvme; got {allow_offload!r}")
    if not isinstance(global_batch_size, int) or global_batch_size <= 0:
        problems.append(f"`--global-batch-size` must be a positive integer, got {global_batch_size!r}")
    elif global_batch_size % replicas:
        lower = global_batch_size // replicas * replicas
        over = (f"{world} GPUs ({num_gpus} x {num_nodes} nodes)" if replicas == world else
                f"{replicas} data-parallel replicas ({world} GPUs / {fixed_shards} sequence shards)")
        problems.append(f"`--global-batch-size {global_batch_size}` cannot be split over {over}; use a multiple of "
                        f"{replicas}" + (f", e.g. {lower} or {lower + replicas}" if lower else f", e.g. {replicas}"))
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
        precision, precision_reason = _precision(gpu_info, device, lora=bool(lora_r) and not (load_in_4bit or load_in_8bit))
    else:
        precision_reason = f"precision {precision}: as the model was loaded"
    if attn_implementation is None:
        attn, attn_reason = attention_choice(spec, gpu_info, device)
    else:
        attn, attn_reason = attn_implementation, f"attention {attn_implementation}: as the model was loaded"
    base = TrainSettings(
        batch_size=1, seq_len=seq_len, task=task, num_labels=num_labels, precision=precision, optim=optim,
        attn_implementation=attn, lora_r=lora_r, lora_alpha=lora_alpha,
        lora_target_modules=tuple(lora_target_modules) if lora_target_modules else None,
        lora_target_regex=lora_target_regex,
        load_in_4bit=load_in_4bit, load_in_8bit=load_in_8bit, num_gpus=num_gpus, num_nodes=num_nodes, device=device,
        gpu=gpu_info.name if gpu_info else None, mode="fast", expandable_segments=expandable_segments,
        bnb_4bit_use_double_quant=bnb_4bit_use_double_quant, bnb_4bit_quant_storage=bnb_4bit_quant_storage,
        prepare_model_for_kbit_training=prepare_model_for_kbit_training, trainer=trainer, padding_free=padding_free, reference_model=reference_model, decoder_seq_len=decoder_seq_len,
        activation_offloading=activation_offloading, optim_args=optim_args,
        optim_target_modules=parse_target_modules(optim_target_modules), ssm_kernels=ssm_kernels, **(inputs or {}),
    ).validate(spec)
    fixed_layout = None
    if deepspeed_layout is not None and fsdp_layout is not None:
        raise MemFitError("a run shards with DeepSpeed or with FSDP, not both: drop one of the two configs")
    if deepspeed_layout is not None:
        fixed_layout = dict(zip(("zero_stage", "offload_optimizer", "offload_param"), deepspeed_layout))
    elif fsdp_layout is not None:
        fixed_layout = dict(zip(("fsdp", "fsdp_version", "fsdp_offload"), fsdp_layout))
    if fixed_shards > 1:
        base = base.replace(sp_size=int(sp_size) if str(sp_size) != "auto" else 1,
                            cp_size=int(cp_size) if str(cp_size) != "auto" else 1)
    if fixed_layout is not None:
        base.replace(**fixed_layout).validate(spec)  # one line naming the problem, before any search
    elif fixed_shards > 1:  # the sequence checks of a layout it can run under, named in one line
        base.replace(**sequence_layout_variants(base, "none", {})[0]).validate(spec)

    per_rank = global_batch_size // base.dp_size
    optims = allowed_optimizers(base, allow_optimizers, keep_optimizer)
    if allow_pure_bf16 and base.precision == "bf16" and not base.uses_lora and not keep_optimizer:
        # A model already loaded in bf16 for full fine-tuning (the trainer passes its dtype): the same
        # stochastic-rounding optimizers as a pure-bf16 plan.
        base = base.replace(optim_args=optimizers.BF16_STOCHASTIC_ROUND_ARGS)
        optims = optimizers.PURE_BF16_LADDER
    liger = liger_searched(spec, base, use_liger_kernel)
    # Offloading activation checkpoints is host offload too: searched on GPUs unless `--allow-offload none`.
    offload_acts = base.device == "cuda" and allow_offload != "none"
    tiled = tiled_mlp_searched(spec, base, tiled_mlp)

    left_out = []

    def estimate_one(s: TrainSettings):
        """A candidate, or None for settings `not_fitting` leaves out (they did not fit at a shorter sequence)."""
        key = s.replace(seq_len=None) if not_fitting is not None else None
        if key is not None and not_fitting.get(key, seq_len + 1) <= seq_len:
            left_out.append(s)
            return None
        candidate = evaluate_candidate(spec, s, usable, host, gpu_info)
        if key is not None and not candidate.fits:
            not_fitting[key] = min(not_fitting.get(key, seq_len), seq_len)
        return candidate

    candidates = Candidates(estimate_one, functools.partial(fit_group, spec))

    def uncertain(candidate) -> bool:  # one `confirmed` will trace before choosing it
        return confirm_in_exact and needs_confirming(candidate, usable, everything=mode == "exact")

    def search(grid) -> tuple[list, int]:
        return search_grid(spec, list(grid), candidates, gpu_info=gpu_info, uncertain=uncertain)

    def grid_of(splits, base=base):
        for sp, cp in splits:
            split = base.replace(sp_size=sp, cp_size=cp)
            grid = with_tiled_mlp(with_activation_offload(with_liger(
                settings_grid(split, global_batch_size // split.dp_size, allow_offload, keep_optimizer, world,
                              fixed_layout, optims, low_rank_targets(spec, base)), liger), offload_acts), tiled)
            if split.sp_size > 1 and split.device == "cpu":
                # On the CPU, DeepSpeed's UlyssesSPDataLoaderAdapter leaves each rank's shard a non-contiguous slice
                # (its `.cpu()` copies only device tensors) and transformers' ForCausalLMLoss `.view`s it: 2+ rows fail
                grid = (s for s in grid if s.batch_size == 1)
            yield from grid

    splits = sequence_splits(spec, base, sp_size, cp_size, global_batch_size, nothing_fits_without=False)
    fitting, fast_total = search(grid_of(splits))
    if not fitting and splits == [(1, 1)]:  # "auto": split the sequence when nothing fits whole
        more = [p for p in sequence_splits(spec, base, sp_size, cp_size, global_batch_size, nothing_fits_without=True)
                if p != (1, 1)]
        if more:
            fitting, fast_total = search(grid_of(more))
            splits = splits + more

    def confirmed(fitting):
        if confirm_in_exact:
            fitting = confirm_in_exact_mode(spec, fitting, usable, host, everything=mode == "exact", progress=progress)
        if not fitting:  # exact mode rejected what fast mode fitted: the refusal sees every candidate
            candidates.where(lambda s: True)
        return fitting

    fitting = confirmed(fitting)
    frozen_sets = freeze_options(spec, base, allow_freeze)
    for frozen in frozen_sets if not fitting else ():
        # Only once nothing fits with every module trained: freezing a tower changes what is trained.
        fitting, fast_total = search(grid_of(splits, base.replace(frozen=frozen)))
        if fitting := confirmed(fitting):
            break
    pure_base = pure_bf16_base(base, gpu_info, deepspeed_layout)
    pure_bases = [pure_base] + [pure_base.replace(frozen=f) for f in frozen_sets] if pure_base is not None else []
    for pure_base_i in pure_bases if not fitting and allow_pure_bf16 else ():
        # Only once no mixed-precision plan fits: pure bf16 changes the numerics (then with frozen towers).
        fitting, fast_total = search(with_tiled_mlp(with_activation_offload(with_liger(
            pure_bf16_grid(pure_base_i, per_rank), liger), offload_acts), tiled))
        if fitting := confirmed(fitting):
            break
    if not fitting and left_out:
        raise NothingFits(f"nothing fits at {seq_len:,} tokens: {len(left_out)} settings left out did not fit at a "
                          f"shorter sequence, and the {len(candidates)} others do not fit")
    if not fitting:
        freeze_help = None
        if not allow_freeze:  # name `--allow-freeze` where it would fit: the grid at the smallest micro-batch
            freeze_help = freeze_remedy(spec, base, lambda b: (s for s in settings_grid(
                b, per_rank, allow_offload, keep_optimizer, world, fixed_layout, optims, low_rank_targets(spec, b))
                if s.batch_size == 1),
                lambda s: evaluate_candidate(spec, s, usable, host, gpu_info))
        raise NothingFits(nothing_fits(spec, base, candidates, usable, budget, allow_offload, world, per_rank,
                                        host, optims, pure_bf16_base=pure_base if not allow_pure_bf16 else None,
                                        liger=liger, more_helps=[freeze_help] if freeze_help else []))
    best = fitting[0]
    alternatives = runners_up(best, fitting, candidates)
    ideal = ideal_seconds(spec, best.settings, best.estimate, gpu_info)
    largest = max(spec.vocab_size * (spec.embedding_dim or spec.hidden_size),
                  max((m.weight_numel for m in spec.linear_modules(base.task, num_labels)), default=0))
    if best.settings.precision == "bf16" and base.precision != "bf16":
        precision_reason = pure_bf16_reason(best, candidates, host)
    if best.settings.cp_size > 1 and attn != "sdpa":
        attn_reason = f"attention sdpa: context parallelism patches SDPA with ring attention ({attn} cannot)"
    chosen = make_plan(best, candidates, usable, budget, ideal, [precision_reason, attn_reason], nvme_path,
                        keep_optimizer, largest, host, fast_total)
    if best.settings.activation_offloading:
        chosen.reasons.append(trl_offload_reason(spec, best, usable, host, gpu_info))
    if newly_frozen(base, best.settings):
        chosen.reasons.append(freeze_reason(spec, best, candidates, base))
    return PlanResult(chosen, best.estimate, alternatives, len(candidates), candidates.searched)


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


# LoRA freezes the base, so the base needs no fp32 copy: stored in bf16 it computes as it would under bf16
# autocast, and the adapters still train in fp32 (peft's `autocast_adapter_dtype`). It is how LoRA is run
# (transformers 5's `from_pretrained` loads the checkpoint's dtype, bf16 for current models, by default; the
# recipes load it so: integrations/recipe.py), and an fp32 base doubles the weights for nothing.
LORA_BF16_BASE_REASON = ("bf16 base weights under LoRA: the frozen base needs no fp32 copy, and the adapters train "
                         "in fp32 (peft's default); load the model with `dtype=torch.bfloat16` (transformers 5's "
                         "default `dtype=\"auto\"` does for a bf16 checkpoint)")


def _precision(gpu_info, device: str, *, lora: bool = False) -> tuple[str, str]:
    """The precision a plan trains in when the caller did not fix it, and its one-line reason."""
    if device == "cpu":
        return "fp32", "fp32: planning for the CPU, where mixed precision is rarely faster"
    if lora and (gpu_info is None or gpu_info.supports_bf16):
        assumed = " (assuming an Ampere-or-newer GPU: pass `--gpu NAME` to be specific)" if gpu_info is None else ""
        return "bf16", LORA_BF16_BASE_REASON + assumed
    if gpu_info is None:
        return "bf16-mixed", "bf16 mixed precision: assuming an Ampere-or-newer GPU (pass `--gpu NAME` to be specific)"
    if gpu_info.supports_bf16:
        return "bf16-mixed", f"bf16 mixed precision: the {gpu_info.name} has bf16 tensor cores"
    return "fp16-mixed", f"fp16 mixed precision with loss scaling: the {gpu_info.name} has no bf16"


def attention_choice(spec: ModelSpec, gpu_info, device: str) -> tuple[str, str]:
    """The attention implementation a plan loads the model with, and its one-line reason."""
    if not spec.sdpa:  # as transformers builds it; asking it for SDPA would raise
        return "eager", (f"attention eager: transformers builds `{spec.model_type}` with eager only"
                         + (" (its state-space mixers have no attention)" if spec.ssm_mixers else ""))
    if device == "cpu":
        return "sdpa", "attention sdpa: the CPU's fused SDPA kernel"
    flash_ok = gpu_info is None or gpu_info.supports_flash_attention
    if flash_ok and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2", "attention flash_attention_2: installed and supported by the GPU"
    if flash_ok:
        return "sdpa", "attention sdpa (its flash kernel): flash-attn is not installed, SDPA keeps the same O(s) memory"
    return "sdpa", "attention sdpa (memory-efficient kernel): this GPU predates flash attention (sm80+)"

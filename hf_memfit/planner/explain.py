"""The reasons a plan gives for each knob it turned, and the remedies a refusal names, with numbers."""

import math

from hf_memfit import optimizers
from hf_memfit.errors import MemFitError
from hf_memfit.estimator.assemble import MemoryEstimate, estimate_settings
from hf_memfit.planner.candidates import (
    CONFIRM_IN_EXACT_MARGIN,
    Candidate,
    Candidates,
    HostLimit,
    evaluate_candidate,
    host_bytes_per_node,
    why_not_fits,
)
from hf_memfit.planner.grid import ADAM_LADDER, CPU_ADAM_LADDER, liger_searched, low_rank_targets, pure_bf16_grid
from hf_memfit.planner.result import OFFLOADED_OPTIMIZER, Plan
from hf_memfit.settings import TrainSettings
from hf_memfit.units import GiB, format_bytes


def pure_bf16_reason(best: "Candidate", candidates: list["Candidate"], host: "HostLimit") -> str:
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


def runners_up(best: Candidate, fitting: list[Candidate], candidates: list[Candidate]) -> list[Candidate]:
    """Two fitting runners-up that differ in a knob, and the closest configuration that did not fit."""
    picked = runner_up_picks(fitting)
    for c in picked:
        c.why_not = f"{100 * (c.step_seconds / best.step_seconds - 1):.0f}% slower: {difference(best.settings, c.settings)}"
    # Those that would be the plan had they fit: not a last resort (offloaded activations) beside a plan on the device
    faster_misfits = [c for c in candidates if not c.fits and c.step_seconds < best.step_seconds
                      and (best.settings.offload_activations or not c.settings.offload_activations)]
    if faster_misfits:
        closest = min(faster_misfits, key=lambda c: c.estimate.device_total_bytes)
        picked.append(closest)
    return picked


RUNNERS_UP = 2


def runner_up_picks(fitting: list[Candidate]) -> list[Candidate]:
    """The fitting runners-up a plan lists after `fitting[0]`: the fastest ones whose knobs differ from the plan's
    and from each other's."""
    picked: list[Candidate] = []
    seen = {knobs(fitting[0].settings)} if fitting else set()
    for c in fitting[1:]:
        if len(picked) == RUNNERS_UP:
            break
        if knobs(c.settings) not in seen:
            picked.append(c)
            seen.add(knobs(c.settings))
    return picked


def knobs(s: TrainSettings) -> tuple:
    return (s.gradient_checkpointing, s.optim) + layout_key(s) + (s.precision, s.use_liger_kernel, s.offload_activations,
                                                                    s.tiled_mlp, s.frozen)


def layout_key(s: TrainSettings) -> tuple:
    return (s.zero_stage, s.offload_optimizer, s.offload_param, s.fsdp, s.fsdp_version, s.fsdp_offload, s.sp_size,
            s.cp_size)


def lever_differences(chosen: TrainSettings, other: TrainSettings) -> list[str]:
    """The precision and levers where `other` differs from `chosen` (a runner-up's label names the rest)."""
    parts = []
    if other.precision != chosen.precision:
        parts.append("pure bf16" if other.precision == "bf16" else other.precision)
    if other.use_liger_kernel != chosen.use_liger_kernel:
        parts.append("Liger " + ("on" if other.use_liger_kernel else "off"))
    if other.offload_activations != chosen.offload_activations:
        parts.append("activation offload " + ("on" if other.offload_activations else "off"))
    if other.tiled_mlp != chosen.tiled_mlp:
        parts.append("tiled MLP " + ("on" if other.tiled_mlp else "off"))
    return parts


def difference(chosen: TrainSettings, other: TrainSettings) -> str:
    parts = []
    if other.batch_size != chosen.batch_size:
        parts.append(f"micro-batch {other.batch_size}")
    if other.gradient_checkpointing != chosen.gradient_checkpointing:
        parts.append("checkpointing " + ("on" if other.gradient_checkpointing else "off"))
    if other.optim != chosen.optim:
        parts.append(other.optim)
    parts += lever_differences(chosen, other)
    if other.frozen != chosen.frozen:
        parts.append("frozen: " + ", ".join(other.frozen) if other.frozen else "nothing frozen")
    if layout_key(other) != layout_key(chosen):
        parts.append(layout_text(other))
    return ", ".join(parts) or "same knobs"


def layout_text(s: TrainSettings) -> str:
    if s.seq_shards > 1:
        split = f"Ulysses SP {s.sp_size}" if s.sp_size > 1 else f"context parallel {s.cp_size}"
        return f"{split} x DP {s.dp_size}, " + layout_text(s.replace(sp_size=1, cp_size=1))
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


def make_plan(best: Candidate, candidates: Candidates, usable: int, budget: int, ideal_seconds: float, fixed_reasons: list[str],
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
    global_batch = s.batch_size * s.gradient_accumulation_steps * s.dp_size
    bigger = candidates.where(lambda o: o.batch_size > s.batch_size and knobs(o) == knobs(s))
    replicas = (f"{s.dp_size} data-parallel replica(s) ({s.world_size} GPUs / {s.seq_shards} sequence shards)"
                if s.seq_shards > 1 else f"{s.world_size} GPU(s)")
    batch_reason = f"micro-batch {s.batch_size} x accumulation {s.gradient_accumulation_steps} x {replicas} = global batch {global_batch}"
    if bigger:
        nxt = min(bigger, key=lambda c: c.settings.batch_size)
        batch_reason += (f"; micro-batch {nxt.settings.batch_size} would need {format_bytes(nxt.estimate.device_total_bytes)}"
                         if not nxt.fits else f"; micro-batch {nxt.settings.batch_size} fits but is predicted slower")
    reasons.append(batch_reason)
    if s.gradient_checkpointing:
        without = candidates.lookup(s.replace(gradient_checkpointing=False))
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
    if s.load_in_4bit:
        reasons.append("4-bit base prepared as peft's QLoRA recipe does (`prepare_model_for_kbit_training`: every weight "
                       "bitsandbytes leaves unpacked in fp32, a mixture of experts' fused experts included; an fp32 "
                       "residual stream); `--prepare-model-for-kbit-training no` "
                       "if the script does not call it" if s.kbit_prepared else
                       "4-bit base not prepared by peft (`prepare_model_for_kbit_training` not called: TRL's trainers, "
                       "DeepSpeed and FSDP skip it; `--prepare-model-for-kbit-training yes` if the script calls it)")
    if s.offload_optimizer != "none":
        reasons.append(f"optimizer: DeepSpeed's {OFFLOADED_OPTIMIZER} on the host ({s.offload_optimizer} offload), from "
                       "the config's `optimizer` section; the Trainer's `optim` is not used")
    else:
        reasons.append(optimizer_reason(s, candidates, keep_optimizer))
    activation_reason = activation_offload_reason(best, candidates)
    if activation_reason:
        reasons.append(activation_reason)
    if s.use_liger_kernel:
        plain = candidates.lookup(s.replace(use_liger_kernel=False))
        detail = (f"; without it the peak would be {format_bytes(plain.estimate.device_total_bytes)}"
                  if plain is not None and not plain.fits else
                  "; it fits without it too, but only with a smaller micro-batch or more recompute"
                  if plain is not None else "")
        reasons.append("Liger fused linear cross-entropy (`use_liger_kernel=True`): the loss runs over chunks of "
                       "tokens and never materialises the logits or their fp32 copies" + detail)
    if s.tiled_mlp:
        plain = candidates.lookup(s.replace(tiled_mlp=False))
        detail = (f"; without it the peak would be {format_bytes(plain.estimate.device_total_bytes)}"
                  if plain is not None and not plain.fits else "")
        reasons.append("tiled MLP (ALST's TiledMLP, `MemFitTrainer` applies it; elsewhere "
                       "`hf_memfit.apply_tiled_mlp(model)`): each layer's MLP runs in sequence shards of about "
                       "hidden_size tokens and its forward runs once more in backward" + detail)
    reasons.append(attn_reason)
    allocator_reason = expandable_segments_reason(est)
    if allocator_reason:
        reasons.append(allocator_reason)
    if s.seq_shards > 1:
        reasons.append(sequence_reason(best, candidates))
    if s.zero_stage or s.fsdp is not None:
        plain = candidates.lookup(s.replace(zero_stage=0, offload_optimizer="none", offload_param="none", fsdp=None,
                                              fsdp_offload=False))
        detail = (f"; without it the peak would be {format_bytes(plain.estimate.device_total_bytes)}"
                  if plain is not None and not plain.fits else "")
        engine = "DeepSpeed " if s.zero_stage else ""
        reasons.append(f"{engine}{layout_text(s)}{detail}")
    elif s.world_size > 1:
        reasons.append("DDP: model states fit on every GPU, so no sharding traffic")
    from hf_memfit.planner.accelerate import parallelism_config_kwargs

    deepspeed = fsdp = None
    if s.fsdp is not None:
        from hf_memfit.planner.accelerate import trainer_fsdp_arguments

        fsdp = trainer_fsdp_arguments(s)
    if s.zero_stage:
        from hf_memfit.planner.deepspeed import deepspeed_config

        deepspeed = deepspeed_config(s.zero_stage, s.offload_optimizer, s.offload_param, nvme_path=nvme_path,
                                     precision=s.precision, largest_param_numel=largest_param_numel,
                                     sequence_parallel_size=s.sp_size)
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
        tiled_mlp=s.tiled_mlp,
        parallelism_config=parallelism_config_kwargs(s) or None,
        frozen=list(s.frozen) if s.frozen else None,
    )


def sequence_reason(best: Candidate, candidates: Candidates) -> str:
    """Why the plan splits each sequence over ranks (Ulysses SP or context parallelism), with its numbers."""
    s, est = best.settings, best.estimate
    whole = candidates.where(lambda o: o.seq_shards == 1)
    split = (f"Ulysses sequence parallelism over {s.sp_size} GPUs (DeepSpeed, `ParallelismConfig(sp_size="
             f"{s.sp_size}, sp_backend=\"deepspeed\")`)" if s.sp_size > 1 else
             f"context parallelism over {s.cp_size} GPUs (FSDP2 ring attention, `ParallelismConfig(cp_size={s.cp_size})`)")
    what = (f"each rank runs {s.local_seq_len} of the {s.seq_len} tokens of every row; activations "
            f"{format_bytes(est.breakdown['activations'])} per rank")
    fitting_whole = [c for c in whole if c.fits]
    if not fitting_whole:
        least = min(whole, key=lambda c: c.estimate.device_total_bytes, default=None)
        why = ("nothing fits with whole sequences" + (f": the smallest needs "
               f"{format_bytes(least.estimate.device_total_bytes)}" if least is not None else ""))
    else:
        fastest = min(fitting_whole, key=lambda c: c.step_seconds)
        why = (f"predicted {100 * (fastest.step_seconds / best.step_seconds - 1):.0f}% faster than the fastest plan "
               f"with whole sequences ({difference(s, fastest.settings)})")
    return f"{split}: {what}; {why}"


def trl_offload_reason(spec, best: Candidate, usable: int, host: "HostLimit", gpu_info) -> str:
    """What TRL's `activation_offloading` (as the run sets it) does to this plan: host memory, GPU freed, PCIe time."""
    s, est = best.settings, best.estimate
    without = evaluate_candidate(spec, s.replace(activation_offloading=False), usable, host, gpu_info)
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


def activation_offload_reason(best: Candidate, candidates: Candidates) -> str:
    """Why the checkpoints are (or are not) offloaded to the host: what it frees on the GPU and what the copies cost."""
    s = best.settings
    if not s.gradient_checkpointing:
        return ""
    counterpart = s.replace(offload_activations=not s.offload_activations)
    if not s.offload_activations and candidates.fit_group(counterpart) is not None:
        # Where fast mode is fitted to traces, offloaded checkpoints are a fit of their own (four traces of a cold
        # Jamba-v0.1 or Gemma-3 plan: docs/benchmarks.md, section 15), made for one line of a plan that does not
        # need them. Left to the estimator; the rule reads neither the cache nor what the search made, so a lazy and
        # an exhaustive search, and a warm and a cold plan, say the same.
        return ("activation checkpoints stay on the GPU: a plan fits without offloading them (`hf-memfit estimate` "
                "with `--offload-activations` says what offloading would free)")
    other = candidates.lookup(counterpart)
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


def expandable_segments_reason(est: MemoryEstimate) -> str:
    """A reason recommending PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True where fragmentation is predicted."""
    from hf_memfit.estimator.cuda_overhead import EXPANDABLE_SEGMENTS_SLACK_BYTES

    s = est.settings
    slack = est.peak_reserved_bytes - est.peak_allocated_bytes
    if s.device != "cuda" or s.expandable_segments or slack <= EXPANDABLE_SEGMENTS_HINT_SHARE * est.device_total_bytes:
        return ""
    return (f"allocator: {format_bytes(slack)} of the peak is the caching allocator's predicted fragmentation; "
            f"set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to cut it to about "
            f"{format_bytes(EXPANDABLE_SEGMENTS_SLACK_BYTES)} (`--expandable-segments` plans with it), and to keep "
            "batches of varying length from growing what the run reserves")


def optimizer_reason(s: TrainSettings, candidates: Candidates, keep_optimizer: bool) -> str:
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
        c = candidates.lookup(s.replace(optim=name, optim_target_modules=None))
        if c is not None and not c.fits:
            detail = f"; {name} would need {format_bytes(c.estimate.device_total_bytes)}"
            break
    return f"optimizer {s.optim}: {what}{detail}"


def nothing_fits(spec, base: TrainSettings, candidates, usable: int, budget: int, allow_offload: str, world: int,
                  per_rank: int, host: HostLimit, optims: tuple[str, ...], *,
                  pure_bf16_base: TrainSettings | None = None, liger: bool = True, more_helps=()) -> str:
    """The one-line error when no candidate fits: what binds (device or host), and which remedies would fit.

    Remedies are tried from the least to the most change to the training: the levers
    that keep it identical but were not searched (`--expandable-segments`, Liger's
    fused loss when it is not installed here, the AdamW ladder under `--keep-optimizer`),
    offload, more GPUs, an optimizer that changes the dynamics but keeps the full fine-tune
    (each one `--allow-optimizers` admits and the plan did not search, e.g.
    Adafactor), LoRA, QLoRA, more host memory, then a shorter sequence (the longest
    that fits). Each is checked with the same estimator and the same device and
    host limits as the plan, over the same optimizers, so every suggestion printed
    is one that fits.
    """
    smallest = min(candidates, key=lambda c: c.estimate.device_total_bytes)
    on_device = [c for c in candidates if c.estimate.device_total_bytes <= usable]
    on_gpu = base.device == "cuda"
    searched = optims
    optims = tuple(o for o in optims if not optimizers.OPTIMIZERS[o].low_rank)  # no targets to project here
    if base.optimizer.low_rank:  # the run's own GaLore / APOLLO: the remedies are searched over AdamW instead
        base = base.replace(optim="adamw_torch_fused", optim_target_modules=None)
        optims = optims or ADAM_LADDER
    lean = dict(gradient_checkpointing=True, zero_stage=0, offload_optimizer="none", offload_param="none")
    offload = dict(zero_stage=3, offload_optimizer="cpu", offload_param="cpu", optim="adamw_torch_fused")

    if base.sp_size > 1:  # Ulysses runs under DeepSpeed: the lean layout keeps ZeRO
        lean["zero_stage"] = max(1, base.zero_stage)
    if base.cp_size > 1:
        lean.update(zero_stage=0, fsdp="full_shard", fsdp_version=2)
        offload = dict(fsdp="full_shard", fsdp_version=2, fsdp_offload=True, zero_stage=0, optim="adamw_torch_fused")

    def best_fit(global_batch: int = per_rank * base.dp_size, **changes) -> MemoryEstimate | None:
        """The smallest fitting footprint with `changes`: micro-batch 1 or the whole per-rank batch, each optimizer."""
        settings = base.replace(**{**lean, **changes})
        try:
            settings.validate(spec)
        except MemFitError:
            return None  # a remedy this model or sequence cannot take (sp not dividing the heads, ...)
        ranks = settings.dp_size
        choices = (settings.optim,) if "optim" in changes else optims
        # The plan also offloads activation checkpoints as a last resort wherever host offload is allowed.
        offloads = (False, True) if on_gpu and (allow_offload != "none" or "offload_optimizer" in changes) else (False,)
        fitting = []
        for optim in choices:
            for micro in sorted({1, global_batch // ranks}):
                for offload_activations in offloads:
                    trial = settings.replace(optim=optim, batch_size=micro, offload_activations=offload_activations,
                                             gradient_accumulation_steps=global_batch // ranks // micro)
                    if optimizers.OPTIMIZERS[optim].layerwise and trial.gradient_accumulation_steps > 1:
                        continue  # the Trainer steps layerwise optimizers inside backward: no accumulation
                    est = estimate_settings(spec, trial)
                    if not why_not_fits(est, usable, host):
                        fitting.append(est)
        return min(fitting, key=lambda e: e.device_total_bytes, default=None)

    if on_device:  # the GPU could hold some of them: host memory is what binds
        lightest = min(on_device, key=lambda c: host_bytes_per_node(c.estimate))
        head = (f"nothing fits: {difference_text(lightest.settings)} would take "
                f"{format_bytes(lightest.estimate.device_total_bytes)} of the {format_bytes(usable)} usable on the GPU, "
                f"but it {lightest.why_not}")
    else:
        head = (f"nothing fits in {format_bytes(usable)} ({format_bytes(budget)} less headroom): the smallest "
                f"footprint found is {format_bytes(smallest.estimate.device_total_bytes)} "
                f"({difference_text(smallest.settings)})")
    helps = list(more_helps)  # remedies the caller checked (`--allow-freeze`: `planner/freezing.py`)
    if pure_bf16_base is not None:
        # The least change that keeps a full fine-tune: bf16 weights, no fp32 master (see `pure_bf16_grid`).
        fits = [c for c in (evaluate_candidate(spec, s, usable, host, None)
                            for s in pure_bf16_grid(pure_bf16_base, per_rank)
                            if s.batch_size in (1, per_rank)) if c.fits]
        if fits:
            least = min(fits, key=lambda c: c.estimate.device_total_bytes)
            helps.append(f"`--allow-pure-bf16` ({format_bytes(least.estimate.device_total_bytes)}: bf16 weights, "
                         f"{least.settings.optim} with bf16 stochastic rounding"
                         + (", no host memory" if not least.estimate.cpu_bytes else "") + ")")
    remedies: list[tuple[str, dict]] = []
    if on_gpu and not base.expandable_segments:
        remedies.append(("`--expandable-segments`", dict(expandable_segments=True)))
    if not liger and not base.use_liger_kernel and liger_searched(spec, base, True):
        remedies.append(("`--use-liger-kernel yes`", dict(use_liger_kernel=True)))  # installed where it will run
    ladder = ADAM_LADDER if on_gpu else CPU_ADAM_LADDER
    remedies += [(f"`--optim {name}`", dict(optim=name)) for name in ladder if name not in searched]  # AdamW's numerics
    if on_gpu and allow_offload == "none" and not base.load_in_4bit:
        remedies.append(("`--allow-offload cpu`", offload))
    if on_gpu and base.num_nodes == 1 and not base.load_in_4bit:  # 4-bit weights are not partitioned by ZeRO-3
        for gpus in (2 * world, 4 * world, 8 * world):
            if gpus <= 8 and per_rank * base.dp_size % max(1, gpus // base.seq_shards) == 0:
                layout = offload if allow_offload != "none" else dict(zero_stage=3, optim="adamw_torch_fused")
                remedies.append((f"`--num-gpus {gpus}` with ZeRO-3", dict(layout, num_gpus=gpus)))
    if on_gpu and base.seq_shards == 1 and not base.load_in_4bit:  # Ulysses SP: activations / sp per rank
        for gpus in sorted({world, 2 * world, 4 * world, 8 * world}):
            if gpus > 1 and (gpus <= 8 or gpus == world):
                text = f"`--sp-size {gpus}`" if gpus == world else f"`--num-gpus {gpus} --sp-size {gpus}`"
                remedies.append((f"{text} (Ulysses sequence parallelism, ZeRO-3)",
                                 dict(num_gpus=gpus if base.num_nodes == 1 else base.num_gpus, sp_size=gpus,
                                      zero_stage=3, optim="adamw_torch_fused")))
    remedies += [(f"`--allow-optimizers {name}`", changes) for name, changes in _dynamics_optimizers(spec, base, searched)]
    if not base.uses_lora:
        lora = dict(lora_r=16, optim="adamw_torch_fused")
        try:
            spec.default_lora_target_modules()
            remedies.append(("LoRA `--lora-r 16`", lora))
        except MemFitError:  # peft has no default targets for this model type (ViT, wav2vec2, ...)
            remedies.append(("LoRA `--lora-r 16 --lora-target-modules all-linear`",
                             dict(lora, lora_target_modules=("all-linear",))))
    qlora = dict(lora_r=base.lora_r or 16, load_in_4bit=True, optim="adamw_torch_fused",
                 precision="bf16-mixed" if base.precision == "fp32" else base.precision)
    if not base.lora_target_modules and not _has_default_lora_targets(spec):
        qlora["lora_target_modules"] = ("all-linear",)  # peft has no default for it and would raise
    if on_gpu and not base.load_in_4bit:
        remedies.append(("QLoRA `--load-in-4bit --lora-r 16" + (" --lora-target-modules all-linear"
                                                                 if "lora_target_modules" in qlora else "") + "`", qlora))
    named_gpus = set()  # the fewest GPUs that fit is enough to name, once with and once without SP
    for text, changes in remedies:
        kind = "sp_size" in changes
        if "num_gpus" in changes and kind in named_gpus:
            continue
        est = best_fit(**changes)
        if est is not None:
            helps.append(f"{text} ({format_bytes(est.device_total_bytes)})")
            if "num_gpus" in changes:
                named_gpus.add(kind)
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
        found = longest_fitting_seq(base.seq_len, lambda seq: first_fit(best_fit, seq, variants))
        if found is not None:
            seq, est = found
            helps.append(f"{prefix}a shorter sequence `--seq-len {seq}` ({format_bytes(est.device_total_bytes)} "
                         f"with {layout_text(est.settings)}; `--seq-len max` searches every lever)")
    suggestion = "; ".join(helps) if helps else "a larger GPU"
    return f"{head}; what would fit: {suggestion}"


def _has_default_lora_targets(spec) -> bool:
    try:
        spec.default_lora_target_modules()
    except MemFitError:
        return False
    return True


def _dynamics_optimizers(spec, base: TrainSettings, searched: tuple[str, ...]) -> list[tuple[str, dict]]:
    """The optimizers `--allow-optimizers` would admit that this search did not try, with the settings each needs.

    The same admission rules as `grid.allowed_optimizers` (no low-rank projection of
    LoRA adapters, no layerwise step over several GPUs), so a remedy named here is one
    the plan would search once allowed. GaLore / APOLLO project the layers' linear
    modules, as the plan would pick them (`grid.low_rank_targets`).
    """
    remedies = []
    for name, o in optimizers.OPTIMIZERS.items():
        if not o.changes_dynamics or name in searched:
            continue
        if (o.low_rank and base.uses_lora) or (o.layerwise and base.world_size > 1):
            continue
        targets = (base.optim_target_modules or low_rank_targets(spec, base)) if o.low_rank else None
        if o.low_rank and not targets:
            continue
        remedies.append((name, dict(optim=name, optim_target_modules=targets)))
    return remedies


def first_fit(best_fit, seq: int, variants: list[dict]) -> MemoryEstimate | None:
    fits = [est for changes in variants if (est := best_fit(seq_len=seq, **changes)) is not None]
    return min(fits, key=lambda e: e.device_total_bytes, default=None)


def longest_fitting_seq(seq_len: int, fit, shortest: int = 16) -> tuple[int, MemoryEstimate] | None:
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


def difference_text(s: TrainSettings) -> str:
    return (f"micro-batch {s.batch_size} x accumulation {s.gradient_accumulation_steps}, checkpointing "
            f"{'on' if s.gradient_checkpointing else 'off'}, {s.optim}, {layout_text(s)}"
            + (f", frozen {', '.join(s.frozen)}" if s.frozen else ""))

"""Readable text for estimates and plans. Pure formatting: no estimation happens here."""

import shlex

from hf_memfit.estimator.breakdown import CATEGORIES
from hf_memfit.estimator.run_of_shapes import DEFAULT_MICRO_BATCHES, run_problems
from hf_memfit.hardware import named_gpu
from hf_memfit.units import format_bytes, format_count

_CATEGORY_NOTES = {
    "weights": "parameters, buffers, autocast weight copies",
    "gradients": "parameter gradients",
    "optimizer": "optimizer states (and fp32 master weights under ZeRO)",
    "activations": "tensors saved for backward",
    "temporary": "transient buffers at the peak",
    "overhead": "CUDA context, cuBLAS, allocator cache, buckets",
}


def _table(rows: list[tuple[str, ...]], header: tuple[str, ...] | None = None) -> str:
    all_rows = ([header] if header else []) + rows
    widths = [max(len(r[i]) for r in all_rows) for i in range(len(all_rows[0]))]
    lines = []
    for n, row in enumerate(all_rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
        if header and n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def settings_line(settings) -> str:
    """One line naming every knob that differs from a plain single-GPU fp32 AdamW run."""
    parts = [f"batch {settings.batch_size} x seq {settings.seq_len}", settings.task or "", settings.precision, settings.optim]
    if settings.gradient_accumulation_steps > 1:
        parts.append(f"accumulation {settings.gradient_accumulation_steps}")
    if settings.gradient_checkpointing:
        parts.append("gradient checkpointing")
    parts.append(f"attention {settings.attn_implementation or 'sdpa'}")
    if settings.load_in_4bit:
        parts.append(f"QLoRA r={settings.lora_r or 8}")
    elif settings.lora_r:
        parts.append(f"LoRA r={settings.lora_r}")
    if settings.world_size > 1:
        parts.append(f"{settings.num_gpus} GPU x {settings.num_nodes} node")
    if settings.zero_stage:
        parts.append(f"ZeRO-{settings.zero_stage}")
    if settings.offload_optimizer != "none":
        parts.append(f"optimizer offload {settings.offload_optimizer}")
    if settings.offload_param != "none":
        parts.append(f"param offload {settings.offload_param}")
    if settings.fsdp is not None:
        parts.append(f"FSDP{settings.fsdp_version} {settings.fsdp}" + (" + CPU offload" if settings.fsdp_offload else ""))
    if settings.sp_size > 1:
        parts.append(f"Ulysses SP {settings.sp_size}")
    if settings.cp_size > 1:
        parts.append(f"context parallel {settings.cp_size}")
    if settings.trainer != "trainer":
        parts.append(f"TRL {settings.trainer.upper()} step (fused LM head)")
    if settings.reference:
        parts.append(f"reference {settings.reference}")
    if settings.padding_free:
        parts.append("padding-free")
    if settings.decoder_seq_len is not None:
        parts.append(f"decoder seq {settings.decoder_seq_len}")
    return ", ".join(p for p in parts if p)


def format_estimate(est) -> str:
    """The `hf-memfit estimate` table."""
    from hf_memfit.estimator.assemble import describe_region

    s = est.settings
    lines = [
        f"{est.model}  ({format_count(est.total_params)} params, {format_count(est.trainable_params)} trainable)",
        f"  {settings_line(s)}",
        f"  device {s.device}{' (' + s.gpu + ')' if s.gpu else ''}, {s.mode} mode; peak at {describe_region(est.peak_region)}",
        "",
    ]
    total = sum(est.breakdown.values()) or 1
    rows = [(name, format_bytes(est.breakdown[name]), f"{100 * est.breakdown[name] / total:.1f}%", _CATEGORY_NOTES[name])
            for name in CATEGORIES]
    lines.append(_table(rows, ("component", "bytes", "share", "what")))
    lines.append("")
    summary = [("peak allocated", format_bytes(est.peak_allocated_bytes), "torch.cuda.max_memory_allocated" if s.device == "cuda" else "CPU allocator peak")]
    if s.device == "cuda":
        summary += [("peak reserved", format_bytes(est.peak_reserved_bytes), "torch.cuda.max_memory_reserved"),
                    ("device total", format_bytes(est.device_total_bytes), "what nvidia-smi shows")]
    if est.cpu_bytes:
        summary.append(("host (CPU) memory", format_bytes(est.cpu_bytes), "offloaded / paged state"))
    if est.nvme_bytes:
        summary.append(("NVMe", format_bytes(est.nvme_bytes), "ZeRO-Infinity swap"))
    lines.append(_table(summary))
    for note in est.notes:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def format_run_of_shapes(run, est) -> str:
    """`estimate --vary-seq-len`'s lines: the simulated caching allocator over a run of varying shapes."""
    lengths = sorted({length for length, _ in run.shapes})
    sides = sorted({side for _, side in run.shapes if side})
    drawn = (f"lengths drawn from {run.min_seq_len} to {lengths[-1]} tokens"
             + (f", image sides {sides[0]}-{sides[-1]} px" if len(sides) > 1 else ""))
    outside = run.device_total_bytes - run.peak_reserved_bytes
    rows = [("peak allocated", format_bytes(run.peak_allocated_bytes), "torch.cuda.max_memory_allocated over the run"),
            ("peak reserved", format_bytes(run.peak_reserved_bytes),
             "torch.cuda.max_memory_reserved over the run, on a card with room"),
            ("device total", format_bytes(run.device_total_bytes), "what nvidia-smi shows late in the run")]
    if run.needed_bytes is not None:
        rows.append(("smallest card", format_bytes(run.needed_bytes + outside),
                     "the least device memory on which the whole run completes"))
        gpu = named_gpu(est.settings.gpu)
        if gpu is not None:
            holds = run.needed_bytes + outside <= gpu.memory_bytes
            rows.append((f"on {gpu.name}", format_bytes(gpu.memory_bytes),
                         "the run fits" if holds else "the run runs out of memory on this card"))
    return "\n".join([f"over a run of {run.micro_batches} micro-batches, {drawn} (--vary-seq-len), traced at full "
                      f"depth and replayed through the caching allocator's rules ({run.seconds:.0f} s):",
                      _table(rows),
                      f"  note: one step at the largest shape reserves {format_bytes(run.step_reserved_bytes)} in the "
                      "same replay; over a run the allocator keeps the segments each shape made, and on a smaller "
                      "card it frees them and retries before it raises an OOM",
                      f"  note: CUDA reductions' staged partial sums (a bias gradient's) are in the replay, for the "
                      f"{run.reduction_staging_gpu}'s SMs" if run.reduction_staging_gpu else
                      "  note: CUDA reductions' staged partial sums (a bias gradient's, up to a few hundred MiB) are "
                      "not in the replay: their size depends on the GPU's SMs; name one with --gpu"])


def _searched_text(result) -> str:
    searched, estimated = result.candidates_searched, result.candidates_tried
    if searched <= estimated:
        return f"{estimated} configurations estimated"
    # planner/lazy_grid.py: the others were predicted slower than the runners-up before their memory was needed
    return f"{searched} configurations searched, the {estimated} that could change the plan estimated"


def format_plan(result) -> str:
    """The `hf-memfit plan` table: the plan, its memory breakdown, the runners-up and the reasons."""
    from hf_memfit.planner.candidates import host_bytes_per_node
    from hf_memfit.planner.explain import layout_text, lever_differences  # the reasons' wording
    from hf_memfit.planner.result import OFFLOADED_OPTIMIZER

    p, est, s = result.plan, result.estimate, result.plan.settings
    lines = [f"Plan for {est.model}: {s.seq_len} tokens x global batch "
             f"{p.per_device_train_batch_size * p.gradient_accumulation_steps * s.dp_size}, "
             f"budget {format_bytes(p.budget_bytes)} per GPU ({_searched_text(result)})", ""]
    rows = [
        ("per_device_train_batch_size", str(p.per_device_train_batch_size)),
        ("gradient_accumulation_steps", str(p.gradient_accumulation_steps)),
        ("GPUs", f"{p.num_gpus} x {p.num_nodes} node(s)"),
        ("gradient_checkpointing", str(p.gradient_checkpointing)),
        ("precision", _precision_text(s.precision, lora=s.uses_lora and not s.load_in_kbit)),
        ("optim", p.optim + (f" ({p.optim_args})" if p.optim_args else "") if s.offload_optimizer == "none"
         else f"{OFFLOADED_OPTIMIZER} on the host (DeepSpeed's optimizer section)"),
        ("attn_implementation", p.attn_implementation),
        *([("use_liger_kernel", "True")] if p.use_liger_kernel else []),
        *([("activation checkpoints", "offloaded to the host")] if p.offload_activations else []),
        *([("tiled MLP", "on (hf_memfit.apply_tiled_mlp; MemFitTrainer applies it)")] if p.tiled_mlp else []),
        *([("frozen", ", ".join(p.frozen) + " (requires_grad_(False); MemFitTrainer applies it)")] if p.frozen else []),
        ("sharding", layout_text(s)),
        (f"predicted peak per GPU ({'nvidia-smi' if s.device == 'cuda' else 'allocator'}, {est.settings.mode} mode)",
         format_bytes(est.device_total_bytes)),
        ("predicted throughput", f"{100 * p.predicted_tokens_per_second_relative:.0f}% of the unconstrained step"),
    ]
    rows[0:0] = [("inputs", note.removeprefix("inputs: ")) for note in est.notes if note.startswith("inputs: ")]
    if est.cpu_bytes:
        rows.append(("host memory per GPU", format_bytes(est.cpu_bytes)))
        rows.append((f"host memory per node ({s.num_gpus} GPU)", format_bytes(host_bytes_per_node(est))))
    lines.append(_table(rows))
    lines += ["", "Memory at the peak:"]
    total = sum(est.breakdown.values()) or 1
    lines.append(_table([(f"  {k}", format_bytes(v), f"{100 * v / total:.0f}%") for k, v in est.breakdown.items()]))
    lines += ["", "Why:"] + [f"  - {r}" for r in p.reasons]
    if result.alternatives:
        lines += ["", "Runners-up:"]
        for c in result.alternatives:
            c_s = c.settings
            label = (f"micro {c_s.batch_size} x acc {c_s.gradient_accumulation_steps}, "
                     f"ckpt {'on' if c_s.gradient_checkpointing else 'off'}, {c_s.optim}, {layout_text(c_s)}")
            if c_s.frozen != s.frozen:
                label += ", frozen " + ", ".join(c_s.frozen) if c_s.frozen else ", nothing frozen"
            # The knobs the label above leaves out, where they differ from the plan's (a runner-up in pure bf16,
            # or a misfit that offloads its checkpoints, would otherwise read as the plan's setting)
            label += "".join(f", {part}" for part in lever_differences(s, c_s))
            verdict = c.why_not if c.fits else f"does not fit: {c.why_not}"
            lines.append(f"  - {label}: {verdict}")
    lines += ["", "The same figure from the estimator:", f"  {step_command('estimate', est.model, est.settings)}",
              "Where the memory goes (traces this plan's step; add --plot FILE.png to draw it):",
              f"  {explain_command(est.model, s)}"]
    shortest = max(1, s.seq_len // 8)
    if s.device == "cuda" and not run_problems(s, min_seq_len=shortest, micro_batches=DEFAULT_MICRO_BATCHES):
        lines += ["Over a run whose batches vary in length (dynamic padding; traces the whole run, a minute or more):",
                  f"  {step_command('estimate', est.model, est.settings)} --vary-seq-len {shortest}"]
    return "\n".join(lines)


def _precision_text(precision: str, lora: bool = False) -> str:
    if lora and precision in ("bf16", "fp16"):  # a frozen base: the adapters are fp32 (peft's default)
        return f"{precision} base weights, fp32 LoRA adapters"
    return {"bf16-mixed": "bf16 mixed", "fp16-mixed": "fp16 mixed", "bf16": "bf16 weights (no fp32 master)",
            "fp16": "fp16 weights (no fp32 master)"}.get(precision, precision)


def explain_command(model: str, s) -> str:
    """The `hf-memfit explain` command line that traces the step `s` describes (flags left at their defaults are omitted)."""
    return step_command("explain", model, s)


def step_command(command: str, model: str, s) -> str:
    """The `hf-memfit estimate|explain` command line for the step `s` (flags at their defaults are omitted)."""
    from hf_memfit.settings import TrainSettings
    from hf_memfit.tasks import MEDIA_TASKS

    default = TrainSettings()
    flags = [f"--batch-size {s.batch_size}"]
    if s.task not in MEDIA_TASKS or s.task == "image-text-to-text":  # else patches / frames, made from the inputs
        flags.append(f"--seq-len {s.seq_len}")
    if s.gradient_accumulation_steps != 1:
        flags.append(f"--gradient-accumulation-steps {s.gradient_accumulation_steps}")
    for name in ("task", "precision", "optim", "attn_implementation", "lora_r", "lora_alpha", "gpu", "trainer",
                 "reference_model", "decoder_seq_len"):
        value = getattr(s, name)
        if value is not None and value != getattr(default, name):
            flags.append(f"--{name.replace('_', '-')} {value}")
    if s.task == "seq-cls" and s.num_labels != default.num_labels:
        flags.append(f"--num-labels {s.num_labels}")
    for name in ("image_size", "images_per_sample", "audio_seconds", "label_len", "ssm_kernels",
                 "bnb_4bit_quant_storage"):  # the inputs and kernels the step was estimated for
        value = getattr(s, name)
        if value is not None and value != getattr(default, name):
            flags.append(f"--{name.replace('_', '-')} {value:g}" if isinstance(value, float) else
                         f"--{name.replace('_', '-')} {value}")
    if s.frozen:
        flags.append(f"--freeze {','.join(s.frozen)}")
    if s.load_in_4bit and not s.bnb_4bit_use_double_quant:
        flags.append("--no-double-quant")
    if s.load_in_4bit and s.prepare_model_for_kbit_training is not None:
        flags.append(f"--prepare-model-for-kbit-training {'yes' if s.prepare_model_for_kbit_training else 'no'}")
    if s.lora_target_modules:
        flags.append(f"--lora-target-modules {','.join(s.lora_target_modules)}")
    if s.lora_target_regex:
        flags.append(f"--lora-target-regex {shlex.quote(s.lora_target_regex)}")
    if s.optim_args:
        flags.append(f'--optim-args "{s.optim_args}"')
    if s.optim_target_modules:
        flags.append(f"--optim-target-modules {','.join(s.optim_target_modules)}")
    for name in ("gradient_checkpointing", "offload_activations", "load_in_4bit", "use_liger_kernel",
                 "expandable_segments", "padding_free", "activation_offloading", "tiled_mlp"):
        if getattr(s, name):
            flags.append(f"--{name.replace('_', '-')}")
    names = ("num_gpus", "num_nodes", "zero_stage", "offload_optimizer", "offload_param", "fsdp", "sp_size", "cp_size",
             "device")
    if command == "estimate":
        names += ("mode",)
    for name in names:
        if getattr(s, name) != getattr(default, name):
            flags.append(f"--{name.replace('_', '-')} {getattr(s, name)}")
    if s.fsdp is not None and s.fsdp_version != default.fsdp_version:
        flags.append(f"--fsdp-version {s.fsdp_version}")
    if s.fsdp_offload:
        flags.append("--fsdp-offload")
    return f"hf-memfit {command} {model} " + " ".join(flags)


def format_timeline(timeline) -> str:
    """The `hf-memfit explain` text: phases, what is live at the peak, and the top modules."""
    lines = [f"{timeline.label}: peak {format_bytes(timeline.peak_bytes)} at allocator event {timeline.peak_clock}"]
    if timeline.device_total_bytes > timeline.peak_bytes:
        lines.append(f"  device total at the peak {format_bytes(timeline.device_total_bytes)} (what nvidia-smi shows: "
                     f"plus the allocator's cached segments and the CUDA context)")
    lines.append("")
    lines.append(_table([(p.name, format_bytes(p.peak_bytes), f"events {p.start}-{p.end}") for p in timeline.phases],
                        ("phase", "peak", "span")))
    lines += ["", "Live at the peak:"]
    total = sum(timeline.peak_breakdown.values()) or 1
    lines.append(_table([(f"  {k}", format_bytes(v), f"{100 * v / total:.1f}%") for k, v in timeline.peak_breakdown.items()]))
    if timeline.top_module_groups:
        lines += ["", "Activations at the peak by module (layers folded):"]
        lines.append(_table([(f"  {m}", format_bytes(b)) for m, b in timeline.top_module_groups]))
    if timeline.top_modules:
        lines += ["", "Top modules by activation memory at the peak:"]
        lines.append(_table([(f"  {m}", format_bytes(b)) for m, b in timeline.top_modules]))
    return "\n".join(lines)

"""`hf-memfit check`: run a real training step on this machine and compare its peak with the prediction.

The model is built from its config with random weights (`estimator.step.build_model`, the
code exact mode traces and the accuracy benchmark measures) and trained for a few steps
on this machine's device (`estimator.measure_device`). The prediction of both modes is
set beside the measured peak, term by term where the measurement can attribute it;
`--grid` runs a small matrix and writes a JSON file to attach to a bug report.
"""

import argparse
import json
import os
import platform
import sys

from hf_memfit.cli.output import emit
from hf_memfit.errors import MemFitError, check_all
from hf_memfit.estimator.run_of_shapes import DEFAULT_MICRO_BATCHES, drawn_image_sides, drawn_length_problems
from hf_memfit.units import GiB, format_bytes

CHECK_EPILOG = """examples:
  hf-memfit check ./tiny-llama/config.json --batch-size 2 --seq-len 128
  hf-memfit check gpt2 --batch-size 1 --seq-len 256 --gradient-checkpointing --json
  hf-memfit check gpt2 --batch-size 1 --seq-len 128 --grid --out gpt2-check.json   # attach it to a bug report
"""

TERMS = ("weights", "gradients", "optimizer", "activations", "temporary", "overhead")

# Room the measuring process needs beyond the step's own peak: the interpreter with torch, transformers and
# peft imported (~1 GiB resident on the machine behind docs/benchmarks.md) and the profiler's event records.
# A run predicted to need more than what is available less this is refused before it starts.
RUN_RESERVE_BYTES = 1 * GiB
# The prediction itself may be off (docs/benchmarks.md: fast mode up to ~4% on a CPU row, more on a GPU where
# the allocator's slack is modelled); 25% more than predicted must still fit.
PREDICTION_MARGIN = 1.25


def add_check_parser(sub) -> None:
    from hf_memfit.cli.arguments import add_step_arguments

    parser = sub.add_parser("check", help="measure a real training step here and compare it with the prediction",
                            epilog=CHECK_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(parser)
    for action in parser._actions:  # the step flags' wording is estimate's; here they say where the step runs
        if action.dest == "device":
            action.default, action.help = None, "where to run the step (default: cuda when there is one, else cpu)"
        elif action.dest == "mode":
            action.default = "exact"
            action.help = "exact (default): predict with both modes; fast: skip exact mode's trace"
        elif action.dest == "gpu":
            action.help = "ignored on a GPU (the local card is used); GPU model for the prediction otherwise"
    parser.add_argument("--steps", type=int, default=2,
                        help="optimizer steps to run (default 2: the second has the optimizer states, the steady "
                             "state the estimate predicts)")
    parser.add_argument("--no-terms", dest="terms", action="store_false",
                        help="CPU: skip the second, profiled run that splits the measured peak by term")
    parser.add_argument("--grid", action="store_true",
                        help="run a small matrix around the given settings (micro-batch 1 and 2, checkpointing "
                             "off/on, LoRA off/on, and 4-bit QLoRA on CUDA) and write it to --out")
    parser.add_argument("--out", default="hf-memfit-check.json",
                        help="with --grid: the JSON file to write (default: hf-memfit-check.json)")
    parser.add_argument("--memory-snapshot", metavar="FILE",
                        help="CUDA, one row: also write the caching allocator's history of the run to FILE (a "
                             "pickle that pytorch.org/memory_viz draws: every block alive at the peak, with the "
                             "Python stack that allocated it)")
    parser.add_argument("--vary-seq-len", type=int, metavar="MIN",
                        help="CUDA: after the steps at --seq-len, train --micro-batches more whose lengths are drawn "
                             "from MIN to --seq-len, as dynamic padding makes them, and report the run's "
                             "max_memory_allocated / max_memory_reserved and whether this card ran out (a run of "
                             "varying shapes reserves more than one step: docs/benchmarks.md section 19)")
    parser.add_argument("--micro-batches", type=int, default=None,
                        help="with --vary-seq-len: how many micro-batches (default 64; one optimizer step every "
                             "--gradient-accumulation-steps)")
    parser.add_argument("--vary-image-size", type=int, metavar="MIN",
                        help="with --vary-seq-len and --task image-text-to-text: also draw each micro-batch's "
                             "square image side from MIN to --image-size")
    parser.set_defaults(func=cmd_check)


def cmd_check(args: argparse.Namespace) -> int:
    from hf_memfit.models.spec import resolve_model

    if args.steps < 1:
        raise MemFitError(f"`--steps` must be at least 1, got {args.steps}; 2 reaches the steady state")
    from hf_memfit.cli.arguments import check_writable, refuse_run_flags_without_vary_seq_len, settings_from_args

    if args.grid:
        check_writable(args.out, "--out")  # before the runs, not after
    device = _device(args.device)
    if args.memory_snapshot:
        if device != "cuda":
            raise MemFitError("`--memory-snapshot` records the CUDA caching allocator, and this check runs on the "
                              "CPU: drop it, or check on a GPU")
        if args.grid:
            raise MemFitError("`--memory-snapshot` records one run: drop `--grid`, or check that row alone")
        check_writable(args.memory_snapshot, "--memory-snapshot")
    refuse_run_flags_without_vary_seq_len(args)
    if args.vary_seq_len is not None:
        check_all(_varying_problems(args, device))
    args.device, args.gpu = device, _local_gpu_name(args.gpu) if device == "cuda" else args.gpu
    spec = resolve_model(args.model)
    base = settings_from_args(args).validate(spec)
    image_sizes, image_problems = drawn_image_sides(base, args.vary_image_size)
    check_all(image_problems)  # before any run
    machine = machine_info(device)
    if not args.grid:
        row = check_row(spec, base, steps=args.steps, terms=args.terms, exact=args.mode == "exact",
                        memory_snapshot=args.memory_snapshot)
        if args.vary_seq_len is not None:
            row["varying"] = varying_row(spec, base, min_seq_len=args.vary_seq_len, micro_batches=args.micro_batches,
                                         image_sizes=image_sizes)
        emit(json.dumps({"model": spec.name, "machine": machine, **row}, indent=2) if args.json
              else format_row(spec.name, row, machine))
        return 0
    # What no row could run (several processes, pinned offload on a CPU ...) is refused once, up front; the
    # grid itself varies the adapters, so a 4-bit base on a CPU still runs its full and LoRA rows.
    check_all(unrunnable(base.replace(load_in_4bit=False, bnb_4bit_quant_storage=None,
                                      prepare_model_for_kbit_training=None)))
    rows = []
    for label, settings in grid_settings(base, cuda=device == "cuda"):
        print(f"hf-memfit: check {label} ...", file=sys.stderr, flush=True)
        try:
            row = check_row(spec, settings, steps=args.steps, terms=args.terms, exact=args.mode == "exact")
        except MemFitError as error:  # a row this machine cannot run is recorded, the others still run
            row = {"settings": settings.to_dict(), "skipped": str(error)}
        rows.append({"label": label, **row})
    document = {"model": spec.name, "machine": machine, "steps": args.steps, "rows": rows,
                "summary": summarize(rows)}
    _write_json(document, args.out)
    emit(json.dumps(document, indent=2) if args.json else format_grid(spec.name, document))
    print(f"hf-memfit: wrote {args.out}", file=sys.stderr)
    return 0


def _varying_problems(args: argparse.Namespace, device: str) -> list[str]:
    problems = []
    if device != "cuda":
        problems.append("`--vary-seq-len` measures the CUDA caching allocator over a run of varying lengths, and this "
                        "check runs on the CPU, which has none: drop it, or check on a GPU")
    if args.grid:
        problems.append("`--vary-seq-len` follows one row: drop `--grid`, or check that row alone")
    if args.micro_batches is None:
        args.micro_batches = DEFAULT_MICRO_BATCHES
    return problems + drawn_length_problems(args.seq_len, args.vary_seq_len, args.micro_batches)


def varying_row(spec, settings, *, min_seq_len: int, micro_batches: int, image_sizes: tuple[int, ...] = ()) -> dict:
    """`micro_batches` of lengths from `min_seq_len` to the settings' (and image sides from `image_sizes`) on this
    GPU, beside the fixed-shape row, and what `estimate --vary-seq-len` predicts for the same shapes."""
    from hf_memfit.estimator.measure_device import measure_varying
    from hf_memfit.estimator.run_of_shapes import run_of_shapes, run_problems, varying_shapes

    shapes = varying_shapes(settings, min_seq_len=min_seq_len, micro_batches=micro_batches, image_sizes=image_sizes)

    def progress(done, total, last):
        if done % 16 == 0 or done == total:
            print(f"hf-memfit: varying lengths: {done}/{total} micro-batches, max reserved "
                  f"{format_bytes(last['max_reserved'])}", file=sys.stderr, flush=True)

    result = measure_varying(spec.config, settings.replace(mode="exact"), shapes, progress=progress)
    row = {"min_seq_len": min_seq_len, **result}
    unpredicted = run_problems(settings, min_seq_len=min_seq_len, micro_batches=micro_batches)
    if unpredicted:  # measured all the same; said in the row
        row["not_predicted"] = unpredicted[0]
    else:
        # The same shapes replayed through the simulated allocator (`estimate --vary-seq-len`), to check it here.
        predicted = run_of_shapes(spec, settings.replace(mode="exact"), min_seq_len=min_seq_len,
                                  micro_batches=micro_batches, image_sizes=image_sizes)
        row["predicted"] = {key: value for key, value in predicted.to_dict().items() if key != "shapes"}
        row["error_percent"] = {key: _err(row["predicted"][f"peak_{key}_bytes"], result[f"max_{key}"])
                                for key in ("allocated", "reserved")}
    return row


def _write_json(document: dict, path: str) -> None:
    """Whole or not at all: a temporary file beside `path`, renamed over it."""
    import tempfile

    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".hf-memfit-check-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(document, f, indent=2)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _device(asked: str | None) -> str:
    import torch

    has_cuda = torch.cuda.is_available()
    if asked == "cuda" and not has_cuda:
        raise MemFitError("`--device cuda`: this machine has no CUDA GPU that torch can use; check on the CPU "
                          "with `--device cpu`, or run the command on the GPU machine")
    return asked or ("cuda" if has_cuda else "cpu")


def _local_gpu_name(asked: str | None) -> str | None:
    """The local card's name in the GPU table, so the prediction uses its CUDA constants; None if unknown."""
    from hf_memfit.hardware import detect_local_gpu, find_gpu

    found = detect_local_gpu()
    if found is None:
        return asked
    try:
        return find_gpu(found[0].name).name
    except MemFitError:  # not in the table: the estimator's defaults for an unknown GPU
        return None


def unrunnable(settings) -> list[str]:
    """What this machine cannot run of `settings`, one problem each, each naming its flag and the fix."""
    import torch

    problems = []
    if settings.world_size > 1 or settings.zero_stage or settings.fsdp:
        problems.append("`check` runs one process on this machine: drop `--num-gpus` / `--num-nodes` / "
                        "`--zero-stage` / `--fsdp` (benchmarks/zero.py and benchmarks/fsdp.py measure those layouts)")
    if settings.device == "cpu":
        if settings.load_in_4bit:
            problems.append("`--load-in-4bit` needs a CUDA GPU (bitsandbytes packs and runs 4-bit weights there); "
                            "drop it to check LoRA on the CPU, or run on a GPU")
        if settings.offload_activations or settings.activation_offloading:
            flag = "--offload-activations" if settings.offload_activations else "--activation-offloading"
            problems.append(f"`{flag}` offloads to pinned host memory, which needs a CUDA GPU; drop it on the CPU")
    elif settings.compute_dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        problems.append(f"`--precision {settings.precision}`: this GPU ({torch.cuda.get_device_name()}) has no bf16; "
                        "use `--precision fp16-mixed`")
    if settings.use_liger_kernel and settings.device == "cpu":
        problems.append("`--use-liger-kernel`: Liger's kernels are Triton, which needs a GPU; drop it on the CPU")
    elif settings.use_liger_kernel:
        from transformers.utils import is_liger_kernel_available

        if not is_liger_kernel_available():  # the measured step runs Liger's own kernels, as the Trainer does
            problems.append("`--use-liger-kernel`: the step runs Liger's own kernels and liger-kernel is not "
                            "installed here: `pip install liger-kernel`, or drop the flag")
    return problems


def _available_bytes(device: str) -> tuple[int, str]:
    if device == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return int(free), f"free on {torch.cuda.get_device_name()}"
    import psutil

    return int(psutil.virtual_memory().available) - RUN_RESERVE_BYTES, "of RAM available (less 1 GiB for the run)"


def check_row(spec, settings, *, steps: int, terms: bool, exact: bool, memory_snapshot: str | None = None) -> dict:
    """Predict (fast, and exact unless told not to), refuse what cannot run here, measure, and compare."""
    from hf_memfit.estimator.assemble import estimate_settings

    check_all(unrunnable(settings))
    predicted = {"fast": estimate_settings(spec, settings.replace(mode="fast"))}
    need = int(predicted["fast"].device_total_bytes * PREDICTION_MARGIN)
    have, where = _available_bytes(settings.device)
    if need > have:
        raise MemFitError(f"`{spec.name}` with these settings is predicted to need {format_bytes(need)} (the "
                          f"estimate plus 25%), and this machine has {format_bytes(max(have, 0))} {where}; check a "
                          "smaller configuration (`--batch-size`, `--seq-len`, fewer layers in a config.json)")
    errors = {}
    if exact:
        try:
            predicted["exact"] = estimate_settings(spec, settings.replace(mode="exact"))
        except MemFitError:
            raise
        except Exception as error:  # noqa: BLE001 - exact mode failing is a finding to report, not a reason to stop
            errors["exact"] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    measured = _measure(spec, settings.replace(mode="exact"), steps, terms, memory_snapshot)
    row = {"settings": settings.to_dict(),
           "predicted": {mode: _prediction(est) for mode, est in predicted.items()},
           "measured": measured.to_dict(),
           "error_percent": {mode: _errors(est, measured) for mode, est in predicted.items()}}
    if errors:
        row["prediction_errors"] = errors
    if settings.device == "cuda":
        row["constants"] = cuda_constants(predicted.get("exact", predicted["fast"]), measured)
    if memory_snapshot:
        from hf_memfit.report.allocator_snapshot import load_snapshot, peak_blocks

        # the history's peak can sit a few blocks under max_memory_allocated: cuBLAS's workspaces and
        # anything else made before the recording are counted from the snapshot's segments
        row["measured"]["snapshot_peak"] = peak_blocks(load_snapshot(memory_snapshot))
    return row


def _measure(spec, settings, steps: int, terms: bool, memory_snapshot: str | None = None):
    import warnings

    from hf_memfit.estimator.measure_device import measure_step

    try:
        with warnings.catch_warnings():
            # peft and transformers warn about the randomly initialised model check builds (e.g. LoRA on GPT-2's
            # Conv1D sets fan_in_fan_out); the user wrote none of that code and the memory is the same.
            warnings.simplefilter("ignore", UserWarning)
            return measure_step(spec.config, settings, steps=steps, terms=terms, memory_snapshot=memory_snapshot)
    except MemFitError:
        raise
    except Exception as error:  # noqa: BLE001 - one line for the user; the step is the libraries' code, not ours
        first = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        if "out of memory" in first.lower():
            raise MemFitError(f"the step ran out of memory on this machine ({first}); check a smaller configuration "
                              "(`--batch-size`, `--seq-len`)") from None
        raise MemFitError(f"the training step failed on this machine ({first}); these settings cannot run here "
                          "as given: change the flag the error names, or check on a GPU") from None


def _prediction(est) -> dict:
    from hf_memfit.estimator.assemble import describe_region

    return {"peak_allocated_bytes": est.peak_allocated_bytes, "peak_reserved_bytes": est.peak_reserved_bytes,
            "device_total_bytes": est.device_total_bytes, "breakdown": dict(est.breakdown),
            "peak_phase": describe_region(est.peak_region)}


def _err(predicted, measured) -> float | None:
    if predicted is None or not measured:
        return None
    return 100.0 * (predicted - measured) / measured


def _errors(est, measured) -> dict:
    return {"peak_allocated": _err(est.peak_allocated_bytes, measured.peak_allocated_bytes),
            "peak_reserved": _err(est.peak_reserved_bytes, measured.peak_reserved_bytes),
            "device_total": _err(est.device_total_bytes, measured.device_total_bytes)}


def cuda_constants(est, measured) -> dict:
    """Each CUDA-side constant family of the estimate beside what the run measured."""
    from hf_memfit.estimator import cuda_overhead
    from hf_memfit.hardware import named_gpu

    gpu = named_gpu(est.settings.gpu)
    predicted = {
        "cublas_workspace_bytes": cuda_overhead.cublas_workspace_bytes(gpu),
        "cuda_context_bytes": cuda_overhead.cuda_context_bytes(gpu),
        "allocator_reserved_minus_allocated_bytes": est.peak_reserved_bytes - est.peak_allocated_bytes,
    }
    return {name: {"predicted": value, "measured": measured.constants.get(name),
                   "error_percent": _err(value, measured.constants.get(name))} for name, value in predicted.items()}


def grid_settings(base, *, cuda: bool) -> list[tuple[str, object]]:
    """Micro-batch 1 and 2 x checkpointing off/on x (full, LoRA, and QLoRA on CUDA), around `base`."""
    rank = base.lora_r or 8  # peft's default rank
    adapters = [("full", dict(lora_r=None, lora_alpha=None, lora_target_modules=None, load_in_4bit=False)),
                (f"LoRA r{rank}", dict(lora_r=rank, load_in_4bit=False))]
    if cuda:
        adapters.append((f"QLoRA r{rank}", dict(lora_r=rank, load_in_4bit=True)))
    rows = []
    for micro in (1, 2):
        for checkpointing in (False, True):
            for name, changes in adapters:
                label = f"micro-batch {micro}, checkpointing {'on' if checkpointing else 'off'}, {name}"
                if not changes["load_in_4bit"] and base.load_in_4bit:
                    changes = dict(changes, bnb_4bit_quant_storage=None, prepare_model_for_kbit_training=None)
                rows.append((label, base.replace(batch_size=micro, gradient_checkpointing=checkpointing,
                                                 offload_activations=base.offload_activations and checkpointing,
                                                 **changes)))
    return rows


def summarize(rows: list[dict]) -> dict:
    """The largest |error| of each mode on the peak that the device's allocator counts."""
    summary = {}
    for mode in ("fast", "exact"):
        errors = [(abs(e), row["label"]) for row in rows
                  if (e := row.get("error_percent", {}).get(mode, {}).get("peak_allocated")) is not None]
        if errors:
            worst = max(errors)
            summary[mode] = {"rows": len(errors), "max_abs_error_percent": worst[0], "worst_row": worst[1]}
    summary["skipped"] = sum(1 for row in rows if "skipped" in row)
    return summary


def machine_info(device: str) -> dict:
    """Versions and hardware, as a bug report needs them."""
    import importlib.metadata

    import psutil
    import torch

    from hf_memfit import __version__

    info = {"hf_memfit": __version__, "python": platform.python_version(), "platform": platform.platform(),
            "cpu": _cpu_name(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "ram_bytes": int(psutil.virtual_memory().total), "device": device}
    if device == "cpu":  # without CPU kernels' per-thread scratch: `measure.one_intra_op_thread`
        info["measured_on_threads"] = 1
    for package in ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "trl"):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(device_name=props.name, device_memory_bytes=int(props.total_memory),
                    compute_capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
                    allocator_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    else:
        info["device_name"] = info["cpu"]
    return info


def _cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what `platform` knows (often only the architecture)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --- text ------------------------------------------------------------------------------------------------


def _pct(value) -> str:
    return "-" if value is None else f"{value:+.2f}%"


def _size(value) -> str:
    return "-" if value is None else format_bytes(value)


def _describe(s: dict) -> str:
    adapters = ("QLoRA" if s["load_in_4bit"] else "LoRA") + f" r{s['lora_r']}" if s["lora_r"] else "full fine-tune"
    return (f"micro-batch {s['batch_size']} x accumulation {s['gradient_accumulation_steps']}, seq {s['seq_len']}, "
            f"{s['precision']}, {s['optim']}, checkpointing {'on' if s['gradient_checkpointing'] else 'off'}, "
            f"{adapters}")


def format_row(name: str, row: dict, machine: dict) -> str:
    m, modes = row["measured"], list(row["predicted"])
    lines = [f"hf-memfit check: {name} on {machine['device']} ({machine['device_name']}), {m['steps']} training "
             f"step(s) in {m['seconds']:.1f} s", f"  {_describe(row['settings'])}", ""]
    header = f"  {'':<26}" + "".join(f"{mode:>14}" for mode in modes) + f"{'measured':>14}"
    lines.append(header)
    peaks = [("peak allocated", "peak_allocated")]
    if m["device"] == "cuda":
        peaks += [("peak reserved", "peak_reserved"), ("device total (nvidia-smi)", "device_total")]
    for label, key in peaks:
        lines.append(f"  {label:<26}" + "".join(f"{_size(row['predicted'][mode][key + '_bytes']):>14}"
                                                for mode in modes) + f"{_size(m[key + '_bytes']):>14}")
        lines.append(f"  {'  error':<26}" + "".join(f"{_pct(row['error_percent'][mode][key]):>14}" for mode in modes))
    for mode, text in row.get("prediction_errors", {}).items():
        lines.append(f"  {mode} mode failed: {text}")
    lines += ["", "At the peak, by term" + (" (measured: the PyTorch profiler's tensor categories at the measured "
                                            "peak)" if m["terms"] else " (the measurement gives the total only)")]
    lines.append(header)
    for term in TERMS:
        measured = m["terms"].get(term, 0) if m["terms"] else None
        if term == "overhead" and m["device"] == "cpu":
            continue  # nothing outside the tensors on a CPU
        lines.append(f"  {term:<26}" + "".join(f"{_size(row['predicted'][mode]['breakdown'].get(term, 0)):>14}"
                                               for mode in modes) + f"{_size(measured):>14}")
    lines.append(f"  (the prediction's peak: {row['predicted'][modes[-1]]['peak_phase']})")
    if row.get("constants"):
        lines += ["", "CUDA constants               predicted      measured      error"]
        for family, c in row["constants"].items():
            lines.append(f"  {family.removesuffix('_bytes'):<26}{_size(c['predicted']):>14}{_size(c['measured']):>14}"
                         f"{_pct(c['error_percent']):>11}")
    if m.get("snapshot_peak"):
        peak = m["snapshot_peak"]
        lines += ["", f"Alive at the allocator's peak ({_size(peak['peak_live_bytes'])}, --memory-snapshot), by the "
                      "line that allocated it"]
        lines += [f"  {_size(group['bytes']):>12}  {group['blocks']:>5} block(s)  {group['site']}"
                  for group in peak["groups"][:12]]
    if row.get("varying"):
        v = row["varying"]
        lines += ["", f"A run of {v['micro_batches']} micro-batches of {v['min_seq_len']}-{row['settings']['seq_len']} "
                      f"tokens (--vary-seq-len), as dynamic padding makes them"]
        lines.append(f"  max allocated {_size(v['max_allocated']):>12}   (the fixed step: {_size(m['peak_allocated_bytes'])})")
        lines.append(f"  max reserved  {_size(v['max_reserved']):>12}   (the fixed step: {_size(m['peak_reserved_bytes'])}; "
                     "cache the allocator frees and retries with before an OOM)")
        if v.get("not_predicted"):
            lines.append(f"  not predicted: {v['not_predicted']}")
        if v.get("predicted"):
            p, e = v["predicted"], v["error_percent"]
            lines.append(f"  predicted (estimate --vary-seq-len): allocated {_size(p['peak_allocated_bytes'])} "
                         f"({_pct(e['allocated'])}), reserved {_size(p['peak_reserved_bytes'])} ({_pct(e['reserved'])}), "
                         f"smallest card's allocator {_size(p['needed_bytes'])}")
        if v["oom"]:
            lines.append(f"  ran out of memory at micro-batch {v['oom']['micro_batch'] + 1} ({v['oom']['seq_len']} "
                         f"tokens) after {v['num_alloc_retries']} retries: this card does not hold the run")
        else:
            lines.append(f"  no OOM on this card ({v['num_alloc_retries']} allocator retries)")
    lines += [f"note: {note}" for note in m["notes"]]
    return "\n".join(lines)


def format_grid(name: str, document: dict) -> str:
    machine = document["machine"]
    lines = [f"hf-memfit check --grid: {name} on {machine['device']} ({machine['device_name']}), torch "
             f"{machine['torch']}, transformers {machine['transformers']}", "",
             f"  {'settings':<48}{'measured':>12}{'fast':>10}{'exact':>10}"]
    for row in document["rows"]:
        if "skipped" in row:
            lines.append(f"  {row['label']:<48}  skipped: {row['skipped']}")
            continue
        errors = row["error_percent"]
        lines.append(f"  {row['label']:<48}{_size(row['measured']['peak_allocated_bytes']):>12}"
                     f"{_pct(errors['fast']['peak_allocated']):>10}"
                     f"{_pct(errors.get('exact', {}).get('peak_allocated')):>10}")
    for mode, s in document["summary"].items():
        if mode != "skipped":
            lines.append(f"{mode} mode: max |error| {s['max_abs_error_percent']:.2f}% over {s['rows']} row(s) "
                         f"({s['worst_row']})")
    return "\n".join(lines)


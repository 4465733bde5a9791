"""`hf-memfit estimate | plan | explain | check | cache`: one function per subcommand, `main(argv) -> int`.

User errors (`MemFitError`, bad flags) print one line on stderr and exit 2.
The fast paths import no torch.
"""

import argparse
import atexit
import contextlib
import json
import logging
import os
import sys

from hf_memfit.cli.arguments import (MemFitArgumentParser, add_step_arguments, check_writable, kbit_preparation,
                                      media_inputs, positive_int, refuse_run_flags_without_vary_seq_len,
                                      settings_from_args, step_shape)
from hf_memfit.cli.cache import add_cache_parser
from hf_memfit.cli.check import add_check_parser
from hf_memfit.cli.output import emit, results_on_stdout
from hf_memfit.errors import MemFitError

_ESTIMATE_EPILOG = """examples:
  hf-memfit estimate gpt2-xl --batch-size 1 --seq-len 1024
  hf-memfit estimate meta-llama/Llama-3.1-8B --batch-size 4 --seq-len 2048 --precision bf16-mixed \\
      --gradient-checkpointing --optim adamw_bnb_8bit --json
  hf-memfit estimate ./my-model/config.json --batch-size 8 --seq-len 512 --mode exact
"""


def cmd_estimate(args: argparse.Namespace) -> int:
    from hf_memfit.estimator.assemble import estimate_settings
    from hf_memfit.report.text import format_estimate
    from hf_memfit.models.spec import resolve_model

    spec = resolve_model(args.model)
    if args.gpu:
        from hf_memfit.hardware import find_gpu

        args.gpu = find_gpu(args.gpu).name
    settings = settings_from_args(args)
    run_shape = _run_of_shapes_arguments(args, settings.validate(spec))  # refused before the step is estimated
    est = estimate_settings(spec, settings)
    run = None
    if run_shape is not None:
        from hf_memfit.estimator.run_of_shapes import run_of_shapes

        run = run_of_shapes(spec, est.settings, **run_shape,
                            outside_allocator_bytes=est.device_total_bytes - est.peak_reserved_bytes)
    if args.json:
        emit(json.dumps({**est.to_dict(), **({"run_of_shapes": run.to_dict()} if run else {})}, indent=2))
    else:
        from hf_memfit.report.text import format_run_of_shapes

        emit(format_estimate(est) + (("\n\n" + format_run_of_shapes(run, est)) if run else ""))
    return 0


def _run_of_shapes_arguments(args: argparse.Namespace, settings) -> dict | None:
    """`run_of_shapes`'s keyword arguments from `--vary-seq-len`, `--vary-image-size` and `--micro-batches`
    (None without `--vary-seq-len`); every problem with them is refused at once, in one line each."""
    from hf_memfit.errors import check_all
    from hf_memfit.estimator.run_of_shapes import DEFAULT_MICRO_BATCHES, drawn_image_sides, run_problems

    refuse_run_flags_without_vary_seq_len(args)
    if args.vary_seq_len is None:
        return None
    micro_batches = DEFAULT_MICRO_BATCHES if args.micro_batches is None else args.micro_batches
    image_sizes, image_problems = drawn_image_sides(settings, args.vary_image_size)
    check_all(run_problems(settings, min_seq_len=args.vary_seq_len, micro_batches=micro_batches) + image_problems)
    return {"min_seq_len": args.vary_seq_len, "micro_batches": micro_batches, "image_sizes": image_sizes}


_PLAN_EPILOG = """examples:
  hf-memfit plan gpt2-xl --gpu-memory 12GiB --seq-len 1024 --global-batch-size 64
  hf-memfit plan gpt2-xl --gpu-memory 12GiB --seq-len 1024 --global-batch-size 64 --accelerate-config-out plan.yaml
      # then: accelerate launch --config_file plan.yaml train.py (a DeepSpeed plan also writes plan.deepspeed.json)
  hf-memfit plan meta-llama/Llama-3.1-8B --gpu a10g --seq-len 2048 --global-batch-size 32 --load-in-4bit --lora-r 16
  hf-memfit plan meta-llama/Llama-2-70b-hf --gpu h100 --num-gpus 8 --seq-len 4096 --global-batch-size 64 \\
      --deepspeed-config-out ds_config.json --json
  hf-memfit plan meta-llama/Llama-2-70b-hf --gpu rtx4090 --num-gpus 2 --seq-len 2048 --global-batch-size 4 \\
      --load-in-4bit --lora-r 8 --cpu-memory 128GiB --accelerate-config-out fsdp.yaml
  hf-memfit plan gpt2-large --gpu rtx3060 --seq-len 1024 --global-batch-size 32 --explain plan.png
  hf-memfit plan Qwen/Qwen2.5-1.5B --gpu a10g --trainer sft --max-length 2048 --packing --global-batch-size 32
  hf-memfit plan meta-llama/Llama-3.2-1B --gpu-memory 24GiB --trainer dpo --max-length 1024 --global-batch-size 16
"""


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    add_step_arguments(parser, with_batch=False)
    parser.add_argument("--global-batch-size", type=positive_int, required=True,
                        help="samples per optimizer step over all GPUs; kept exactly")
    parser.add_argument("--gpu-memory", help="budget per GPU: a size (12GiB, 24GB) or `auto` for the local GPU")
    parser.add_argument("--allow-offload", choices=("none", "cpu", "nvme"), default="cpu",
                        help="how far DeepSpeed may offload when the GPU is too small (default: cpu)")
    parser.add_argument("--cpu-memory",
                        help="host RAM per node for offloaded state: a size (64GiB), `auto` (this machine) or `none`; "
                             "default: `auto` with `--gpu-memory auto`, else not checked")
    parser.add_argument("--nvme-path", help="NVMe directory for ZeRO-Infinity (with --allow-offload nvme)")
    parser.add_argument("--headroom", type=float, default=0.05, help="fraction of the budget kept free (default 0.05)")
    parser.add_argument("--keep-optimizer", action="store_true", help="do not switch AdamW to 8-bit variants")
    parser.add_argument("--use-liger-kernel", choices=("auto", "yes", "no"), default="auto",
                        help="search Liger's fused linear cross-entropy: auto (when liger-kernel is installed), "
                             "yes (it will be on the GPU machine), no")
    parser.add_argument("--tiled-mlp", choices=("auto", "yes", "no"), default="auto",
                        help="search ALST's TiledMLP (each MLP in sequence shards; one more MLP forward per step): "
                             "auto (on a GPU once a row spans two shards of hidden_size tokens), yes, no")
    parser.add_argument("--allow-pure-bf16", action="store_true",
                        help="allow bf16 weights with no fp32 master copy (torchao low-bit AdamW with bf16 "
                             "stochastic rounding) when no mixed-precision plan fits; it changes the numerics")
    parser.add_argument("--allow-freeze", action="store_true",
                        help="allow freezing the model's towers beside what it trains (a VLM's vision tower, a "
                             "wav2vec2 / HuBERT feature encoder, Whisper's encoder) when nothing fits with every "
                             "module trained; it changes what is trained")
    parser.add_argument("--allow-optimizers", default="", metavar="NAMES",
                        help="comma-separated optimizers that change the training dynamics the plan may use: "
                             "galore_adamw, galore_adamw_8bit, apollo_adamw, adafactor, and the layerwise "
                             "galore_adamw_layerwise, galore_adamw_8bit_layerwise, apollo_adamw_layerwise (planned "
                             "only with gradient accumulation 1 on one GPU, as the Trainer requires)")
    parser.add_argument("--optim", default="adamw_torch_fused", help="the optimizer to start from")
    parser.add_argument("--optim-target-modules",
                        help="with a GaLore / APOLLO --optim: comma-separated linear module names, or all-linear")
    parser.add_argument("--optim-args", help='with a GaLore / APOLLO --optim: TrainingArguments.optim_args, e.g. "rank=64"')
    parser.add_argument("--sp-size", default="auto", metavar="auto|N",
                        help="Ulysses sequence parallelism (DeepSpeed): split each sequence over N GPUs; auto "
                             "(default) searches it on 2+ GPUs when the sequence is 32K+ tokens or nothing fits "
                             "whole; 1 never splits")
    parser.add_argument("--cp-size", default="1", metavar="auto|N",
                        help="context parallelism (FSDP2 ring attention): split each sequence over N GPUs; auto "
                             "searches it like --sp-size; default 1 (off)")
    parser.add_argument("--deepspeed-config-out", help="write the plan's DeepSpeed config (JSON) here")
    parser.add_argument("--accelerate-config-out",
                        help="write the plan's accelerate config (YAML, for `accelerate launch --config_file`) here, "
                             "whatever the layout: one GPU, DDP, DeepSpeed (naming the DeepSpeed JSON; written "
                             "beside the YAML unless --deepspeed-config-out is given) or FSDP")
    parser.add_argument("--explain", nargs="?", const="", metavar="FILE.png",
                        help="also trace the chosen plan's step and show where the memory goes; with a path, draw it")


def cmd_plan(args: argparse.Namespace) -> int:
    from hf_memfit.planner.search import plan

    for flag in ("deepspeed_config_out", "accelerate_config_out"):  # before planning, not after
        if getattr(args, flag):
            check_writable(getattr(args, flag), "--" + flag.replace("_", "-"))
    if args.explain:
        check_writable(args.explain, "--explain")
    shape = step_shape(args)
    if shape["seq_len"] == "max":
        return _plan_longest(args, shape)
    result = plan(args.model, **shape, **_plan_kwargs(args))
    return _print_plan(args, result)


def _plan_kwargs(args: argparse.Namespace) -> dict:
    """`plan()`'s arguments from the plan flags, less the step's shape."""
    return dict(
        global_batch_size=args.global_batch_size, gpu_memory=args.gpu_memory,
        gpu=args.gpu, task=args.task, num_labels=args.num_labels, num_gpus=args.num_gpus, num_nodes=args.num_nodes,
        lora_r=args.lora_r, lora_alpha=args.lora_alpha, lora_target_modules=args.lora_target_modules,
        lora_target_regex=args.lora_target_regex, load_in_4bit=args.load_in_4bit,
        load_in_8bit=args.load_in_8bit,
        allow_offload=args.allow_offload, cpu_memory=args.cpu_memory, nvme_path=args.nvme_path,
        headroom=args.headroom, keep_optimizer=args.keep_optimizer, optim=args.optim, device=args.device,
        mode=args.mode, expandable_segments=args.expandable_segments, progress=_progress,
        allow_pure_bf16=args.allow_pure_bf16, allow_optimizers=args.allow_optimizers, allow_freeze=args.allow_freeze,
        use_liger_kernel={"auto": None, "yes": True, "no": False}[args.use_liger_kernel],
        tiled_mlp={"auto": None, "yes": True, "no": False}[args.tiled_mlp],
        optim_target_modules=args.optim_target_modules, optim_args=args.optim_args,
        sp_size=args.sp_size, cp_size=args.cp_size, inputs=media_inputs(args),
        prepare_model_for_kbit_training=kbit_preparation(args), ssm_kernels=args.ssm_kernels,
    )


def _plan_longest(args: argparse.Namespace, shape: dict) -> int:
    """`plan --seq-len max`: the longest sequence that fits, its plan, and (with --explain) how it scales."""
    from hf_memfit.planner.longest import check_seq_len_max_request, format_scaling, longest_seq_len

    kwargs = {**{k: v for k, v in shape.items() if k != "seq_len"}, **_plan_kwargs(args)}
    check_seq_len_max_request(kwargs)
    longest = longest_seq_len(args.model, **kwargs)
    args.seq_len = longest.seq_len  # what the configs and the TRL fields below are written for
    header = (f"Longest sequence that fits: {longest.seq_len:,} tokens (bounded by {longest.bound}; "
              f"{longest.probes} length{'s' if longest.probes != 1 else ''} planned)")
    explained = None
    if args.explain is not None:
        explained = format_scaling(longest)
        if args.explain:
            from hf_memfit.report.plot import plot_length_scaling

            plot_length_scaling(longest.scaling(), args.explain, title=f"{args.model}: the longest sequence that fits")
            print(f"hf-memfit: wrote {args.explain}", file=sys.stderr)
    return _print_plan(args, longest.result, header=header, longest=longest, scaling=explained)


def _print_plan(args: argparse.Namespace, result, *, header: str | None = None, longest=None,
                scaling: str | None = None) -> int:
    from hf_memfit.report.text import format_plan
    from hf_memfit.planner.accelerate import write_plan_configs

    notes, args.deepspeed_config_out = write_plan_configs(
        result.plan.settings, result.plan.deepspeed, args.accelerate_config_out, args.deepspeed_config_out)
    if result.plan.frozen and (args.accelerate_config_out or args.deepspeed_config_out):
        notes.append(f"the plan freezes {', '.join(result.plan.frozen)}, which no accelerate or DeepSpeed config "
                     "carries: MemFitTrainer applies it; in your own script call `requires_grad_(False)` on each "
                     "before the Trainer builds its optimizer (`--json` carries it as plan.frozen)")
    for note in notes:
        print(f"hf-memfit: note: {note}", file=sys.stderr)
    if args.json:
        output = longest.to_dict() if longest is not None else result.to_dict()
    else:
        output = (header + "\n\n" if header else "") + format_plan(result)
    if args.trainer != "trainer":
        fields = trl_config_fields(result.plan, args)
        if args.json:
            output["trl_config"] = fields
        else:
            output += "\n\n" + format_trl_config(args.trainer, fields)
    if scaling is not None:
        if not args.json:
            output += "\n\n" + scaling
    elif args.explain is not None:
        from hf_memfit.models.spec import resolve_model

        timelines = _trace(resolve_model(args.model), [("the plan", result.plan.settings)], args.explain, "--explain")
        if args.json:
            output["explain"] = _timeline_dict(timelines[0])
        else:
            from hf_memfit.report.text import format_timeline

            output += "\n\n" + format_timeline(timelines[0])
    emit(json.dumps(output, indent=2) if args.json else output)
    return 0


_TRL_CONFIGS = {"sft": "MemFitSFTConfig", "dpo": "MemFitDPOConfig"}


def trl_config_fields(chosen, args: argparse.Namespace) -> dict:
    """The MemFitSFTConfig / MemFitDPOConfig fields that give TRL the plan (and let the trainer re-check it)."""
    fields = {name: value for name, value in chosen.training_arguments().items()
              if name != "gradient_checkpointing_kwargs"}
    fields["max_length"] = args.max_length or args.seq_len
    if args.trainer == "sft":
        fields["packing"] = bool(args.packing)
        fields["padding_free"] = bool(args.padding_free or args.packing)
    if args.trainer == "dpo" and args.reference_model == "precomputed":
        fields["precompute_ref_log_probs"] = True
    if args.activation_offloading:
        fields["activation_offloading"] = True
    if chosen.deepspeed is not None:
        fields["deepspeed"] = args.deepspeed_config_out or "<the plan's DeepSpeed config: --deepspeed-config-out FILE>"
    if args.gpu_memory:
        fields["memory_budget"] = args.gpu_memory
    return fields


def format_trl_config(trainer: str, fields: dict) -> str:
    name = _TRL_CONFIGS[trainer]
    lines = [f"{name} fields to set (from hf_memfit import {name}, {name.replace('Config', 'Trainer')}):",
             f"  {name}(", "      output_dir=...,"]
    lines += [f"      {key}={value!r}," for key, value in fields.items()]
    lines.append("  )")
    return "\n".join(lines)


_EXPLAIN_EPILOG = """examples:
  hf-memfit explain gpt2 --batch-size 4 --seq-len 512 --plot gpt2.png
  hf-memfit explain gpt2-medium --batch-size 2 --seq-len 1024 --precision bf16-mixed --plot cmp.png \\
      --compare gradient_checkpointing=true --compare optim=adamw_bnb_8bit
"""


def cmd_explain(args: argparse.Namespace) -> int:
    from hf_memfit.report.text import format_timeline
    from hf_memfit.models.spec import resolve_model

    spec = resolve_model(args.model)
    base = settings_from_args(args).replace(mode="exact")
    configs = [("as given", base)] + [(text, _override(base, text)) for text in args.compare or []]
    timelines = _trace(spec, configs, args.plot)
    if args.json:
        emit(json.dumps([_timeline_dict(t) for t in timelines], indent=2))
    else:
        emit("\n\n".join(format_timeline(t) for t in timelines))
    return 0


def _trace(spec, configs, plot: str | None, flag: str = "--plot") -> list:
    """Trace each (label, settings) at full depth in exact mode, with progress on stderr; draw them to `plot` if given."""
    from hf_memfit.estimator.timeline import trace_timeline

    if plot:
        check_writable(plot, flag)  # before the (long) traces, not after
    timelines = []
    for label, settings in configs:
        settings = settings.replace(mode="exact").validate(spec)
        print(f"hf-memfit: tracing {spec.name} ({label}, {spec.num_layers} layers) ...", file=sys.stderr, flush=True)
        timelines.append(trace_timeline(spec, settings, label=f"{spec.name}: {label}"))
    if plot:
        from hf_memfit.report.plot import plot_timelines

        plot_timelines(timelines, plot, title=f"{spec.name}: memory over one training step")
        print(f"hf-memfit: wrote {plot}", file=sys.stderr)
    return timelines


def _progress(text: str) -> None:
    print(f"hf-memfit: {text} ...", file=sys.stderr, flush=True)


def _timeline_dict(t) -> dict:
    return {"label": t.label, "peak_bytes": t.peak_bytes, "device_total_bytes": t.device_total_bytes,
            "layout": t.layout, "peak_breakdown": t.peak_breakdown,
            "phases": [vars(p) for p in t.phases], "top_modules": t.top_modules}


def _override(settings, text: str):
    """'gradient_checkpointing=true,optim=adamw_bnb_8bit' -> settings with those fields changed."""
    changes = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or key not in settings.__dataclass_fields__:
            raise MemFitError(f"`--compare {text}`: give FIELD=VALUE pairs such as gradient_checkpointing=true or "
                              f"optim=adamw_bnb_8bit")
        current = getattr(settings, key)
        if isinstance(current, bool):
            changes[key] = value.strip().lower() in ("1", "true", "yes", "on")
        elif isinstance(current, int) and not isinstance(current, bool):
            try:
                changes[key] = int(value)
            except ValueError:
                raise MemFitError(f"`--compare {text}`: {key} takes an integer") from None
        else:
            changes[key] = value.strip()
    return settings.replace(**changes)


def build_parser() -> argparse.ArgumentParser:
    from hf_memfit import __version__

    parser = MemFitArgumentParser(prog="hf-memfit", description="Predict and fit the memory of Hugging Face fine-tuning, offline.")
    parser.add_argument("--version", action="version", version=f"hf-memfit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=MemFitArgumentParser)
    est = sub.add_parser("estimate", help="peak memory of one training step", epilog=_ESTIMATE_EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(est)
    est.add_argument("--vary-seq-len", type=int, metavar="MIN",
                     help="CUDA: also simulate a run of --micro-batches micro-batches whose lengths are drawn from MIN "
                          "to --seq-len, as dynamic padding makes them: the caching allocator's reserved peak over "
                          "the run, which grows past one step's, and the smallest card the whole run fits on (traces "
                          "the run at full depth: a minute for a 0.5B model, longer for larger ones)")
    est.add_argument("--vary-image-size", type=int, metavar="MIN",
                     help="with --vary-seq-len and --task image-text-to-text: also draw each micro-batch's square "
                          "image side from MIN to --image-size")
    est.add_argument("--micro-batches", type=int, default=None,
                     help="with --vary-seq-len: how many micro-batches the run has (default 64; an optimizer step "
                          "every --gradient-accumulation-steps)")
    est.set_defaults(func=cmd_estimate)
    pln = sub.add_parser("plan", help="the fastest configuration that fits a memory budget", epilog=_PLAN_EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_arguments(pln)
    pln.set_defaults(func=cmd_plan)
    exp = sub.add_parser("explain", help="where the memory goes: a traced step's timeline, by phase and module",
                         epilog=_EXPLAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(exp)
    exp.add_argument("--plot", help="write a stacked-area chart (PNG) of the step; needs matplotlib")
    exp.add_argument("--compare", action="append", metavar="FIELD=VALUE[,...]",
                     help="another configuration to draw beside the first (repeatable)")
    exp.set_defaults(func=cmd_explain)
    add_check_parser(sub)
    add_cache_parser(sub)
    return parser


class _ProgressOnStderr(logging.Handler):
    """Exact mode's progress lines on stderr (never stdout, which may carry --json).

    Shown at once on a terminal; otherwise (logs, pipes) only once the command has
    run for `quiet_seconds`, so quick commands print nothing extra.
    """

    QUIET_SECONDS = 1.0

    def __init__(self, stream=None, clock=None):
        import time

        super().__init__(logging.INFO)
        self.stream = stream or sys.stderr
        self.clock = clock or time.monotonic
        self.started = self.clock()

    def emit(self, record: logging.LogRecord) -> None:
        elapsed = self.clock() - self.started
        interactive = getattr(self.stream, "isatty", lambda: False)()
        if interactive or elapsed >= self.QUIET_SECONDS:
            self.stream.write(f"hf-memfit: [{elapsed:.0f} s] {record.getMessage()} ...\n")
            self.stream.flush()


@contextlib.contextmanager
def _progress_on_stderr():
    logger = logging.getLogger("hf_memfit.progress")
    handler = _ProgressOnStderr()
    previous = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous[0])
        logger.propagate = previous[1]


def main(argv: list[str] | None = None) -> int:
    # bitsandbytes warns on import, on CPUs with AVX512-BF16, that an optional 4-bit CPU
    # matmul kernel package is missing; estimating never runs that kernel.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # torchao (imported with the Trainer's optimizers in exact mode) warns on import when its CUDA-only
    # extensions do not load on this machine, and torch warns that torchao registers Enum pytree
    # constants; neither changes an estimate.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    with _progress_on_stderr():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
        with results_on_stdout():
            return args.func(args)
    except MemFitError as error:
        print(f"hf-memfit: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hf-memfit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`hf-memfit plan ... | head`): stop quietly, as Unix tools do.
        # Point stdout at devnull so the interpreter's final flush does not raise again.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def run() -> None:
    """The `hf-memfit` command (and `python -m hf_memfit.cli`): `main()`, then exit without Python's teardown.

    After an exact-mode trace, Python's own shutdown frees the imported torch, transformers and DeepSpeed module by
    module and object by object: 1.2 s of an eight-GPU `--seq-len max` that took 9.5 s (measured 2026-11-27), for
    memory the OS takes back at once. The exit handlers libraries registered (logging's flush, file locks,
    temporary directories, multiprocessing) still run first; the output is flushed.
    """
    _keep_freed_memory()
    from hf_memfit.estimator.forked import mark_idle_baseline  # the standard library only

    mark_idle_baseline()  # the first count of idle CPUs reads them over this command's start, without a sleep
    code = main()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # the reader went away, or the stream is closed
            pass
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


# glibc's `mallopt` parameters (malloc.h); values in bytes.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP_BYTES = 256 << 20


def _keep_freed_memory() -> None:
    """Let this process's malloc keep and reuse large blocks it frees, up to 256 MiB, instead of handing each back
    to the OS and faulting it in again on the next allocation.

    A trace's real tensors are the values a model reads (a VLM's pixels; `estimator/fake_vision.py`). SmolVLM's
    step reads its images' pixels, 30 MB an image at 17 tiles, and copies, compares and selects them, and glibc
    maps a block over its dynamic threshold (at most 32 MiB) with `mmap` and unmaps it on free: 150,000 page
    faults a trace, a third of its time in the kernel (docs/benchmarks.md, section 15, seventh session).
    Only the command's own process (and the children it forks for traces) is set; a library caller's process is
    left as it is. Where malloc is not glibc's, nothing changes. At 256 MiB, not more: what the process keeps free
    adds to its resident memory, and `hf-memfit check` trains for real (a GPT-2 check: 4.47 GB at most without
    this, 4.58 GB with it, 5.07 GB at 1 GiB)."""
    import ctypes

    try:  # the process's own symbols, libc's among them: no library search (`find_library` runs ldconfig)
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS's libc has no mallopt)
        return
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)
    mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES)


if __name__ == "__main__":
    run()

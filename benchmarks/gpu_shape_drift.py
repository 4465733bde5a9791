"""The caching allocator over a run of varying shapes: how far `max_memory_reserved` climbs past a step at the
largest shape (run on a GPU; docs/benchmarks.md section 19).

`hf-memfit check` measures two optimizer steps at one shape, the largest a run meets, and that is what the
estimate is for. A real run meets many shapes: dynamic padding makes every batch its own length, and a VLM's
images their own token counts. The caching allocator keeps the segments each shape made, and a block freed by
one shape may be too small, or split, for the next; `max_memory_reserved` (what ms-swift logs as `memory(GiB)`,
and what the Trainer's `OutOfMemoryError` is about) is the maximum over the whole run. This script measures that
maximum against the largest shape's own:

1. `--fixed-steps` optimizer steps at the largest shape in a fresh process (`check`'s measurement);
2. in another fresh process, `--micro-batches` micro-batches whose lengths (text tokens uniform in
   [`--min-seq-len`, `--seq-len`]) and square image sides (uniform over `--image-sizes`) are drawn with a fixed
   seed, an optimizer step every `--gradient-accumulation-steps` of them, recording after each micro-batch the
   running `max_memory_allocated`, `max_memory_reserved` and `memory_reserved`. The largest shape is drawn with
   the others, and the run is forced to meet it once, so the two maxima are of the same shapes.

The flags are `hf-memfit check`'s (the model, precision, LoRA, checkpointing ...), plus those above.
`--phase varying --cap-bytes N` runs the varying run alone on "a card of N bytes": past N the allocator frees its
cached blocks and retries, and raises an OOM only when that is not enough. `report` tables the JSON files
(`gpu_session.sh`'s part `drift` merges one call's runs into one).

    python benchmarks/gpu_shape_drift.py Qwen/Qwen2.5-0.5B --batch-size 4 --seq-len 1024 --min-seq-len 128 \
        --precision bf16-mixed --gradient-accumulation-steps 4 --micro-batches 64 --out drift.json
    python benchmarks/gpu_shape_drift.py report benchmarks/results/gpu_h200_2/drift*.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse(argv=None) -> argparse.Namespace:
    from hf_memfit.cli.arguments import add_step_arguments

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_step_arguments(parser)
    parser.add_argument("--min-seq-len", type=int, required=True, help="shortest text length drawn")
    parser.add_argument("--image-sizes", default=None,
                        help="VLMs: LO:HI:STEP, square image sides drawn (the largest is --image-size)")
    parser.add_argument("--micro-batches", type=int, default=64)
    parser.add_argument("--fixed-steps", type=int, default=2)
    parser.add_argument("--cap-bytes", type=int, default=None,
                        help="varying run only (--phase varying): cap what the allocator may reserve "
                             "(torch.cuda.set_per_process_memory_fraction), as a card of that size would; past it "
                             "the allocator frees its cached blocks and retries before it raises an OOM")
    parser.add_argument("--phase", choices=("both", "fixed", "varying"), default="both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", dest="json_out", required=True, help="the JSON file to write")
    return parser.parse_args(argv)


def run_phase(args) -> dict:
    import torch

    from hf_memfit.cli.arguments import settings_from_args
    from hf_memfit.estimator.measure_device import measure_varying
    from hf_memfit.estimator.run_of_shapes import varying_shapes
    from hf_memfit.models.spec import resolve_model

    spec = resolve_model(args.model)
    cuda = torch.cuda.is_available()  # without one, the loop runs on the CPU and reads no allocator (a smoke test)
    args.device = "cuda" if cuda else "cpu"
    settings = settings_from_args(args).validate(spec)
    torch.manual_seed(args.seed)
    if cuda and args.cap_bytes:
        torch.cuda.set_per_process_memory_fraction(args.cap_bytes / torch.cuda.get_device_properties(0).total_memory)
    if args.phase == "fixed":  # check's steps: at most two micro-batches each, at the largest shape
        settings = settings.replace(gradient_accumulation_steps=min(settings.gradient_accumulation_steps, 2))
        shapes = [(settings.seq_len, settings.image_size)] * (args.fixed_steps * settings.gradient_accumulation_steps)
    else:
        sides = ()
        if args.image_sizes:
            lo, hi, step = (int(x) for x in args.image_sizes.split(":"))
            sides = tuple(range(lo, hi + 1, step))
        shapes = varying_shapes(settings, min_seq_len=args.min_seq_len, micro_batches=args.micro_batches,
                                seed=args.seed, image_sizes=sides)

    def progress(done, total, last):
        if done % 16 == 0:
            print(f"  {args.phase}: {done}/{total} micro-batches, max reserved {last['max_reserved'] / 2**30:.2f} GiB",
                  file=sys.stderr, flush=True)

    result = measure_varying(spec.config, settings, shapes, progress=progress)
    if result["oom"]:
        print(f"  {args.phase}: OOM at micro-batch {result['oom']['micro_batch'] + 1} "
              f"({result['oom']['seq_len']} tokens)", file=sys.stderr, flush=True)
    return {"phase": args.phase, "cap_bytes": args.cap_bytes, "settings": settings.to_dict(), **result}


def report(paths: list[str]) -> list[str]:
    """Markdown tables of merged drift files: the uncapped runs (fixed vs varying), then the capped ones."""
    GiB = 2**30
    runs = {}
    for path in paths:
        with open(path) as f:
            runs.update(json.load(f))
    lines = ["| run | fixed: allocated / reserved | varying: allocated / reserved | reserved, varying / fixed |",
             "|---|---:|---:|---:|"]
    for name, run in runs.items():
        if "summary" in run:
            fixed, varying = run["fixed"], run["varying"]
            lines.append(f"| {name} | {fixed['max_allocated'] / GiB:.2f} / {fixed['max_reserved'] / GiB:.2f} GiB | "
                         f"{varying['max_allocated'] / GiB:.2f} / {varying['max_reserved'] / GiB:.2f} GiB | "
                         f"{varying['max_reserved'] / fixed['max_reserved']:.2f}x |")
    lines += ["", "| run | cap | micro-batches run | max reserved | allocator retries | OOM |", "|---|---:|---:|---:|---:|---|"]
    for name, run in runs.items():
        if "summary" not in run:
            cap = f"{run['cap_bytes'] / GiB:.2f} GiB" if run.get("cap_bytes") else "none"
            oom = run.get("oom")
            where = (f"at micro-batch {oom['micro_batch'] + 1} ({oom['seq_len']} tokens"
                     f"{', image ' + str(oom['image_size']) + ' px' if oom.get('image_size') else ''})") if oom else "no"
            lines.append(f"| {name} | {cap} | {len(run['trace'])} | {run['max_reserved'] / GiB:.2f} GiB | "
                         f"{run['num_alloc_retries']} | {where} |")
    return lines


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        print("\n".join(report(argv[1:])))
        return 0
    args = parse(argv)
    if args.phase != "both":
        result = run_phase(args)
        with open(args.json_out, "w") as f:
            json.dump(result, f)
        return 0
    results = {}
    for phase in ("fixed", "varying"):  # each in a fresh process: a fresh allocator, as a fresh run has
        out = f"{args.json_out}.{phase}"
        subprocess.run([sys.executable, __file__, *argv, "--phase", phase, "--out", out], check=True)
        with open(out) as f:
            results[phase] = json.load(f)
        os.remove(out)
    fixed, varying = results["fixed"], results["varying"]
    summary = {"model": args.model, "fixed": {k: fixed[k] for k in ("max_allocated", "max_reserved")},
               "varying": {k: varying[k] for k in ("max_allocated", "max_reserved", "num_alloc_retries")},
               "reserved_ratio": varying["max_reserved"] / max(fixed["max_reserved"], 1),
               "allocated_ratio": varying["max_allocated"] / max(fixed["max_allocated"], 1)}
    with open(args.json_out, "w") as f:
        json.dump({"summary": summary, **results}, f)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

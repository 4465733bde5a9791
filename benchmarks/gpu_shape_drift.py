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
import random
import subprocess
import sys
import time

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


def shapes(args) -> list[tuple[int, int | None]]:
    """(text tokens, image side) per micro-batch: drawn with the seed, the largest placed at a drawn position."""
    rng = random.Random(args.seed)
    sides = [None]
    if args.image_sizes:
        lo, hi, step = (int(x) for x in args.image_sizes.split(":"))
        sides = list(range(lo, hi + 1, step))
    drawn = [(rng.randint(args.min_seq_len, args.seq_len), rng.choice(sides)) for _ in range(args.micro_batches)]
    drawn[rng.randrange(len(drawn))] = (args.seq_len, args.image_size)
    return drawn


def run_phase(args) -> dict:
    import torch

    from hf_memfit.cli.arguments import settings_from_args
    from hf_memfit.estimator import step as training
    from hf_memfit.estimator.measure_device import build_on_cuda, cublas_workspace_probe
    from hf_memfit.models.spec import resolve_model

    spec = resolve_model(args.model)
    cuda = torch.cuda.is_available()  # without one, the loop runs on the CPU and reads no allocator (a smoke test)
    args.device = device = "cuda" if cuda else "cpu"
    settings = settings_from_args(args).validate(spec)
    torch.manual_seed(args.seed)
    if cuda:
        torch.cuda.memory._set_allocator_settings(
            f"expandable_segments:{'True' if settings.expandable_segments else 'False'}")
        cublas_workspace_probe(settings)
        if args.cap_bytes:
            torch.cuda.set_per_process_memory_fraction(args.cap_bytes / torch.cuda.get_device_properties(0).total_memory)
        torch.cuda.reset_peak_memory_stats()
        model, optimizer = build_on_cuda(spec.config, settings)
    else:
        model = training.build_model(spec.config, settings)
        optimizer = training.make_optimizer(model, settings)
    read = (lambda name: getattr(torch.cuda, name)()) if cuda else (lambda name: 0)
    gas = settings.gradient_accumulation_steps
    if args.phase == "fixed":
        plan = [(args.seq_len, args.image_size)] * (args.fixed_steps * min(gas, 2))
        gas = min(gas, 2)  # check's steps: at most two micro-batches each
    else:
        plan = shapes(args)
    trace, started, oom = [], time.perf_counter(), None
    for index, (seq_len, side) in enumerate(plan):
        shaped = settings.replace(seq_len=seq_len, image_size=side) if side else settings.replace(seq_len=seq_len)
        batch = training.make_batch(shaped, spec.config, device=device)
        tokens = int(batch["input_ids"].shape[-1]) if "input_ids" in batch else None
        stepped = (index + 1) % gas == 0
        try:
            training.forward_backward(model, batch, shaped, device_type=device)
            del batch
            if stepped:
                training.optimizer_step(model, optimizer, cuda_semantics=cuda)
        except torch.OutOfMemoryError as error:  # under --cap-bytes: where the run would have stopped
            oom = {"micro_batch": index, "seq_len": seq_len, "image_size": side, "error": str(error)[:400]}
            print(f"  {args.phase}: OOM at micro-batch {index + 1} ({seq_len} tokens)", file=sys.stderr, flush=True)
            break
        if cuda:
            torch.cuda.synchronize()
        trace.append({"seq_len": seq_len, "image_size": side, "row_tokens": tokens, "optimizer_step": stepped,
                      "max_allocated": read("max_memory_allocated"), "max_reserved": read("max_memory_reserved"),
                      "reserved": read("memory_reserved")})
        if index % 16 == 15:
            print(f"  {args.phase}: {index + 1}/{len(plan)} micro-batches, max reserved "
                  f"{trace[-1]['max_reserved'] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    stats = torch.cuda.memory_stats() if cuda else {}
    return {"phase": args.phase, "cap_bytes": args.cap_bytes, "oom": oom, "settings": settings.to_dict(),
            "seconds": round(time.perf_counter() - started, 1), "num_ooms": stats.get("num_ooms", 0),
            "max_allocated": read("max_memory_allocated"), "max_reserved": read("max_memory_reserved"),
            "num_alloc_retries": stats.get("num_alloc_retries", 0), "segments": stats.get("segment.all.peak", 0),
            "trace": trace}


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

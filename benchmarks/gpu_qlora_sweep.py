"""Long-context QLoRA measured on a GPU: one real 4-bit model, trained at several sequence lengths.

The held-out long-context QLoRA set (section 16, `long_context_qlora.py`) gives one published length per
card, and most of its cells lie on one extrapolated line. This measures the line itself on whatever GPU
runs it: Llama-3.1-8B (random weights, packed by bitsandbytes as `from_pretrained` packs a checkpoint),
NF4 with double quantisation, LoRA r=32 on all linear layers, gradient checkpointing, batch 1, bf16 compute,
peft's `prepare_model_for_kbit_training` (the plain Trainer's recipe), through the same step code
`hf-memfit check` runs (`estimator.measure_device`). The model is built once; each length then runs its
steps after the allocator's cache is emptied and its peak statistics reset, so each row's peaks are that
length's own.

Two phases, so the GPU's time goes to measuring only:

    python benchmarks/gpu_qlora_sweep.py measure --seq 1024,8192,28454 --json sweep.json   # on the GPU
    python benchmarks/gpu_qlora_sweep.py predict sweep.json                                 # anywhere

`predict` adds both modes' predictions for each measured row (the settings it recorded, the GPU it ran on)
and prints the errors, the measured per-token slope, and the longest length the measured line fits on each
card of section 16.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")
GiB = 2**30

MODEL = "meta-llama/Llama-3.1-8B"
SETTINGS = dict(batch_size=1, precision="bf16-mixed", load_in_4bit=True, bnb_4bit_use_double_quant=True,
                lora_r=32, lora_alpha=64,
                lora_target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                gradient_checkpointing=True, optim="adamw_torch", prepare_model_for_kbit_training="yes")
CARDS_GB = (12, 16, 24, 40, 48, 80)


def _settings(spec, seq: int, attn: str, gpu: str | None):
    from hf_memfit.settings import TrainSettings

    return TrainSettings(**SETTINGS, seq_len=seq, attn_implementation=attn, device="cuda", gpu=gpu).validate(spec)


def _spec(num_layers: int | None):
    from hf_memfit.models.spec import ModelSpec, resolve_model

    spec = resolve_model(MODEL)
    if num_layers is None:
        return spec
    return ModelSpec.from_config(f"{MODEL} ({num_layers} layers)", dict(spec.config, num_hidden_layers=num_layers))


def measure(args) -> int:
    import torch

    from hf_memfit.cli.check import _local_gpu_name, machine_info
    from hf_memfit.estimator.measure_device import (
        build_on_cuda,
        cublas_workspace_probe,
        process_device_bytes,
        train_on_cuda,
    )

    if not torch.cuda.is_available():
        print("gpu_qlora_sweep.py measure: needs a CUDA GPU (run `predict` here on a measured JSON)", file=sys.stderr)
        return 2
    seqs = sorted(int(s) for s in args.seq.split(","))
    gpu = _local_gpu_name(None)
    # without the flash-attn package, SDPA's flash backend (bf16, causal, no padding mask): the same O(n) memory
    attn = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"
    spec = _spec(args.layers)
    settings = _settings(spec, seqs[0], attn, gpu)
    torch.cuda.init()
    torch.manual_seed(0)
    workspace = cublas_workspace_probe(settings)
    started = time.perf_counter()
    model, optimizer = build_on_cuda(spec.config, settings)
    build_seconds = time.perf_counter() - started
    print(f"built {spec.name} in {build_seconds:.0f} s; attention {attn}; GPU {torch.cuda.get_device_name()}",
          flush=True)
    rows = []
    document = {"model": spec.name, "num_layers": args.layers, "machine": machine_info("cuda"), "gpu": gpu,
                "attn_implementation": attn, "build_seconds": build_seconds, "cublas_workspace_bytes": workspace,
                "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in SETTINGS.items()}, "rows": rows}
    for i, seq in enumerate(seqs):
        at = settings.replace(seq_len=seq)
        steps = args.steps if i == 0 else 1  # the optimizer's states exist after the first length's steps
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        row = {"seq_len": seq, "steps": steps}
        try:
            times = []
            for _ in range(steps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                train_on_cuda(model, optimizer, spec.config, at, steps=1)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
            context = process_device_bytes() - torch.cuda.memory_reserved()
            row.update(peak_allocated_bytes=allocated, peak_reserved_bytes=reserved, cuda_context_bytes=context,
                       device_total_bytes=reserved + context, step_seconds=times[-1],
                       tokens_per_second=seq / times[-1])
            print(f"seq {seq}: allocated {allocated / GiB:.2f} GiB, reserved {reserved / GiB:.2f} GiB, "
                  f"context {context / GiB:.2f} GiB, step {times[-1]:.1f} s", flush=True)
        except torch.cuda.OutOfMemoryError as error:
            row["out_of_memory"] = str(error).splitlines()[0][:300]
            print(f"seq {seq}: out of memory", flush=True)
            model.zero_grad(set_to_none=True)
        rows.append(row)
        with open(args.json, "w", encoding="utf-8") as f:  # after every row: a killed run keeps what it measured
            json.dump(document, f, indent=2)
    return 0


def _error(row: dict, mode: str, key: str) -> float:
    return 100 * (row["predicted"][mode][key] - row[key]) / row[key]


def predict(args) -> int:
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from hf_memfit.estimator.assemble import estimate_settings

    with open(args.json, encoding="utf-8") as f:
        document = json.load(f)
    spec = _spec(document["num_layers"])
    gpu, attn = document["gpu"], document["attn_implementation"]
    print(f"{document['model']} QLoRA on {document['machine']['device_name']} (hf-memfit GPU {gpu}), "
          f"attention {attn}, torch {document['machine']['torch']}, bitsandbytes {document['machine']['bitsandbytes']}")
    print("| seq | measured allocated | fast | error | exact | error | measured reserved | fast | exact "
          "| measured device total | fast | exact |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    measured_rows = [row for row in document["rows"] if "peak_allocated_bytes" in row]
    for row in measured_rows:
        settings = _settings(spec, row["seq_len"], attn, gpu)
        sink = io.StringIO()
        with redirect_stdout(sink), redirect_stderr(sink):
            est = {mode: estimate_settings(spec, settings.replace(mode=mode)) for mode in args.modes.split(",")}
        row["predicted"] = {mode: {"peak_allocated_bytes": e.peak_allocated_bytes,
                                   "peak_reserved_bytes": e.peak_reserved_bytes,
                                   "device_total_bytes": e.device_total_bytes, "breakdown": e.breakdown,
                                   "peak_region": e.peak_region} for mode, e in est.items()}
        cells = [f"{row['seq_len']:,}", f"{row['peak_allocated_bytes'] / GiB:.2f} GiB"]
        for mode in est:
            cells += [f"{row['predicted'][mode]['peak_allocated_bytes'] / GiB:.2f} GiB",
                      f"{_error(row, mode, 'peak_allocated_bytes'):+.1f}%"]
        cells.append(f"{row['peak_reserved_bytes'] / GiB:.2f} GiB")
        cells += [f"{row['predicted'][mode]['peak_reserved_bytes'] / GiB:.2f} GiB" for mode in est]
        cells.append(f"{row['device_total_bytes'] / GiB:.2f} GiB")
        cells += [f"{row['predicted'][mode]['device_total_bytes'] / GiB:.2f} GiB" for mode in est]
        print("| " + " | ".join(cells) + " |", flush=True)
    if len(measured_rows) >= 2 and document["num_layers"] is None:
        first, last = measured_rows[0], measured_rows[-1]
        for key in ("peak_allocated_bytes", "device_total_bytes"):
            slope = (last[key] - first[key]) / (last["seq_len"] - first["seq_len"])
            fixed = first[key] - slope * first["seq_len"]
            print(f"measured {key.removesuffix('_bytes')}: {fixed / GiB:.2f} GiB + {slope / 2**10:.1f} KiB a token; "
                  "on a line through the first and last lengths, longest that fits: " + ", ".join(
                      f"{gb} GB {max(0, int((gb * GiB - fixed) / slope)):,}" for gb in CARDS_GB))
    out = args.out or args.json
    with open(out, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=2)
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="phase", required=True)
    m = sub.add_parser("measure", help="on a CUDA GPU: build once, train at each length, write the peaks")
    m.add_argument("--seq", default="1024,8192,28454", help="comma-separated sequence lengths (ascending order run)")
    m.add_argument("--layers", type=int, default=None, help="truncate the model to this many layers")
    m.add_argument("--steps", type=int, default=2, help="steps at the first length (later lengths run one)")
    m.add_argument("--json", required=True)
    p = sub.add_parser("predict", help="anywhere: add both modes' predictions to a measured JSON")
    p.add_argument("json")
    p.add_argument("--modes", default="fast,exact")
    p.add_argument("--out", default=None, help="write here instead of over the input")
    args = parser.parse_args(argv)
    return measure(args) if args.phase == "measure" else predict(args)


if __name__ == "__main__":
    sys.exit(main())

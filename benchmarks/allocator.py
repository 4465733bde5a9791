"""Allocator slack: where `cuda_overhead.ALLOCATOR_FRAGMENTATION_RATIO` comes from, and how well it does.

For each configuration below the real training step is traced at the model's
FULL depth on fake CUDA tensors (exact mode's tracer, no extrapolation), and
its allocation/free sequence is replayed through `CachingAllocatorSimulator`
(a re-implementation of c10/cuda/CUDACachingAllocator.cpp's default rules).
Two figures per configuration:

- `free gap`: the simulator's reserved peak minus the allocated peak on an
  unlimited device (what `memory_reserved` would show on a much larger GPU);
- `need gap`: the smallest device capacity on which the whole sequence runs
  (the allocator frees its cache and retries before it raises an OOM, exactly
  as torch does) minus the allocated peak. This is what decides whether a
  step fits, so it is what the estimator adds.

The shared slack model (both estimator modes) is
`ALLOCATOR_FRAGMENTATION_RATIO x (activations + temporaries at the peak)`; the
benchmark prints each configuration's ratio, their quantiles, and the model's
error against the replay on the device total.

    python benchmarks/allocator.py                 # all rows (~3 minutes)
    python benchmarks/allocator.py --json out.json

The rows were chosen to span families, precisions, checkpointing, LoRA and
8-bit states before the constant was fitted; none is tuned.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

MiB = 2**20

ROWS = [
    ("gpt2", dict(batch_size=4, seq_len=512, precision="fp32")),
    ("gpt2", dict(batch_size=2, seq_len=1024, precision="bf16-mixed")),
    ("gpt2", dict(batch_size=8, seq_len=512, precision="bf16-mixed", gradient_checkpointing=True)),
    ("gpt2", dict(batch_size=4, seq_len=512, precision="fp32", optim="adamw_bnb_8bit")),
    ("gpt2-medium", dict(batch_size=2, seq_len=512, precision="bf16-mixed")),
    ("gpt2-large", dict(batch_size=1, seq_len=1024, precision="fp32")),
    ("google-bert/bert-base-uncased", dict(batch_size=16, seq_len=128, precision="fp32")),
    ("google-bert/bert-base-uncased", dict(batch_size=8, seq_len=512, precision="fp16-mixed",
                                           attn_implementation="eager")),
    ("google-t5/t5-small", dict(batch_size=8, seq_len=256, precision="fp32")),
    ("facebook/opt-125m", dict(batch_size=4, seq_len=512, precision="bf16-mixed")),
    ("facebook/opt-350m", dict(batch_size=2, seq_len=512, precision="fp16-mixed", gradient_checkpointing=True)),
    ("EleutherAI/pythia-160m", dict(batch_size=4, seq_len=512, precision="bf16-mixed", gradient_checkpointing=True)),
    ("EleutherAI/pythia-160m", dict(batch_size=4, seq_len=512, precision="bf16-mixed")),
    ("Qwen/Qwen2.5-0.5B", dict(batch_size=1, seq_len=512, precision="bf16-mixed", lora_r=16)),
    ("Qwen/Qwen2.5-0.5B", dict(batch_size=2, seq_len=256, precision="bf16")),
    ("Qwen/Qwen2.5-0.5B", dict(batch_size=4, seq_len=512, precision="bf16-mixed", gradient_checkpointing=True,
                               optim="adamw_bnb_8bit")),
    ("meta-llama/Llama-3.2-1B", dict(batch_size=1, seq_len=1024, precision="bf16-mixed", lora_r=16,
                                     gradient_checkpointing=True)),
    ("meta-llama/Llama-3.2-1B", dict(batch_size=2, seq_len=512, precision="bf16-mixed")),
]


def measure(name, settings: dict) -> dict:
    """One row: `name` a catalogue name (or a `ModelSpec`), `settings` TrainSettings fields."""
    from hf_memfit.estimator import trace
    from hf_memfit.estimator.run_of_shapes import needed_capacity, replay
    from hf_memfit.settings import TrainSettings
    from hf_memfit.models.depths import config_with_depths, real_depths
    from hf_memfit.models.spec import resolve_model

    spec = resolve_model(name) if isinstance(name, str) else name
    s = TrainSettings(device="cuda", mode="exact", **settings).validate(spec)
    depths = real_depths(spec)
    t0 = time.perf_counter()
    # A full first step before the measured one, as on a GPU: the allocator's cache then holds what a step of this
    # shape left (the estimator's warm-up is the optimizer step alone, which leaves the cache nearly empty).
    traced = trace.trace_step(config_with_depths(spec, depths), s, depths, short_warm_up=False)
    events, allocated = traced.tracker.events, traced.peak_bytes
    free_reserved = replay(events)[0].peak_reserved_bytes
    # the sequence runs at `free_reserved`; the smallest capacity that does, by bisection to 2 MiB
    hi = needed_capacity(events, low=allocated, high=free_reserved, precision=2 * MiB)
    at_peak = traced.tracker.breakdown_at(traced.tracker.peak_clock)
    transient = at_peak["activations"] + at_peak["temporary"]
    return {"model": name if isinstance(name, str) else spec.name, "settings": settings, "allocated": allocated, "transient": transient,
            "free_gap": free_reserved - allocated, "need_gap": hi - allocated,
            "ratio": (hi - allocated) / transient if transient else 0.0,
            "seconds": round(time.perf_counter() - t0, 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--measured-from", help="re-score the rows of an earlier --json run (no tracing)")
    args = parser.parse_args(argv)
    from hf_memfit.estimator.cuda_overhead import ALLOCATOR_FRAGMENTATION_RATIO

    earlier = json.load(open(args.measured_from))["rows"] if args.measured_from else None
    rows = []
    print(f"{'model':32s} {'settings':70s} {'alloc':>9s} {'act+tmp':>9s} {'free gap':>9s} {'need gap':>9s} "
          f"{'ratio':>6s} {'model err':>9s}")
    for n, (name, settings) in enumerate(ROWS):
        r = earlier[n] if earlier else measure(name, settings)
        modelled = ALLOCATOR_FRAGMENTATION_RATIO * r["transient"]
        r["model_error_pct"] = 100 * (modelled - r["need_gap"]) / (r["allocated"] + r["need_gap"])
        rows.append(r)
        text = ", ".join(f"{k}={v}" for k, v in settings.items())
        print(f"{name:32s} {text[:70]:70s} {r['allocated'] / MiB:9.1f} {r['transient'] / MiB:9.1f} "
              f"{r['free_gap'] / MiB:9.1f} {r['need_gap'] / MiB:9.1f} {r['ratio']:6.3f} {r['model_error_pct']:+8.1f}%",
              flush=True)
    ratios = sorted(r["ratio"] for r in rows)
    q = statistics.quantiles(ratios, n=4)
    errors = [abs(r["model_error_pct"]) for r in rows]
    print(f"\nneed gap / (activations + temporaries): min {ratios[0]:.3f}, quartiles {q[0]:.3f} / {q[1]:.3f} / "
          f"{q[2]:.3f}, max {ratios[-1]:.3f} over {len(rows)} rows")
    print(f"model ({ALLOCATOR_FRAGMENTATION_RATIO} x act+tmp) vs replay on allocated + slack: median |error| "
          f"{statistics.median(errors):.1f}%, max {max(errors):.1f}%; under-predicted rows: "
          f"{sum(r['model_error_pct'] < 0 for r in rows)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "ratio_quartiles": q}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())

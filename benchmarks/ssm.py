"""State-space models: the torch fallback against the CPU allocator, and the two kernel paths at real sizes.

Part 1 (`fallback`): tiny Mamba, Mamba-2, Jamba, Falcon-H1 and Zamba2 built from configs run a real training
step on the CPU (transformers' torch fallback: no mamba-ssm here) under the PyTorch profiler
(`measure_cpu_peak`), against exact mode with `device="cpu"` (which is the fallback path).

Part 2 (`paths`): catalogue models at real sizes, exact mode on an H100 (bf16-mixed, AdamW, batch 1): the
CUDA kernel path (mamba-ssm / causal-conv1d stand-ins, `estimator/ssm_kernels.py`) against the torch
fallback. No GPU was available here, so the kernel path is a prediction from the kernels' source, not a
measurement.

    python benchmarks/ssm.py --json benchmarks/results/ssm.json            # both parts (~15 min on 2 cores)
    python benchmarks/ssm.py --part fallback                               # part 1 only (~1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from hf_memfit.estimator import estimate_settings  # noqa: E402
from hf_memfit.estimator.measure import measure_cpu_peak  # noqa: E402
from hf_memfit.estimator.exact import exact_candidates  # noqa: E402
from hf_memfit.models.spec import ModelSpec, resolve_model  # noqa: E402
from hf_memfit.settings import TrainSettings  # noqa: E402

TINY = {
    "mamba": dict(model_type="mamba", hidden_size=64, intermediate_size=128, state_size=16, num_hidden_layers=4,
                  vocab_size=256, time_step_rank=8, conv_kernel=4),
    "mamba2": dict(model_type="mamba2", hidden_size=64, expand=2, num_heads=8, head_dim=16, state_size=16,
                   n_groups=1, num_hidden_layers=4, vocab_size=256, chunk_size=32, conv_kernel=4),
    "jamba": dict(model_type="jamba", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256, mamba_d_state=16, mamba_d_conv=4,
                  mamba_expand=2, mamba_dt_rank=8, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=2, num_experts_per_tok=1),
    "falcon_h1": dict(model_type="falcon_h1", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, mamba_d_state=16,
                      mamba_d_conv=4, mamba_expand=2, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1,
                      mamba_chunk_size=32, mamba_d_ssm=128),
    "zamba2": dict(model_type="zamba2", hidden_size=64, num_hidden_layers=4,
                   layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=256, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                   mamba_ngroups=1, n_mamba_heads=8, chunk_size=32, attention_head_dim=16, intermediate_size=128),
}
FALLBACK_SETTINGS = [dict(batch_size=2, seq_len=32), dict(batch_size=2, seq_len=64, precision="bf16-mixed")]

# (catalogue model, seq_len, settings): the fallback path is traced only where its per-token loop is affordable
REAL = [
    ("state-spaces/mamba-2.8b-hf", 2048, {}),
    ("state-spaces/mamba-2.8b-hf", 2048, {"lora_r": 8, "lora_target_modules": ("in_proj", "x_proj")}),
    ("state-spaces/mamba-2.8b-hf", 2048, {"gradient_checkpointing": True}),
    ("ai21labs/Jamba-v0.1", 512, {"lora_r": 8, "lora_target_modules": ("in_proj", "x_proj"), "load_in_4bit": True}),
]


def fallback_rows() -> list[dict]:
    rows = []
    for name, config in TINY.items():
        spec = ModelSpec.from_config(f"tiny-{name}", config)
        for changes in FALLBACK_SETTINGS:
            settings = TrainSettings(device="cpu", mode="exact", **changes).validate(spec)
            predicted = exact_candidates(spec, settings).peak_bytes
            measured = measure_cpu_peak(spec.config, settings)
            row = dict(model=name, **changes, predicted=predicted, measured=measured,
                       error_pct=round(100 * (predicted - measured) / measured, 2))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def path_rows() -> list[dict]:
    rows = []
    for model, seq, changes in REAL:
        spec = resolve_model(model)
        row = dict(model=model, seq_len=seq, **{k: list(v) if isinstance(v, tuple) else v for k, v in changes.items()})
        for path in ("cuda", "torch"):
            start = time.time()
            e = estimate_settings(spec, TrainSettings(batch_size=1, seq_len=seq, mode="exact", precision="bf16-mixed",
                                                      gpu="h100", ssm_kernels=path, **changes))
            row[path] = dict(peak_allocated_gib=round(e.peak_allocated_bytes / 2**30, 2),
                             activations_gib=round(e.breakdown["activations"] / 2**30, 2),
                             temporary_gib=round(e.breakdown["temporary"] / 2**30, 2), peak_region=e.peak_region,
                             seconds=round(time.time() - start, 1))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("fallback", "paths", "all"), default="all")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = {}
    if args.part in ("fallback", "all"):
        results["fallback"] = rows = fallback_rows()
        errors = sorted(abs(r["error_pct"]) for r in rows)
        print(f"fallback vs CPU allocator: median |error| {errors[len(errors) // 2]:.2f}%, max {errors[-1]:.2f}%")
    if args.part in ("paths", "all"):
        results["paths"] = path_rows()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

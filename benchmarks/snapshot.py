"""A snapshot of what the estimator and planner compute, to show a refactor changes nothing.

Writes every estimate's and plan's `to_dict()` for a fixed matrix of models and settings
(fast mode over hand-written families, exact mode on a few, plans on three budgets) as
JSON. Run it before and after a change and compare the files: the restructuring of
issue 20 was checked this way (`benchmarks/results/snapshot_before.json`).

    python benchmarks/snapshot.py --json before.json
    python benchmarks/snapshot.py --json after.json --compare before.json
"""

from __future__ import annotations

import argparse
import json
import sys

import hf_memfit

FAST_MODELS = ("gpt2", "gpt2-xl", "bert-large-uncased", "t5-base", "facebook/opt-1.3b", "EleutherAI/pythia-1b",
               "meta-llama/Llama-3.1-8B", "mistralai/Mistral-7B-v0.1", "google/gemma-2-2b",
               "microsoft/Phi-3-mini-4k-instruct", "meta-llama/Llama-3.1-70B")
FAST_SETTINGS = (
    {"batch_size": 1, "seq_len": 512},
    {"batch_size": 4, "seq_len": 1024, "precision": "bf16-mixed", "gradient_checkpointing": True, "gpu": "A100-80GB"},
    {"batch_size": 2, "seq_len": 512, "precision": "bf16", "optim": "adamw_bnb_8bit", "gpu": "RTX3060"},
    {"batch_size": 2, "seq_len": 1024, "precision": "bf16-mixed", "lora_r": 16, "gpu": "A10G"},
    {"batch_size": 1, "seq_len": 2048, "precision": "bf16-mixed", "lora_r": 16, "load_in_4bit": True,
     "gradient_checkpointing": True, "gpu": "RTX4090"},
    {"batch_size": 2, "seq_len": 512, "precision": "bf16-mixed", "num_gpus": 4, "zero_stage": 3, "gpu": "H100"},
    {"batch_size": 2, "seq_len": 512, "precision": "bf16-mixed", "num_gpus": 2, "zero_stage": 2,
     "offload_optimizer": "cpu", "gpu": "A10G", "gradient_accumulation_steps": 4},
    {"batch_size": 1, "seq_len": 1024, "precision": "bf16-mixed", "num_gpus": 2, "fsdp": "full_shard", "gpu": "H100"},
    {"batch_size": 2, "seq_len": 256, "device": "cpu", "optim": "adafactor"},
)
EXACT_ROWS = (
    ("gpt2", {"batch_size": 2, "seq_len": 256, "device": "cpu"}),
    ("gpt2", {"batch_size": 2, "seq_len": 512, "precision": "bf16-mixed", "gradient_checkpointing": True,
              "gpu": "A10G"}),
    ("meta-llama/Llama-3.2-1B", {"batch_size": 1, "seq_len": 1024, "precision": "bf16-mixed", "lora_r": 8,
                                 "load_in_4bit": True, "gpu": "RTX3060"}),
    ("google-t5/t5-small", {"batch_size": 4, "seq_len": 128, "device": "cpu"}),
    ("Qwen/Qwen3-0.6B", {"batch_size": 2, "seq_len": 512, "precision": "bf16-mixed", "gpu": "A10G"}),
)
PLANS = (
    ("gpt2-xl", {"gpu": "RTX3060", "seq_len": 1024, "global_batch_size": 32}),
    ("meta-llama/Llama-3.1-8B", {"gpu": "A10G", "seq_len": 2048, "global_batch_size": 16}),
    ("meta-llama/Llama-3.1-8B", {"gpu": "H100", "num_gpus": 8, "seq_len": 4096, "global_batch_size": 64}),
    ("bert-large-uncased", {"gpu_memory": "8GiB", "seq_len": 512, "global_batch_size": 32}),
    ("meta-llama/Llama-3.1-70B", {"gpu": "A100-80GB", "num_gpus": 8, "seq_len": 2048, "global_batch_size": 32}),
)


def _row(fn, *args, **kwargs) -> dict:
    try:
        return fn(*args, **kwargs).to_dict()
    except hf_memfit.MemFitError as exc:  # a refusal is behaviour too
        return {"error": str(exc)}


def snapshot(exact: bool) -> dict:
    out = {"estimate_fast": {}, "estimate_exact": {}, "plan": {}}
    for model in FAST_MODELS:
        for settings in FAST_SETTINGS:
            out["estimate_fast"][f"{model} {json.dumps(settings, sort_keys=True)}"] = _row(
                hf_memfit.estimate, model, **settings)
    if exact:
        for model, settings in EXACT_ROWS:
            out["estimate_exact"][f"{model} {json.dumps(settings, sort_keys=True)}"] = _row(
                hf_memfit.estimate, model, mode="exact", **settings)
    for model, settings in PLANS:
        out["plan"][f"{model} {json.dumps(settings, sort_keys=True)}"] = _row(hf_memfit.plan, model, **settings)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write the snapshot")
    parser.add_argument("--compare", help="an earlier snapshot: list every entry that differs")
    parser.add_argument("--no-exact", action="store_true", help="skip the exact-mode rows")
    args = parser.parse_args(argv)
    current = snapshot(exact=not args.no_exact)
    with open(args.json, "w") as f:
        json.dump(current, f, indent=1, sort_keys=True)
    if not args.compare:
        return 0
    with open(args.compare) as f:
        before = json.load(f)
    differ = [f"{section}: {key}" for section in before for key in before[section]
              if before[section][key] != current.get(section, {}).get(key)]
    total = sum(len(v) for v in before.values())
    print(f"{total - len(differ)} of {total} entries identical")
    for line in differ:
        print("  differs:", line)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

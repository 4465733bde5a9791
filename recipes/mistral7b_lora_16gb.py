"""LoRA fine-tuning of Mistral-7B on one 16 GB GPU (V100-16GB, T4-class budgets).

    accelerate launch recipes/mistral7b_lora_16gb.py
    python recipes/mistral7b_lora_16gb.py --dry-run
    python recipes/mistral7b_lora_16gb.py --smoke

The base stays in the dtype it is loaded in; only the rank-16 adapters train.
Whether the 14.5 GB of bf16 weights leave room for activations decides the
micro-batch and checkpointing; the plan says how much.
"""

from hf_memfit.recipe import Recipe, run

RECIPE = Recipe(
    model="mistralai/Mistral-7B-v0.1",
    memory_budget="16GiB",
    seq_len=1024,
    global_batch_size=32,
    lora_r=16,
    lora_alpha=32,
)

if __name__ == "__main__":
    raise SystemExit(run(RECIPE))

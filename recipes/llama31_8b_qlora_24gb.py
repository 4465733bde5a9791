"""QLoRA fine-tuning of Llama-3.1-8B on one 24 GB GPU (A10G, RTX 3090/4090).

    accelerate launch recipes/llama31_8b_qlora_24gb.py         # gated: `hf auth login` first
    python recipes/llama31_8b_qlora_24gb.py --dry-run
    python recipes/llama31_8b_qlora_24gb.py --smoke

The base is loaded in 4-bit NF4 with double quantisation (bitsandbytes) and
computes in bf16; LoRA rank 16 trains on peft's default Llama targets. The
planner picks the micro-batch, checkpointing and optimizer. The smoke run
loads its tiny base in 4-bit too: bitsandbytes' Linear4bit runs on the CPU.
"""

from hf_memfit.integrations.recipe import Recipe, run

RECIPE = Recipe(
    model="meta-llama/Llama-3.1-8B",
    memory_budget="24GiB",
    seq_len=2048,
    global_batch_size=32,
    load_in_4bit=True,  # QLoRA: frozen 4-bit base, ~0.5 B/param instead of 2
    lora_r=16,
    lora_alpha=32,
)

if __name__ == "__main__":
    raise SystemExit(run(RECIPE))

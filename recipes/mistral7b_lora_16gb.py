"""LoRA fine-tuning of Mistral-7B on one 16 GB GPU (V100-16GB, T4, RTX 4080 class).

    accelerate launch recipes/mistral7b_lora_16gb.py
    python recipes/mistral7b_lora_16gb.py --dry-run
    python recipes/mistral7b_lora_16gb.py --smoke

The frozen base is loaded in bf16 (fp16 on GPUs without bf16) and only the
rank-16 adapters train. Its 13.5 GiB of weights leave little of 16 GB for
activations, so the plan may move the frozen base to host RAM (ZeRO-3
parameter offload); `--dry-run` shows what it picks and why. QLoRA
(`recipes/llama31_8b_qlora_24gb.py`) is the way to keep it all on the GPU.
"""

from hf_memfit.integrations.recipe import Recipe, run

RECIPE = Recipe(
    model="mistralai/Mistral-7B-v0.1",
    memory_budget="16GiB",
    seq_len=1024,
    global_batch_size=32,
    lora_r=16,  # adapters on peft's default targets (q_proj, v_proj)
    lora_alpha=32,
)

if __name__ == "__main__":
    raise SystemExit(run(RECIPE))

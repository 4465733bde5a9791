"""QLoRA fine-tuning of Llama-2-70B on 2 x 24 GB GPUs (RTX 3090/4090, A10G), its 4-bit weights sharded by FSDP.

    accelerate launch --config_file recipes/accelerate/fsdp_qlora_offload.yaml recipes/llama2_70b_qlora_2x24gb.py
    python recipes/llama2_70b_qlora_2x24gb.py --dry-run
    python recipes/llama2_70b_qlora_2x24gb.py --smoke

peft's "FSDP + QLoRA" route: the NF4 base (double quantisation) is stored in
bf16 (`bnb_4bit_quant_storage`), so FSDP shards it like any bf16 parameter:
~35 GB of 4-bit weights become ~17 GB per GPU, which with activations is still
over 24 GB, so the plan offloads the shards to host RAM (FSDP CPU offload) and
needs about 17 GiB of pinned host memory per GPU. The accelerate config is the
one `hf-memfit plan ... --accelerate-config-out` writes for this plan; the
trainer reads the launched FSDP layout back from accelerate and plans around it.
The smoke run trains the tiny 4-bit model in one CPU process (bitsandbytes'
CPU backend, the same bf16 quant storage); FSDP itself runs only under a launch.
"""

from hf_memfit.integrations.recipe import Recipe, run

RECIPE = Recipe(
    model="meta-llama/Llama-2-70b-hf",
    memory_budget="24GiB",  # per GPU
    seq_len=2048,
    global_batch_size=4,  # the peft docs' run: 2 GPUs x micro-batch 2 (their 2 x 2 accumulation keeps 4 too)
    num_gpus=2,
    load_in_4bit=True,  # frozen 4-bit base, ~0.5 B/param
    shard_4bit=True,  # quant storage bf16: FSDP shards the 4-bit weights
    lora_r=8,
    lora_alpha=16,
)

if __name__ == "__main__":
    raise SystemExit(run(RECIPE))

"""Full fine-tuning of Llama-2-70B on 8 x 80 GB GPUs (ZeRO-3), or on 2 nodes of them.

    accelerate launch --config_file recipes/accelerate/deepspeed_zero3.yaml recipes/llama2_70b_8x80gb.py
    accelerate launch --config_file recipes/accelerate/deepspeed_zero3.yaml --num_machines 2 --num_processes 16 \
        --machine_rank $RANK --main_process_ip $MASTER recipes/llama2_70b_8x80gb.py --num-nodes 2
    python recipes/llama2_70b_8x80gb.py --dry-run [--num-nodes 2]
    python recipes/llama2_70b_8x80gb.py --smoke

1.1 TB of AdamW model states (16 B/param) cannot live on one 80 GB GPU;
ZeRO-3 shards parameters, gradients and optimizer states over all ranks, and
the plan decides checkpointing, offload and the micro-batch for what is left.
The accelerate config's `zero3_init_flag` makes `from_pretrained` load each
rank's shard only, instead of 8 full copies in host RAM.
"""

from hf_memfit.integrations.recipe import Recipe, run

RECIPE = Recipe(
    model="meta-llama/Llama-2-70b-hf",
    memory_budget="80GiB",  # A100-80GB / H100
    seq_len=4096,  # Llama-2's context
    global_batch_size=64,
    num_gpus=8,  # per node
)

README_VARIANTS = (["--num-nodes", "2"],)  # the README table also shows the plan on 2 nodes

if __name__ == "__main__":
    raise SystemExit(run(RECIPE))

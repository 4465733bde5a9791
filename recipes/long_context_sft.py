"""Long-context fine-tuning of Llama-3.1-8B at 128K tokens on one 8 x H100 node.

    accelerate launch --num_processes 8 recipes/long_context_sft.py    # gated: `hf auth login` first
    python recipes/long_context_sft.py --dry-run                       # the plan, offline, no weights
    python recipes/long_context_sft.py --smoke                         # same code path, tiny model, CPU

A 128K-token row does not fit one H100 whole: its logits alone (128K x 128,256 x 4 B) are 61 GiB. The
plan splits each sequence over the GPUs with Ulysses sequence parallelism (DeepSpeed's all-to-all
around attention; accelerate's `ParallelismConfig(sp_size=...)`), shards the model states with ZeRO,
and adds the levers of Arctic Long Sequence Training where they are needed: gradient checkpointing,
Liger's fused loss, TiledMLP and checkpoints offloaded to the host. Each rank trains on its share of
the sequence; the global batch of 8 sequences is kept over the data-parallel replicas that remain.
`hf-memfit plan meta-llama/Llama-3.1-8B --seq-len max --num-gpus 8 --gpu h100 --global-batch-size 8`
says how far the same node goes.
"""

from hf_memfit.integrations.recipe import Recipe, run

RECIPE = Recipe(
    model="meta-llama/Llama-3.1-8B",
    memory_budget="80GB",  # an H100 SXM's 80 GB
    seq_len=131072,  # Llama-3.1's full context
    global_batch_size=8,  # sequences per optimizer step, kept exactly
    num_gpus=8,
)

if __name__ == "__main__":
    raise SystemExit(run(RECIPE))

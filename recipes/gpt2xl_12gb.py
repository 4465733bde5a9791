"""Full fine-tuning of GPT-2-XL (1.5B parameters) on one 12 GB GPU (RTX 3060 class).

    accelerate launch recipes/gpt2xl_12gb.py                   # wikitext-2, seq 1024, global batch 64
    accelerate launch recipes/gpt2xl_12gb.py --allow_pure_bf16  # a machine with 16 GB of RAM (see below)
    accelerate launch recipes/gpt2xl_12gb.py --train-file my.txt
    python recipes/gpt2xl_12gb.py --dry-run                    # the plan, offline, no weights
    python recipes/gpt2xl_12gb.py --dry-run --cpu_memory 16GiB --allow_pure_bf16
    python recipes/gpt2xl_12gb.py --smoke                      # same code path, tiny model, CPU, seconds

fp32 weights + grads alone are 11.6 GiB (1.56B x 8 bytes), so the plan has to
find room: bf16 autocast, micro-batch x accumulation = 64, gradient
checkpointing, and DeepSpeed ZeRO-2 with the optimizer offloaded to host RAM
if nothing else fits. That offload needs ~26 GiB of host RAM (fp32 master
weights and AdamW states, 16 B/param). A launched run checks this machine's
RAM; `--cpu_memory 16GiB` makes `--dry-run` plan for a 16 GB machine, where
only `--allow_pure_bf16` fits: bf16 weights and gradients with no fp32 master
copy, torchao's low-bit AdamW with bf16 stochastic rounding, checkpointing,
all on the GPU. Every choice is printed with its numbers when training starts.
Any TrainingArguments flag works too (`--learning_rate 2e-5`).
"""

from hf_memfit.integrations.recipe import Recipe, run

RECIPE = Recipe(
    model="openai-community/gpt2-xl",
    memory_budget="12GiB",  # an RTX 3060's 12 GB; `--memory_budget auto` takes the GPU's free memory
    seq_len=1024,  # GPT-2's full context
    global_batch_size=64,  # kept exactly: micro-batch x accumulation x GPUs
)
# The README table's second row: the same card in a machine with 16 GB of RAM.
README_VARIANTS = [("--cpu_memory", "16GiB", "--allow_pure_bf16")]

if __name__ == "__main__":
    raise SystemExit(run(RECIPE))

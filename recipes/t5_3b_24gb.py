"""Full fine-tuning of T5-3B (seq2seq) on one 24 GB GPU.

    accelerate launch recipes/t5_3b_24gb.py
    python recipes/t5_3b_24gb.py --dry-run
    python recipes/t5_3b_24gb.py --smoke

AdamW on 2.85B parameters needs ~45 GB of model states, so the planner
reaches for DeepSpeed ZeRO-2 with CPU optimizer offload when nothing on the
GPU alone fits, and writes the DeepSpeed config itself.
"""

from hf_memfit.recipe import Recipe, run

RECIPE = Recipe(
    model="t5-3b",
    task="seq2seq",
    memory_budget="24GiB",
    seq_len=512,
    global_batch_size=32,
)

if __name__ == "__main__":
    raise SystemExit(run(RECIPE))

"""Full fine-tuning of T5-3B (seq2seq) on one 24 GB GPU.

    accelerate launch recipes/t5_3b_24gb.py                    # wikitext-2: each block predicts the next
    python recipes/t5_3b_24gb.py --dry-run
    python recipes/t5_3b_24gb.py --smoke

AdamW on 2.85B parameters needs ~45 GB of model states (16 B/param), so the
planner reaches for DeepSpeed ZeRO-2 with the optimizer offloaded to host RAM
when nothing on the GPU alone fits, and writes the DeepSpeed config itself.
`--allow_offload none` forbids that (and then nothing fits on 24 GB).
"""

from hf_memfit.integrations.recipe import Recipe, run

RECIPE = Recipe(
    model="google-t5/t5-3b",
    task="seq2seq",
    memory_budget="24GiB",  # A10G, L4, RTX 3090/4090
    seq_len=512,  # T5's pre-training length
    global_batch_size=32,
)

if __name__ == "__main__":
    raise SystemExit(run(RECIPE))

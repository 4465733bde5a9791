"""Sequence classification with BERT-large (340M) on one 8 GB GPU.

    accelerate launch recipes/bert_large_cls_8gb.py                 # SST-2
    accelerate launch recipes/bert_large_cls_8gb.py --train-file labelled.tsv   # label<TAB>text per line
    python recipes/bert_large_cls_8gb.py --dry-run
    python recipes/bert_large_cls_8gb.py --smoke

The dry run plans for 512 tokens, BERT's maximum. Batches are padded to their
longest sentence, so on SST-2 (sentences under 70 tokens) the trainer plans
for the longest line it finds, and the plan is a larger micro-batch.
"""

from hf_memfit.integrations.recipe import Recipe, run

RECIPE = Recipe(
    model="google-bert/bert-large-uncased",
    task="seq-cls",
    num_labels=2,
    memory_budget="8GiB",
    seq_len=512,  # BERT's maximum: lines are truncated to it
    global_batch_size=32,
)

if __name__ == "__main__":
    raise SystemExit(run(RECIPE))

"""introspect.py: the longest batch a trainer will see, read from its data and collator."""

import torch

from hf_memfit.integrations.introspect import longest_batch
from hf_memfit.models.spec import ModelSpec

SPEC = ModelSpec.from_config("tiny-llama", dict(model_type="llama", hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=2, vocab_size=100,
                                                max_position_embeddings=4096))


class CountingDataset(torch.utils.data.Dataset):
    def __init__(self, lengths):
        self.lengths, self.reads = lengths, 0

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        self.reads += 1
        return {"input_ids": list(range(self.lengths[i])), "labels": list(range(self.lengths[i]))}


def test_a_map_style_dataset_is_read_once_per_row():
    data = CountingDataset([5, 40, 17, 33] * 10)
    shape = longest_batch(SPEC, data, None, None)
    assert shape.seq_len == 40 and not shape.padding_free
    assert data.reads == len(data)  # one pass; the longest rows are kept, not read again


def test_the_collator_decides_the_length():
    from transformers import DataCollatorWithPadding

    class Tok:  # the collator pads to max_length; only pad() is used
        pad_token_id = 0
        model_input_names = ["input_ids"]
        padding_side = "right"

        def pad(self, rows, padding, max_length, pad_to_multiple_of, return_tensors):
            return {"input_ids": torch.zeros(len(rows), max_length, dtype=torch.long)}

    data = CountingDataset([5, 9, 7])
    shape = longest_batch(SPEC, data, DataCollatorWithPadding(Tok(), padding="max_length", max_length=64), None)
    assert shape.seq_len == 64


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield {"input_ids": [1, 2, 3]}


class Tokenizer:
    model_max_length = 512  # transformers' name for a tokenizer's limit


def test_an_iterable_dataset_uses_model_max_length_and_says_so():
    shape = longest_batch(SPEC, Stream(), None, Tokenizer())
    assert shape.seq_len == 512 and "IterableDataset" in shape.notes[0]
    Tokenizer.model_max_length = int(1e30)  # a tokenizer without a limit
    shape = longest_batch(SPEC, Stream(), None, Tokenizer())
    assert shape.seq_len == 4096 and "assumed" in shape.notes[0]

import os

import pytest

# Offline by default: nothing in the suite may reach the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


TINY_GPT2 = dict(model_type="gpt2", n_layer=5, n_embd=64, n_head=4, vocab_size=512, n_positions=256,
                 bos_token_id=0, eos_token_id=0)
TINY_LLAMA = dict(model_type="llama", num_hidden_layers=5, hidden_size=64, intermediate_size=160,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
TINY_T5 = dict(model_type="t5", num_layers=4, num_decoder_layers=4, d_model=64, d_ff=128, d_kv=16, num_heads=4,
               vocab_size=300, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
TINY_BERT = dict(model_type="bert", num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                 num_attention_heads=4, vocab_size=400, max_position_embeddings=256)


@pytest.fixture
def tiny_specs():
    from hf_memfit.spec import ModelSpec

    return {name: ModelSpec.from_config(f"tiny-{name}", cfg) for name, cfg in
            {"gpt2": TINY_GPT2, "llama": TINY_LLAMA, "t5": TINY_T5, "bert": TINY_BERT}.items()}

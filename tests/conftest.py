import os
import tempfile

import pytest

# Offline by default: nothing in the suite may reach the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Calibrations and generic model facts go to a fresh folder, never the user's ~/.cache/hf_memfit.
os.environ["HF_MEMFIT_CACHE"] = tempfile.mkdtemp(prefix="hf_memfit_test_cache_")


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
    from hf_memfit.models.spec import ModelSpec

    return {name: ModelSpec.from_config(f"tiny-{name}", cfg) for name, cfg in
            {"gpt2": TINY_GPT2, "llama": TINY_LLAMA, "t5": TINY_T5, "bert": TINY_BERT}.items()}


# Families without hand-written formulas (the generic path), tiny. Each keeps what makes its family
# different: QK-norm (Qwen3, OLMo-2), hybrid sliding/global attention (Gemma-3), routed experts (Qwen3-MoE),
# an encoder with fused Wqkv and alternating local/global attention (ModernBERT).
TINY_QWEN3 = dict(model_type="qwen3", num_hidden_layers=5, hidden_size=64, intermediate_size=160,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                  max_position_embeddings=512, tie_word_embeddings=True)
TINY_GEMMA3 = dict(model_type="gemma3_text", num_hidden_layers=8, hidden_size=64, intermediate_size=160,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                   max_position_embeddings=512, sliding_window=16, sliding_window_pattern=3)
TINY_OLMO2 = dict(model_type="olmo2", num_hidden_layers=5, hidden_size=64, intermediate_size=160,
                  num_attention_heads=4, num_key_value_heads=4, vocab_size=512, max_position_embeddings=512,
                  pad_token_id=1, eos_token_id=0)
TINY_QWEN3_MOE = dict(model_type="qwen3_moe", num_hidden_layers=5, hidden_size=64, intermediate_size=160,
                      moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=512)
TINY_MODERNBERT = dict(model_type="modernbert", num_hidden_layers=6, hidden_size=64, intermediate_size=128,
                       num_attention_heads=4, vocab_size=512, max_position_embeddings=512, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2, sep_token_id=2, cls_token_id=1, global_attn_every_n_layers=3,
                       local_attention=16)
TINY_GENERIC = {"qwen3": TINY_QWEN3, "gemma3_text": TINY_GEMMA3, "olmo2": TINY_OLMO2, "qwen3_moe": TINY_QWEN3_MOE,
                "modernbert": TINY_MODERNBERT}

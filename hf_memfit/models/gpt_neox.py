"""GPT-NeoX / Pythia: fused query_key_value, partial rotary, parallel residual, LayerNorm.

Everything hf-memfit knows by hand about the family: the transformers 5.23 config
defaults (a published config.json leaves out keys equal to them), peft's default
LoRA targets, the normalised fields, the linear modules, the parameter counts
and the symbolic forward fast mode runs.
"""

from __future__ import annotations

from typing import Any

from hf_memfit.models import llama
from hf_memfit.models._shared import Getter, Lin, common, decoder_counts, head_linears

MODEL_TYPES = ('gpt_neox',)

DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt_neox": {
        "vocab_size": 50432, "hidden_size": 6144, "num_hidden_layers": 44, "num_attention_heads": 64,
        "intermediate_size": 24576, "hidden_act": "gelu", "attention_dropout": 0.0, "hidden_dropout": 0.0,
        "max_position_embeddings": 2048, "tie_word_embeddings": False, "attention_bias": True
    },
}

ALIASES: dict[str, dict[str, str]] = {}

# peft 0.21's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for these types (tests compare).
PEFT_LORA_TARGETS: dict[str, list[str]] = {
    "gpt_neox": ["query_key_value"],
}


def fields(get: Getter) -> dict[str, Any]:
    h, heads = get("hidden_size"), get("num_attention_heads")
    bias = bool(get("attention_bias"))
    hidden_drop = float(get("hidden_dropout"))
    return {
        **common(get, h, get("num_hidden_layers"), heads),
        "num_decoder_layers": 0,
        "num_key_value_heads": heads,
        "head_dim": h // heads,
        "intermediate_size": get("intermediate_size"),
        "max_position_embeddings": get("max_position_embeddings"),
        "tie_word_embeddings": bool(get("tie_word_embeddings")),
        "is_encoder_decoder": False,
        "default_task": "causal-lm",
        "supported_tasks": ("causal-lm", "seq-cls"),
        "layer_count_keys": ("num_hidden_layers",),
        "hidden_act": get("hidden_act"),
        "gated_mlp": False, "norm_type": "layernorm", "norms_per_layer": 2, "fused_qkv": True,
        "qkv_bias": bias, "attn_out_bias": bias, "mlp_bias": True,
        "attention_dropout": float(get("attention_dropout")),
        "hidden_dropout": hidden_drop, "embedding_dropout": hidden_drop, "activation_dropout": 0.0,
        "sliding_window": None, "layer_period": 1, "embedding_dim": h,
    }


def linears(s, get: Getter, task: str, num_labels: int) -> list[Lin]:
    h, i, n = s.hidden_size, s.intermediate_size, s.num_layers
    return [
        ("query_key_value", h, 3 * h, s.qkv_bias, n, "layer"),
        ("dense", h, h, s.attn_out_bias, n, "layer"),
        ("dense_h_to_4h", h, i, True, n, "layer"),
        ("dense_4h_to_h", i, h, True, n, "layer"),
        *head_linears(s, task, num_labels, h),
    ]


def counts(s, get: Getter, task: str, num_labels: int) -> dict[str, int]:
    h = s.hidden_size
    entries = linears(s, get, task, num_labels)
    return decoder_counts(s, entries, task, embedding=s.vocab_size * h, norms_per_layer=2 * 2 * h,
                           final=2 * h)


class Forward(llama.Forward):
    """GPT-NeoX: fused query_key_value, partial rotary, embedding dropout, parallel residual, LayerNorm."""

    qkv_name = "query_key_value"
    out_name = "dense"
    rotary_cat_style = True

    def _embed_tokens(self):
        return self.f.dropout(self.token_embedding(self.h), self.spec.embedding_dropout)

    def _rotary_dim(self) -> int:
        s = self.spec
        cfg = s.config
        rp = cfg.get("rotary_pct", (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 0.25))
        return int(s.head_dim * rp)

    def _parallel_residual(self) -> bool:
        return bool(self.spec.config.get("use_parallel_residual", True))

    def _mlp(self, x):
        f, s, h, i = self.f, self.spec, self.h, self.spec.intermediate_size
        m = f.linear(x, h, i, "dense_h_to_4h", True)
        m = f.activation(m, s.hidden_act)
        return f.linear(m, i, h, "dense_4h_to_h", True)

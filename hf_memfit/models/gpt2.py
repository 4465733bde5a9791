"""GPT-2: learned positions, fused c_attn (Conv1D), LayerNorm, tied head.

Everything hf-memfit knows by hand about the family: the transformers 5.23 config
defaults (a published config.json leaves out keys equal to them), peft's default
LoRA targets, the normalised fields, the linear modules, the parameter counts
and the symbolic forward fast mode runs.
"""

from __future__ import annotations

from typing import Any

from hf_memfit.models.forward import FamilyForward
from hf_memfit.models._shared import Getter, Lin, common, decoder_counts, head_linears

MODEL_TYPES = ('gpt2',)

# The body's projections are transformers' Conv1D, not nn.Linear (GaLore / APOLLO take only nn.Linear).
CONV1D_BODY = True

DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {
        "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
        "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
        "tie_word_embeddings": True
    },
}

ALIASES: dict[str, dict[str, str]] = {
    "gpt2": {
        "n_embd": "hidden_size", "n_positions": "max_position_embeddings", "n_head": "num_attention_heads",
        "n_layer": "num_hidden_layers"
    },
}

# peft 0.21's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for these types (tests compare).
PEFT_LORA_TARGETS: dict[str, list[str]] = {
    "gpt2": ["c_attn"],
}


def fields(get: Getter) -> dict[str, Any]:
    h, heads = get("n_embd"), get("n_head")
    return {
        **common(get, h, get("n_layer"), heads),
        "num_decoder_layers": 0,
        "num_key_value_heads": heads,
        "head_dim": h // heads,
        "intermediate_size": get("n_inner") or 4 * h,
        "max_position_embeddings": get("n_positions"),
        "learned_positions": True,  # GPT2Model.wpe: one row per position
        "tie_word_embeddings": bool(get("tie_word_embeddings")),
        "is_encoder_decoder": False,
        "default_task": "causal-lm",
        "supported_tasks": ("causal-lm", "seq-cls"),
        "layer_count_keys": (get.key("n_layer"),),
        "hidden_act": get("activation_function"),
        "gated_mlp": False, "norm_type": "layernorm", "norms_per_layer": 2, "fused_qkv": True,
        "qkv_bias": True, "attn_out_bias": True, "mlp_bias": True,
        "attention_dropout": float(get("attn_pdrop")),
        "hidden_dropout": float(get("resid_pdrop")),
        "embedding_dropout": float(get("embd_pdrop")),
        "activation_dropout": 0.0,
        "sliding_window": None, "layer_period": 1, "embedding_dim": h,
    }


def linears(s, get: Getter, task: str, num_labels: int) -> list[Lin]:
    h, i, n = s.hidden_size, s.intermediate_size, s.num_layers
    return [
        ("c_attn", h, 3 * h, True, n, "layer"),
        ("c_proj", h, h, True, n, "layer"),  # attention output
        ("c_fc", h, i, True, n, "layer"),
        ("c_proj", i, h, True, n, "layer"),  # MLP output
        *head_linears(s, task, num_labels, h),
    ]


def counts(s, get: Getter, task: str, num_labels: int) -> dict[str, int]:
    h = s.hidden_size
    entries = linears(s, get, task, num_labels)
    return decoder_counts(s, entries, task, embedding=(s.vocab_size + s.max_position_embeddings) * h,
                           norms_per_layer=2 * 2 * h, final=2 * h)


def embedding_tables(spec) -> list[tuple[int, int, bool]]:
    """(rows, cols, decay): token and learned position tables."""
    return [(spec.vocab_size, spec.hidden_size, True), (spec.max_position_embeddings, spec.hidden_size, True)]


# The symbolic forward fast mode runs (models/forward.py): the ops transformers 5.23 runs, in order.
class Forward(FamilyForward):
    def embed(self):
        f, T, h = self.f, self.T, self.h
        tok = self.token_embedding(h)
        pos = f.new(T * h, self.rdt, self.ctx.full_ft)
        x = f.add(tok, pos)
        return f.dropout(x, self.spec.embedding_dropout)

    def layer(self, x, index):
        f, s, h, T = self.f, self.spec, self.h, self.T
        hd, nh = s.head_dim, s.num_attention_heads
        a = f.layer_norm(x, h)
        qkv = f.linear(a, h, 3 * h, "c_attn", True)
        q, k, v = (f.view(qkv, T * h) for _ in range(3))
        k, v = f.kv_cache(k, v)
        o = f.attention(q, k, v, nh, nh, hd, dropout=s.attention_dropout, eager_style="gpt2")
        o = f.linear(o, h, h, "c_proj", True)
        o = f.dropout(o, s.hidden_dropout)
        x = f.add(o, x)
        m = f.layer_norm(x, h)
        m = f.linear(m, h, s.intermediate_size, "c_fc", True)
        m = f.activation(m, s.hidden_act)
        m = f.linear(m, s.intermediate_size, h, "c_proj", True)
        m = f.dropout(m, s.hidden_dropout)
        return f.add(x, m)

    def final(self, x):
        return self.f.layer_norm(x, self.h)

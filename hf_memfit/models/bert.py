"""BERT: an encoder for sequence classification (pooler + classifier).

Everything hf-memfit knows by hand about the family: the transformers 5.23 config
defaults (a published config.json leaves out keys equal to them), peft's default
LoRA targets, the normalised fields, the linear modules, the parameter counts
and the symbolic forward fast mode runs.
"""

from __future__ import annotations

from typing import Any

from hf_memfit.models.forward import FamilyForward
from hf_memfit.models._shared import Getter, Lin, common, decoder_counts

MODEL_TYPES = ('bert',)

# BertModel builds no KV cache in forward.
USES_KV_CACHE = False

DEFAULTS: dict[str, dict[str, Any]] = {
    "bert": {
        "vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
        "intermediate_size": 3072, "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob":
        0.1, "max_position_embeddings": 512, "type_vocab_size": 2, "tie_word_embeddings": True
    },
}

ALIASES: dict[str, dict[str, str]] = {}

# peft 0.21's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for these types (tests compare).
PEFT_LORA_TARGETS: dict[str, list[str]] = {
    "bert": ["query", "value"],
}


def fields(get: Getter) -> dict[str, Any]:
    h, heads = get("hidden_size"), get("num_attention_heads")
    hidden_drop = float(get("hidden_dropout_prob"))
    return {
        **common(get, h, get("num_hidden_layers"), heads),
        "num_decoder_layers": 0,
        "num_key_value_heads": heads,
        "head_dim": h // heads,
        "intermediate_size": get("intermediate_size"),
        "max_position_embeddings": get("max_position_embeddings"),
        "learned_positions": True,  # BertEmbeddings.position_embeddings: one row per position
        "tie_word_embeddings": bool(get("tie_word_embeddings")),
        "is_encoder_decoder": False,
        "default_task": "seq-cls",
        "supported_tasks": ("seq-cls",),
        "layer_count_keys": ("num_hidden_layers",),
        "hidden_act": get("hidden_act"),
        "gated_mlp": False, "norm_type": "layernorm", "norms_per_layer": 2, "fused_qkv": False,
        "qkv_bias": True, "attn_out_bias": True, "mlp_bias": True,
        "attention_dropout": float(get("attention_probs_dropout_prob")),
        "hidden_dropout": hidden_drop,
        "embedding_dropout": hidden_drop,
        "activation_dropout": 0.0,
        "sliding_window": None, "layer_period": 1, "embedding_dim": h,
    }


def linears(s, get: Getter, task: str, num_labels: int) -> list[Lin]:
    h, i, n = s.hidden_size, s.intermediate_size, s.num_layers
    inner = s.num_attention_heads * s.head_dim
    return [
        ("query", h, inner, True, n, "layer"),
        ("key", h, inner, True, n, "layer"),
        ("value", h, inner, True, n, "layer"),
        ("dense", h, h, True, n, "layer"),  # attention output
        ("dense", h, i, True, n, "layer"),  # intermediate
        ("dense", i, h, True, n, "layer"),  # output
        ("dense", h, h, True, 1, "other"),  # pooler
        ("classifier", h, num_labels, True, 1, "head"),
    ]


def counts(s, get: Getter, task: str, num_labels: int) -> dict[str, int]:
    h = s.hidden_size
    entries = linears(s, get, task, num_labels)
    tables = s.vocab_size + s.max_position_embeddings + get("type_vocab_size")
    return decoder_counts(s, entries, task, embedding=tables * h + 2 * h,
                           norms_per_layer=2 * 2 * h, final=0)


def embedding_tables(spec) -> list[tuple[int, int, bool]]:
    """(rows, cols, decay): token, position and token-type tables."""
    h = spec.hidden_size
    return [(spec.vocab_size, h, True), (spec.max_position_embeddings, h, True),
            (spec.config.get("type_vocab_size", 2), h, True)]


# The symbolic forward fast mode runs (models/forward.py): the ops transformers 5.23 runs, in order.
class Forward(FamilyForward):
    def embed(self):
        f, T, h = self.f, self.T, self.h
        word = self.token_embedding(h)
        tt = f.new(T * h, self.rdt, self.ctx.full_ft)
        x = f.add(word, tt)
        pos = f.new(T * h, self.rdt, self.ctx.full_ft)
        x = f.add(x, pos)
        x = f.layer_norm(x, h)
        x = f.dropout(x, self.spec.embedding_dropout)
        f.hold(x)  # BertModel.forward keeps `embedding_output` until it returns
        return x

    def layer(self, x, index):
        f, s, h, T = self.f, self.spec, self.h, self.T
        q = f.linear(x, h, h, "query", True)
        k = f.linear(x, h, h, "key", True)
        v = f.linear(x, h, h, "value", True)
        o = f.attention(q, k, v, s.num_attention_heads, s.num_attention_heads, s.head_dim,
                        dropout=s.attention_dropout, causal=False, eager_style="bert")
        o = f.linear(o, h, h, "dense", True)
        o = f.dropout(o, s.hidden_dropout)
        x = f.layer_norm(f.add(o, x), h)
        m = f.linear(x, h, s.intermediate_size, "dense", True)
        m = f.activation(m, s.hidden_act)
        m = f.linear(m, s.intermediate_size, h, "dense", True)
        m = f.dropout(m, s.hidden_dropout)
        return f.layer_norm(f.add(m, x), h)

    def final(self, x):
        self.f.hold(x)  # last_hidden_state, returned by BertModel
        return x

    def seq_cls_logits(self, head_in, width, num_labels, trainable):
        """The pooler (dense + tanh on [CLS], then dropout) and the classifier: a few [b, labels] tensors."""
        f = self.f
        cls = f.view(head_in, self.ctx.b * width)
        pooled = f.activation(f.linear(cls, width, width, "dense", True, lora=False), "tanh")
        pooled = f.dropout(pooled, self.spec.hidden_dropout)
        return f.linear(pooled, width, num_labels, "classifier", True, trainable=trainable, lora=False)

"""OPT: learned positions with a 2-row offset, optional project_in/out, pre- or post-LayerNorm.

Everything hf-memfit knows by hand about the family: the transformers 5.23 config
defaults (a published config.json leaves out keys equal to them), peft's default
LoRA targets, the normalised fields, the linear modules, the parameter counts
and the symbolic forward fast mode runs.
"""

from __future__ import annotations

from typing import Any

from hf_memfit.models.forward import FamilyForward
from hf_memfit.models._shared import Getter, Lin, common, decoder_counts, head_linears

MODEL_TYPES = ('opt',)

DEFAULTS: dict[str, dict[str, Any]] = {
    "opt": {
        "vocab_size": 50272, "hidden_size": 768, "num_hidden_layers": 12, "ffn_dim": 3072,
        "max_position_embeddings": 2048, "do_layer_norm_before": True, "_remove_final_layer_norm": False,
        "word_embed_proj_dim": None, "dropout": 0.1, "attention_dropout": 0.0, "num_attention_heads": 12,
        "activation_function": "relu", "enable_bias": True, "layer_norm_elementwise_affine": True,
        "tie_word_embeddings": True
    },
}

ALIASES: dict[str, dict[str, str]] = {}

# peft 0.21's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for these types (tests compare).
PEFT_LORA_TARGETS: dict[str, list[str]] = {
    "opt": ["q_proj", "v_proj"],
}


def fields(get: Getter) -> dict[str, Any]:
    h, heads = get("hidden_size"), get("num_attention_heads")
    bias = bool(get("enable_bias"))
    return {
        **common(get, h, get("num_hidden_layers"), heads),
        "num_decoder_layers": 0,
        "num_key_value_heads": heads,
        "head_dim": h // heads,
        "intermediate_size": get("ffn_dim"),
        "max_position_embeddings": get("max_position_embeddings"),
        "learned_positions": True,  # OPTLearnedPositionalEmbedding: max positions + 2 rows
        "tie_word_embeddings": bool(get("tie_word_embeddings")),
        "is_encoder_decoder": False,
        "default_task": "causal-lm",
        "supported_tasks": ("causal-lm", "seq-cls"),
        "layer_count_keys": ("num_hidden_layers",),
        "hidden_act": get("activation_function"),
        "gated_mlp": False, "norm_type": "layernorm", "norms_per_layer": 2, "fused_qkv": False,
        "qkv_bias": bias, "attn_out_bias": bias, "mlp_bias": bias,
        "attention_dropout": float(get("attention_dropout")),
        "hidden_dropout": float(get("dropout")),
        # transformers 5 applies no dropout to OPT's embeddings, and never
        # uses `activation_dropout`.
        "embedding_dropout": 0.0,
        "activation_dropout": 0.0,
        "sliding_window": None, "layer_period": 1,
        "embedding_dim": get("word_embed_proj_dim") or h,
    }


def linears(s, get: Getter, task: str, num_labels: int) -> list[Lin]:
    h, f, n, p = s.hidden_size, s.intermediate_size, s.num_layers, s.embedding_dim
    b = s.qkv_bias
    out = [(name, h, h, b, n, "layer") for name in ("k_proj", "v_proj", "q_proj", "out_proj")]
    out += [("fc1", h, f, b, n, "layer"), ("fc2", f, h, b, n, "layer")]
    if p != h:
        out += [("project_out", h, p, False, 1, "other"), ("project_in", p, h, False, 1, "other")]
    out += head_linears(s, task, num_labels, p)
    return out


def counts(s, get: Getter, task: str, num_labels: int) -> dict[str, int]:
    h, p = s.hidden_size, s.embedding_dim
    entries = linears(s, get, task, num_labels)
    norm = 2 * h if get("layer_norm_elementwise_affine") else 0
    final_norm = norm if get("do_layer_norm_before") and not get("_remove_final_layer_norm") else 0
    # OPT's learned positions keep 2 extra rows (a fairseq offset).
    embedding = s.vocab_size * p + (s.max_position_embeddings + 2) * h
    counts = decoder_counts(s, entries, task, embedding=embedding, norms_per_layer=2 * norm,
                             final=final_norm)
    # project_in widens the embeddings, so it belongs with them, not in `final`.
    if p != h:
        counts["embedding"] += p * h
        counts["final"] -= p * h
    return counts


def embedding_tables(spec) -> list[tuple[int, int, bool]]:
    """(rows, cols, decay): token table (word_embed_proj_dim wide) and positions with their 2-row offset."""
    return [(spec.vocab_size, spec.embedding_dim, True), (spec.max_position_embeddings + 2, spec.hidden_size, True)]


# The symbolic forward fast mode runs (models/forward.py): the ops transformers 5.23 runs, in order.
class Forward(FamilyForward):
    @property
    def pre_ln(self) -> bool:
        return bool(self.spec.config.get("do_layer_norm_before", True))

    def embed(self):
        f, T, h, p = self.f, self.T, self.h, self.spec.embedding_dim
        x = self.token_embedding(p)
        if p != h:
            x = f.linear(x, p, h, "project_in", False)
        pos = f.new(T * h, self.rdt, self.ctx.full_ft)
        return f.add(x, pos)

    def layer(self, x, index):
        f, s, h = self.f, self.spec, self.h
        hd, nh = s.head_dim, s.num_attention_heads
        a = f.layer_norm(x, h) if self.pre_ln else x
        q = f.scale(f.linear(a, h, h, "q_proj", s.qkv_bias))  # q_proj(x) * scaling
        k = f.linear(a, h, h, "k_proj", s.qkv_bias)
        v = f.linear(a, h, h, "v_proj", s.qkv_bias)
        k, v = f.kv_cache(k, v)
        o = f.attention(q, k, v, nh, nh, hd, dropout=s.attention_dropout, eager_style="llama")
        o = f.linear(o, h, h, "out_proj", s.attn_out_bias)
        o = f.dropout(o, s.hidden_dropout)
        x = f.add(x, o)
        if not self.pre_ln:
            x = f.layer_norm(x, h)
        m = f.layer_norm(x, h) if self.pre_ln else x
        m = f.linear(m, h, s.intermediate_size, "fc1", s.mlp_bias)
        m = f.activation(m, s.hidden_act)
        m = f.linear(m, s.intermediate_size, h, "fc2", s.mlp_bias)
        m = f.dropout(m, s.hidden_dropout)
        x = f.add(x, m)
        if not self.pre_ln:
            x = f.layer_norm(x, h)
        return x

    def final(self, x):
        f, s = self.f, self.spec
        if self.pre_ln and not s.config.get("_remove_final_layer_norm", False):
            x = f.layer_norm(x, self.h)
        if s.embedding_dim != self.h:
            x = f.linear(x, self.h, s.embedding_dim, "project_out", False)
        return x

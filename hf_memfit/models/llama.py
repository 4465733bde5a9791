"""Llama, Mistral, Qwen2: RMSNorm, rotary positions, gated MLP, grouped-query attention.

Everything hf-memfit knows by hand about the family: the transformers 5.23 config
defaults (a published config.json leaves out keys equal to them), peft's default
LoRA targets, the normalised fields, the linear modules, the parameter counts
and the symbolic forward fast mode runs.
"""

from __future__ import annotations

from typing import Any

from hf_memfit.models.forward import FamilyForward, rope
from hf_memfit.models._shared import Getter, Lin, common, decoder_counts, head_linears, kv_heads

MODEL_TYPES = ('llama', 'mistral', 'qwen2')

DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings":
        2048, "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "head_dim": None
    },
    "mistral": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu",
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "sliding_window": 4096,
        "attention_dropout": 0.0
    },
    "qwen2": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": None, "hidden_act": "silu",
        "max_position_embeddings": 32768, "tie_word_embeddings": False, "use_sliding_window": False,
        "sliding_window": 4096, "max_window_layers": 28, "attention_dropout": 0.0
    },
}

ALIASES: dict[str, dict[str, str]] = {}

# peft 0.21's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for these types (tests compare).
PEFT_LORA_TARGETS: dict[str, list[str]] = {
    "llama": ["q_proj", "v_proj"],
    "mistral": ["q_proj", "v_proj"],
    "qwen2": ["q_proj", "v_proj"],
}


def fields(get: Getter) -> dict[str, Any]:
    """The normalised fields of a Llama-layout model (Gemma-2 adds its own on top)."""
    model_type = get.config["model_type"]
    if model_type == "llama":
        qkv_bias = out_bias = bool(get("attention_bias"))
        mlp_bias = bool(get("mlp_bias"))
    elif model_type == "qwen2":
        qkv_bias, out_bias, mlp_bias = True, False, False  # hard-coded in modeling_qwen2
    else:
        qkv_bias = out_bias = mlp_bias = False
    if model_type == "qwen2":
        # Qwen2Config drops sliding_window unless use_sliding_window is set.
        sliding = get("sliding_window") if get("use_sliding_window") else None
    elif model_type == "mistral":
        sliding = get("sliding_window")
    else:
        sliding = None
    return decoder_fields(get, qkv_bias=qkv_bias, out_bias=out_bias, mlp_bias=mlp_bias, sliding_window=sliding)


def decoder_fields(get: Getter, *, qkv_bias: bool, out_bias: bool, mlp_bias: bool,
                   sliding_window: int | None) -> dict[str, Any]:
    """The fields every Llama-layout decoder shares (separate q/k/v, gated MLP, RMS norms); Phi-3 builds on them."""
    h, heads = get("hidden_size"), get("num_attention_heads")
    return {
        **common(get, h, get("num_hidden_layers"), heads),
        "num_decoder_layers": 0,
        "num_key_value_heads": kv_heads(get, heads),
        "head_dim": get("head_dim") or h // heads,
        "intermediate_size": get("intermediate_size"),
        "max_position_embeddings": get("max_position_embeddings"),
        "tie_word_embeddings": bool(get("tie_word_embeddings")),
        "is_encoder_decoder": False,
        "default_task": "causal-lm",
        "supported_tasks": ("causal-lm", "seq-cls"),
        "layer_count_keys": ("num_hidden_layers",),
        "hidden_act": get("hidden_act"),
        "gated_mlp": True, "norm_type": "rmsnorm", "norms_per_layer": 2,
        "fused_qkv": False, "qkv_bias": qkv_bias, "attn_out_bias": out_bias, "mlp_bias": mlp_bias,
        "attention_dropout": float(get("attention_dropout") or 0.0),
        "hidden_dropout": 0.0, "embedding_dropout": 0.0, "activation_dropout": 0.0,
        "sliding_window": sliding_window,
        "layer_period": 1,
        "embedding_dim": h,
    }


def linears(s, get: Getter, task: str, num_labels: int) -> list[Lin]:
    h, i, n = s.hidden_size, s.intermediate_size, s.num_layers
    q, kv = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    return [
        ("q_proj", h, q, s.qkv_bias, n, "layer"),
        ("k_proj", h, kv, s.qkv_bias, n, "layer"),
        ("v_proj", h, kv, s.qkv_bias, n, "layer"),
        ("o_proj", q, h, s.attn_out_bias, n, "layer"),
        ("gate_proj", h, i, s.mlp_bias, n, "layer"),
        ("up_proj", h, i, s.mlp_bias, n, "layer"),
        ("down_proj", i, h, s.mlp_bias, n, "layer"),
        *head_linears(s, task, num_labels, h),
    ]


def counts(s, get: Getter, task: str, num_labels: int) -> dict[str, int]:
    h = s.hidden_size
    entries = linears(s, get, task, num_labels)
    return decoder_counts(s, entries, task, embedding=s.vocab_size * h,
                           norms_per_layer=s.norms_per_layer * h, final=h)


# The symbolic forward fast mode runs (models/forward.py): the ops transformers 5.23 runs, in order.
class Forward(FamilyForward):
    """Rotary position embeddings, pre-norm; the hooks below are what Gemma-2, Phi-3 and NeoX change."""

    rms_style = "llama"  # formulas' RMSNorm variant
    qkv_name = "qkv_proj"  # the fused projection's name (fused_qkv models)
    out_name = "o_proj"
    rotary_cat_style = False  # rotate_half on a cat of the halves (NeoX, Phi-3) vs split

    def embed(self):
        f, s = self.f, self.spec
        x = self._embed_tokens()
        # cos and sin, [b, s, rotary_dim] in the hidden states' dtype, used by every layer
        self.rot_dim = self._rotary_dim()
        cos = f.new(self.ctx.b * self.ctx.s * self.rot_dim, self.rdt, False)
        sin = f.new(self.ctx.b * self.ctx.s * self.rot_dim, self.rdt, False)
        f.save(cos, sin)
        return x

    def _embed_tokens(self):
        return self.token_embedding(self.h)

    def _rotary_dim(self) -> int:
        return self.spec.head_dim

    def _norm(self, x):
        s, f = self.spec, self.f
        if s.norm_type == "layernorm":
            return f.layer_norm(x, self.h)
        return f.rms_norm(x, self.h, self.rms_style)

    def layer(self, x, index):
        f, s, h, T = self.f, self.spec, self.h, self.T
        nh, kvh, hd = s.num_attention_heads, s.num_key_value_heads, s.head_dim
        q_dim, kv_dim = nh * hd, kvh * hd
        a = self._norm(x)
        if s.fused_qkv:
            qkv = f.linear(a, h, q_dim + 2 * kv_dim, self.qkv_name, s.qkv_bias)
            q, k, v = f.view(qkv, T * q_dim), f.view(qkv, T * kv_dim), f.view(qkv, T * kv_dim)
        else:
            q = f.linear(a, h, q_dim, "q_proj", s.qkv_bias)
            k = f.linear(a, h, kv_dim, "k_proj", s.qkv_bias)
            v = f.linear(a, h, kv_dim, "v_proj", s.qkv_bias)
        frac = self.rot_dim / hd
        q = rope(f, q, self.rdt, frac, self.rotary_cat_style)
        k = rope(f, k, self.rdt, frac, self.rotary_cat_style)
        k, v = f.kv_cache(k, v)
        o = f.attention(q, k, v, nh, kvh, hd, dropout=s.attention_dropout, eager_style="llama",
                        softcap=s.attn_logit_softcapping)
        o = f.linear(o, q_dim, h, self.out_name, s.attn_out_bias)
        sandwich = s.norms_per_layer == 4  # Gemma-2 also norms each block's output
        if sandwich:
            o = self._norm(o)  # post_attention_layernorm
        o = f.dropout(o, s.hidden_dropout)
        if self._parallel_residual():
            m = self._mlp(self._norm(x))
            m = f.dropout(m, s.hidden_dropout)
            return f.add(f.add(m, o), x)
        x = f.add(x, o)
        m = self._mlp(self._norm(x))
        if sandwich:
            m = self._norm(m)  # post_feedforward_layernorm
        m = f.dropout(m, s.hidden_dropout)
        return f.add(x, m)

    def _parallel_residual(self) -> bool:
        return False

    def _mlp(self, x):
        f, s, h, i = self.f, self.spec, self.h, self.spec.intermediate_size
        gate = f.linear(x, h, i, "gate_proj", s.mlp_bias)
        up = f.linear(x, h, i, "up_proj", s.mlp_bias)
        act = f.activation(gate, s.hidden_act)
        return f.linear(f.mul(act, up), i, h, "down_proj", s.mlp_bias)

    def final(self, x):
        return self._norm(x)

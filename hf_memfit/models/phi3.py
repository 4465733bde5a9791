"""Phi-3: the Llama layout with fused qkv_proj and gate_up_proj, partial rotary.

Everything hf-memfit knows by hand about the family: the transformers 5.23 config
defaults (a published config.json leaves out keys equal to them), peft's default
LoRA targets, the normalised fields, the linear modules, the parameter counts
and the symbolic forward fast mode runs.
"""

from __future__ import annotations

from typing import Any

from hf_memfit.models import llama
from hf_memfit.models._shared import Getter, Lin, decoder_counts, head_linears

MODEL_TYPES = ('phi3',)

DEFAULTS: dict[str, dict[str, Any]] = {
    "phi3": {
        "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "resid_pdrop": 0.0,
        "attention_dropout": 0.0, "hidden_act": "silu", "max_position_embeddings": 4096, "tie_word_embeddings":
        False, "sliding_window": None
    },
}

ALIASES: dict[str, dict[str, str]] = {}

# peft 0.21's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for these types (tests compare).
PEFT_LORA_TARGETS: dict[str, list[str]] = {}


def fields(get: Getter) -> dict[str, Any]:
    """Llama's fields, with the fused projections and Phi-3's residual dropout."""
    return {
        **llama.decoder_fields(get, qkv_bias=False, out_bias=False, mlp_bias=False,
                               sliding_window=get("sliding_window")),
        "fused_qkv": True,
        "attention_dropout": float(get("attention_dropout")),
        "hidden_dropout": float(get("resid_pdrop")),  # embd_pdrop is unused by transformers 5's Phi-3
    }


def linears(s, get: Getter, task: str, num_labels: int) -> list[Lin]:
    h, i, n = s.hidden_size, s.intermediate_size, s.num_layers
    q, kv = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    return [
        ("qkv_proj", h, q + 2 * kv, False, n, "layer"),
        ("o_proj", q, h, False, n, "layer"),
        ("gate_up_proj", h, 2 * i, False, n, "layer"),
        ("down_proj", i, h, False, n, "layer"),
        *head_linears(s, task, num_labels, h),
    ]


def counts(s, get: Getter, task: str, num_labels: int) -> dict[str, int]:
    h = s.hidden_size
    entries = linears(s, get, task, num_labels)
    return decoder_counts(s, entries, task, embedding=s.vocab_size * h, norms_per_layer=2 * h, final=h)


class Forward(llama.Forward):
    """Phi-3: fused qkv_proj and gate_up_proj, partial rotary (cat-style rotate_half)."""

    qkv_name = "qkv_proj"
    rotary_cat_style = True

    def _rotary_dim(self) -> int:
        s = self.spec
        cfg = s.config
        rp = cfg.get("partial_rotary_factor", (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
        return int(s.head_dim * (rp or 1.0))

    def _mlp(self, x):
        f, s, h, i = self.f, self.spec, self.h, self.spec.intermediate_size
        gu = f.linear(x, h, 2 * i, "gate_up_proj", False)
        gate, up = f.view(gu, gu.numel // 2), f.view(gu, gu.numel // 2)
        act = f.activation(gate, s.hidden_act)
        return f.linear(f.mul(up, act), i, h, "down_proj", False)

"""Gemma-2: the Llama layout with sandwich norms, scaled embeddings, soft-capping and alternating sliding/global attention.

Everything hf-memfit knows by hand about the family: the transformers 5.23 config
defaults (a published config.json leaves out keys equal to them), peft's default
LoRA targets, the normalised fields, the linear modules, the parameter counts
and the symbolic forward fast mode runs.
"""

from __future__ import annotations

from typing import Any

from hf_memfit.models import llama
from hf_memfit.models._shared import Getter, Lin

MODEL_TYPES = ('gemma2',)

DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {
        "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation":
        "gelu_pytorch_tanh", "max_position_embeddings": 8192, "tie_word_embeddings": True, "attention_bias": False,
        "attention_dropout": 0.0, "sliding_window": 4096, "final_logit_softcapping": 30.0, "attn_logit_softcapping":
        50.0
    },
}

ALIASES: dict[str, dict[str, str]] = {}

# peft 0.21's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for these types (tests compare).
PEFT_LORA_TARGETS: dict[str, list[str]] = {
    "gemma2": ["q_proj", "v_proj"],
}


# Transformers has no SDPA path for Gemma-2 (its logit soft-capping): it always runs eager attention.
EAGER_ATTENTION_ONLY = True


def fields(get: Getter) -> dict[str, Any]:
    """The Llama fields, plus four norms per layer, GELU-tanh, soft-capping and the sliding/global pair."""
    return {
        **llama.fields(get),
        "qkv_bias": bool(get("attention_bias")), "attn_out_bias": bool(get("attention_bias")), "mlp_bias": False,
        "hidden_act": get("hidden_activation"),
        "norms_per_layer": 4,
        "sliding_window": get("sliding_window"),
        "layer_period": 2,  # Gemma-2 alternates sliding and global attention
        "attn_logit_softcapping": get("attn_logit_softcapping"),
        "final_logit_softcapping": get("final_logit_softcapping"),
    }


def linears(s, get: Getter, task: str, num_labels: int) -> list[Lin]:
    return llama.linears(s, get, task, num_labels)


def counts(s, get: Getter, task: str, num_labels: int) -> dict[str, int]:
    return llama.counts(s, get, task, num_labels)


class Forward(llama.Forward):
    """Gemma-2's forward: embeddings scaled by sqrt(hidden_size), (1 + w) RMSNorms, sandwich norms."""

    rms_style = "gemma"

    def _embed_tokens(self):
        return self.f.scale(self.token_embedding(self.h))  # inputs_embeds * sqrt(hidden_size)

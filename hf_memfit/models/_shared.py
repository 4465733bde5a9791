"""What the hand-written family modules share: reading a config with its defaults, and counting.

Each family module (`models/<family>.py`) normalises its config keys into
`ModelSpec` fields, lists its linear modules and counts its parameters with
these helpers. Nothing here imports torch or transformers.
"""

from __future__ import annotations

from typing import Any

#: One kind of linear module: (name, in_features, out_features, bias, count, scope).
Lin = tuple[str, int, int, bool, int, str]


class Getter:
    """Read a config key, falling back to an alias, then to the transformers default."""

    def __init__(self, defaults: dict[str, Any], aliases: dict[str, str], config: dict) -> None:
        self.defaults = defaults
        self.aliases = aliases
        self.config = config

    def __call__(self, key: str) -> Any:
        if key in self.config:
            return self.config[key]
        alias = self.aliases.get(key)
        if alias is not None and alias in self.config:
            return self.config[alias]
        return self.defaults.get(key)

    def key(self, key: str) -> str:
        """The key this config actually uses for `key` (its alias when only that is present)."""
        alias = self.aliases.get(key)
        if key not in self.config and alias is not None and alias in self.config:
            return alias
        return key


def pos_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{what}` = {value!r}")
    return value


def common(get: Getter, h: int, layers: int, heads: int) -> dict[str, Any]:
    return {
        "hidden_size": pos_int(h, "hidden_size"),
        "num_layers": pos_int(layers, "num_layers"),
        "num_attention_heads": pos_int(heads, "num_attention_heads"),
        "vocab_size": pos_int(get("vocab_size"), "vocab_size"),
    }


def kv_heads(get: Getter, heads: int) -> int:
    kv = get("num_key_value_heads")
    return heads if kv is None else kv


def head_linears(s, task: str, num_labels: int, width: int, cls_bias: bool = False,
                 cls_name: str = "score") -> list[Lin]:
    if task == "seq-cls":
        return [(cls_name, width, num_labels, cls_bias, 1, "head")]
    # lm_head stays an nn.Linear module even when its weight is tied.
    return [("lm_head", width, s.vocab_size, False, 1, "head")]


def linear_params(entries: list[Lin], scope: str) -> int:
    """Weights and biases of every entry in `scope` (entry counts included)."""
    return sum((i * o + (o if b else 0)) * c for _, i, o, b, c, sc in entries if sc == scope)


def head_params(s, entries: list[Lin], task: str) -> int:
    if task != "seq-cls" and s.tie_word_embeddings:
        return 0  # tied lm_head shares the embedding; model.parameters() yields it once
    return linear_params(entries, "head")


def decoder_counts(s, entries: list[Lin], task: str, embedding: int, norms_per_layer: int,
                   final: int) -> dict[str, int]:
    """Counts for a stack of identical layers whose only non-linear weights are norms."""
    per_layer = linear_params(entries, "layer") // s.num_layers + norms_per_layer
    return {
        "embedding": embedding,
        "per_layer": per_layer,
        "layers": per_layer * s.num_layers,
        "final": final + linear_params(entries, "other"),
        "head": head_params(s, entries, task),
    }


# --- what the inputs of image / audio tasks read (models/inputs.py, models/vision_language.py) ---

PROCESSOR_KEY = "memfit_processor"  # the processor config, carried inside the model config dict


def processor_config(config: dict) -> dict:
    value = config.get(PROCESSOR_KEY)
    return value if isinstance(value, dict) else {}


def lookup(config: dict, key: str, default=None, *, towers=("vision_config", "audio_config", "encoder")):
    """`key` from the config, else from its vision / audio sub-config."""
    if config.get(key) is not None:
        return config[key]
    for tower in towers:
        sub = config.get(tower)
        if isinstance(sub, dict) and sub.get(key) is not None:
            return sub[key]
    return default

"""Model specs: find a model's config and describe its shape without torch.

`load_model_config` turns what the user typed (a catalogue name, a Hub id, a
local directory or a config.json path) into a config dict. `ModelSpec` reads
that dict once and normalises the per-family key names (GPT-2's `n_embd`,
T5's `d_model`, OPT's `ffn_dim`, ...) into one set of fields, and counts
parameters and linear modules in closed form.

This module is on the CLI's fast path, so it imports neither torch nor
transformers: only the standard library. The closed-form counts are checked
against models built by transformers 5.23 on the meta device in
`tests/test_spec.py`; the per-family defaults below are copied from the
transformers 5.23 config classes, because a config.json on the Hub leaves out
every key that equals its default.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from hf_memfit.errors import MemFitError

CATALOGUE_DIR = Path(__file__).parent / "catalogue"

#: Tasks hf-memfit estimates, and the transformers Auto class that builds each.
TASK_AUTO_CLASS = {
    "causal-lm": "AutoModelForCausalLM",
    "seq-cls": "AutoModelForSequenceClassification",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "token-cls": "AutoModelForTokenClassification",
    "image-text-to-text": "AutoModelForImageTextToText",  # trained on text-only batches
}
TASKS = tuple(TASK_AUTO_CLASS)

# Connecting to the Hub must never make an offline machine wait: probe the
# endpoint with a short TCP connect first (huggingface_hub itself retries a
# failed DNS lookup for ~25 s), then give the download a short etag timeout.
_HUB_PROBE_TIMEOUT_S = 1.5
_HUB_ETAG_TIMEOUT_S = 5.0

# Defaults of the transformers 5.23 config classes, for the keys read here.
# A published config.json omits keys equal to the default, so reading a key
# must fall back to exactly what transformers would use.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {
        "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
        "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1,
        "attn_pdrop": 0.1, "tie_word_embeddings": True,
    },
    "bert": {
        "vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
        "intermediate_size": 3072, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 512, "type_vocab_size": 2,
        "tie_word_embeddings": True,
    },
    "t5": {
        "vocab_size": 32128, "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6,
        "num_decoder_layers": None, "num_heads": 8, "relative_attention_num_buckets": 32,
        "dropout_rate": 0.1, "feed_forward_proj": "relu",
    },
    "opt": {
        "vocab_size": 50272, "hidden_size": 768, "num_hidden_layers": 12, "ffn_dim": 3072,
        "max_position_embeddings": 2048, "do_layer_norm_before": True, "_remove_final_layer_norm": False,
        "word_embed_proj_dim": None, "dropout": 0.1, "attention_dropout": 0.0, "num_attention_heads": 12,
        "activation_function": "relu", "enable_bias": True, "layer_norm_elementwise_affine": True,
        "tie_word_embeddings": True,
    },
    "llama": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu",
        "max_position_embeddings": 2048, "tie_word_embeddings": False, "attention_bias": False,
        "attention_dropout": 0.0, "mlp_bias": False, "head_dim": None,
    },
    "mistral": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu",
        "max_position_embeddings": 4096 * 32, "tie_word_embeddings": False, "sliding_window": 4096,
        "attention_dropout": 0.0,
    },
    "qwen2": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": None, "hidden_act": "silu",
        "max_position_embeddings": 32768, "tie_word_embeddings": False, "use_sliding_window": False,
        "sliding_window": 4096, "max_window_layers": 28, "attention_dropout": 0.0,
    },
    "gemma2": {
        "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0,
        "sliding_window": 4096, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
    },
    "phi3": {
        "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "resid_pdrop": 0.0,
        "attention_dropout": 0.0, "hidden_act": "silu", "max_position_embeddings": 4096,
        "tie_word_embeddings": False, "sliding_window": None,
    },
    "gpt_neox": {
        "vocab_size": 50432, "hidden_size": 6144, "num_hidden_layers": 44, "num_attention_heads": 64,
        "intermediate_size": 24576, "hidden_act": "gelu", "attention_dropout": 0.0, "hidden_dropout": 0.0,
        "max_position_embeddings": 2048, "tie_word_embeddings": False, "attention_bias": True,
    },
}

# Config keys transformers accepts under another name (the config classes'
# `attribute_map`); a hand-written config may use either.
_ALIASES: dict[str, dict[str, str]] = {
    "gpt2": {"n_embd": "hidden_size", "n_positions": "max_position_embeddings",
             "n_head": "num_attention_heads", "n_layer": "num_hidden_layers"},
    "t5": {"d_model": "hidden_size", "num_heads": "num_attention_heads", "num_layers": "num_hidden_layers",
           "d_kv": "head_dim"},
}

SUPPORTED_MODEL_TYPES = tuple(sorted(_DEFAULTS))

# peft 0.21's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
# (peft/utils/constants.py) for the model types above. Copied as data so the
# fast path does not import peft; tests compare it with peft. peft has no
# entry for phi3: with no target modules given, peft raises for it too.
_PEFT_LORA_TARGETS: dict[str, list[str]] = {
    "t5": ["q", "v"],
    "gpt2": ["c_attn"],
    "opt": ["q_proj", "v_proj"],
    "gpt_neox": ["query_key_value"],
    "bert": ["query", "value"],
    "llama": ["q_proj", "v_proj"],
    "mistral": ["q_proj", "v_proj"],
    "gemma2": ["q_proj", "v_proj"],
    "qwen2": ["q_proj", "v_proj"],
}

_LLAMA_LIKE = ("llama", "mistral", "qwen2", "gemma2")


# --------------------------------------------------------------------------
# Finding a model's config
# --------------------------------------------------------------------------


def _hub_id_from_file(path: Path) -> str:
    return path.stem.replace("--", "/", 1)


@lru_cache(maxsize=1)
def _catalogue_index() -> dict[str, str]:
    """Lower-cased full ids and short names -> canonical hub id."""
    index: dict[str, str] = {}
    for full in catalogue_names():
        index[full.lower()] = full
        index.setdefault(full.rsplit("/", 1)[-1].lower(), full)
        index.setdefault(full.replace("/", "--").lower(), full)
    return index


@lru_cache(maxsize=1)
def _catalogue_names() -> tuple[str, ...]:
    return tuple(sorted((_hub_id_from_file(p) for p in CATALOGUE_DIR.glob("*.json")), key=str.lower))


def catalogue_names() -> list[str]:
    """Return the hub ids of every model shipped in the offline catalogue, sorted."""
    return list(_catalogue_names())


def _read_catalogue(hub_id: str) -> dict:
    path = CATALOGUE_DIR / (hub_id.replace("/", "--") + ".json")
    config = json.loads(path.read_text(encoding="utf-8"))
    config.pop("_source", None)  # where the published config.json was copied from; not a config key
    return config


def _read_config_file(path: Path, shown: str) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise MemFitError(f"`model` file `{shown}` could not be read ({exc.__class__.__name__}); "
                          "pass a readable config.json") from None
    except json.JSONDecodeError as exc:
        raise MemFitError(f"`model` file `{shown}` is not valid JSON (line {exc.lineno}: {exc.msg}); "
                          "pass a model's config.json") from None
    if not isinstance(config, dict):
        raise MemFitError(f"`model` file `{shown}` holds a JSON {type(config).__name__}, not an object; "
                          "pass a model's config.json")
    return config


def _looks_like_path(text: str) -> bool:
    # A Hub id is `name` or `owner/name`; anything else that names a file
    # system location should get a "does not exist" error, not a Hub lookup.
    return (
        text.startswith(("/", "./", "../", "~", ".\\", "..\\"))
        or text.lower().endswith(".json")
        or "\\" in text
        or text.count("/") > 1
    )


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _hub_reachable() -> bool:
    """Quick TCP probe of the Hub endpoint so an offline machine fails in milliseconds."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # the proxy, not us, decides what is reachable
    import socket
    from urllib.parse import urlsplit

    endpoint = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=_HUB_PROBE_TIMEOUT_S).close()
    except OSError:
        return False
    return True


def _fetch_from_hub(repo_id: str) -> tuple[dict | None, str]:
    """Return (config, "") from the HF cache or the Hub, or (None, why not)."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        return None, "huggingface_hub is not installed so the Hub was not tried"
    # The local HF cache needs no network, so try it even when offline.
    try:
        path = hf_hub_download(repo_id, "config.json", local_files_only=True)
        return json.loads(Path(path).read_text(encoding="utf-8")), ""
    except Exception:  # noqa: BLE001 - any failure just means "not cached"
        pass
    if _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE"):
        return None, "HF_HUB_OFFLINE is set so the Hub was not tried"
    if not _hub_reachable():
        return None, "the Hub could not be reached"
    try:
        path = hf_hub_download(repo_id, "config.json", etag_timeout=_HUB_ETAG_TIMEOUT_S)
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except Exception as exc:  # noqa: BLE001 - report, never crash, on any Hub failure
        kind = type(exc).__name__
        if kind == "GatedRepoError":
            return None, "the Hub repo is gated (accept its licence and run `hf auth login`)"
        if kind in {"RepositoryNotFoundError", "HFValidationError", "EntryNotFoundError",
                    "RemoteEntryNotFoundError"}:
            return None, "the Hub has no such repo with a config.json"
        return None, "the Hub could not be reached"
    if not isinstance(config, dict):
        return None, "the Hub's config.json is not a JSON object"
    return config, ""


def _close_matches(text: str, limit: int = 5) -> list[str]:
    """Catalogue ids that look like `text`, best first (full ids and short names both count)."""
    query = text.strip().lower()
    query_short = query.rsplit("/", 1)[-1]
    scores: dict[str, float] = {}
    for full in catalogue_names():
        short = full.rsplit("/", 1)[-1].lower()
        score = max(
            difflib.SequenceMatcher(None, query, full.lower()).ratio(),
            difflib.SequenceMatcher(None, query_short, short).ratio(),
        )
        if query_short and query_short in short:
            score = max(score, 0.6 + 0.4 * len(query_short) / len(short))  # "llama" -> all Llamas
        if score >= 0.6:
            scores[full] = score
    return sorted(scores, key=lambda name: (-scores[name], name.lower()))[:limit]


def load_model_config(model: str) -> tuple[str, dict]:
    """Resolve MODEL to `(canonical name, config dict)`.

    Tried in order: a path to a config.json file; a directory holding a
    config.json; a catalogue name (full hub id or the short name after the
    slash, case-insensitive, e.g. `gpt2-xl`, `llama-3.1-8b`); the local
    Hugging Face cache; the Hub itself, unless `HF_HUB_OFFLINE` is set or the
    Hub does not answer a quick probe. Raises `MemFitError` naming close
    catalogue matches when nothing works.
    """
    if not isinstance(model, str) or not model.strip():
        raise MemFitError("`model` is empty; give a catalogue name such as gpt2-xl, a Hub id, "
                          "or a local directory / config.json path")
    text = model.strip()
    path = Path(text).expanduser()
    if path.is_file():
        return text, _read_config_file(path, text)
    if path.is_dir():
        if (path / "config.json").is_file():
            return text, _read_config_file(path / "config.json", text + "/config.json")
        raise MemFitError(f"`model` directory `{text}` has no config.json; "
                          "pass the directory that holds the model's config.json")
    hub_id = _catalogue_index().get(text.lower())
    if hub_id is not None:
        return hub_id, _read_catalogue(hub_id)
    if _looks_like_path(text):
        raise MemFitError(f"`model` path `{text}` does not exist; "
                          "pass an existing directory or config.json file")
    config, why = _fetch_from_hub(text)
    if config is not None:
        return text, config
    matches = _close_matches(text)
    hint = f"close matches: {', '.join(matches)}" if matches else "no close catalogue matches"
    raise MemFitError(f"unknown model `{text}`: not in the catalogue and {why}; {hint} "
                      "(or pass a local directory / config.json path)")


# --------------------------------------------------------------------------
# The normalised spec
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearModule:
    """One kind of nn.Linear (or GPT-2 Conv1D) module, as peft LoRA sees it.

    `name` is the module's attribute name (the suffix peft matches
    `target_modules` against); `count` is how many such modules the whole
    model has. `scope` says where they live: "layer" (inside the repeated
    blocks), "other" (elsewhere in the body: BERT's pooler, OPT's
    project_in/out) or "head" (lm_head / score / classifier).
    """

    name: str
    in_features: int
    out_features: int
    bias: bool
    count: int
    scope: str = "layer"

    @property
    def weight_numel(self) -> int:
        """Elements in one module's weight."""
        return self.in_features * self.out_features


@dataclass(frozen=True)
class ModelSpec:
    """A model's architecture, normalised across families.

    Build with `ModelSpec.from_config(name, config)` or `resolve_model(model)`.
    For T5, `num_layers` is the encoder depth and `num_decoder_layers` the
    decoder depth; decoder-only models have `num_decoder_layers == 0`.
    """

    name: str
    model_type: str
    config: dict = field(repr=False, compare=False)
    hidden_size: int
    num_layers: int
    num_decoder_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int | None  # None: no learned/rotary limit (T5 relative positions)
    tie_word_embeddings: bool
    is_encoder_decoder: bool
    default_task: str
    supported_tasks: tuple[str, ...]
    layer_count_keys: tuple[str, ...]
    # What the hand-written fast formulas read; the generic path leaves the defaults.
    hidden_act: str = ""
    gated_mlp: bool = False
    norm_type: str = ""  # "layernorm" | "rmsnorm"
    norms_per_layer: int = 0  # decoder layer for T5 (3); encoder layers have 2
    fused_qkv: bool = False  # one projection makes q, k and v (GPT-2 c_attn, NeoX, Phi-3)
    qkv_bias: bool = False
    attn_out_bias: bool = False
    mlp_bias: bool = False
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0  # residual / hidden-state dropout inside the layers
    embedding_dropout: float = 0.0
    activation_dropout: float = 0.0  # between the MLP's activation and its output projection
    sliding_window: int | None = None
    layer_period: int = 1  # layers per repeating pattern: 2 for Gemma-2 (sliding, global), 6 for Gemma-3
    embedding_dim: int = 0  # token-embedding width: OPT's word_embed_proj_dim, else hidden_size
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    dtype: str | None = None  # the checkpoint's torch_dtype / dtype, if the config says
    # The generic path's facts (`generic.describe`): linear modules and counts per task, MoE routing.
    generic: dict | None = field(default=None, repr=False, compare=False)

    # ---- construction ------------------------------------------------------

    @classmethod
    def from_config(cls, name: str, config: dict) -> ModelSpec:
        """Normalise a Hugging Face config dict into a `ModelSpec`."""
        if not isinstance(config, dict):
            raise MemFitError(f"`model` `{name}`: its config is a {type(config).__name__}, not a JSON object")
        model_type = config.get("model_type")
        if not model_type:
            raise MemFitError(f"`model` `{name}`: its config.json has no `model_type`; "
                              "pass a transformers model's config.json")
        dtype = config.get("torch_dtype", config.get("dtype"))
        dtype = dtype if isinstance(dtype, str) else None
        if model_type not in _DEFAULTS:
            from hf_memfit.generic import describe  # imports transformers unless cached

            facts = describe(name, config)
            fields = dict(facts["fields"])
            fields["supported_tasks"] = tuple(fields["supported_tasks"])
            fields["layer_count_keys"] = tuple(fields["layer_count_keys"])
            return cls(name=name, model_type=model_type, config=copy.deepcopy(config), dtype=dtype,
                       generic=facts, **fields)
        get = _Getter(model_type, config)
        try:
            fields = _FAMILY_FIELDS[model_type](get)
        except (TypeError, ValueError, ZeroDivisionError) as exc:
            raise MemFitError(f"`model` `{name}`: its config.json has a missing or invalid size "
                              f"({exc}); pass an unmodified transformers config.json") from None
        return cls(name=name, model_type=model_type, config=copy.deepcopy(config), dtype=dtype, **fields)

    def with_layers(self, n: int) -> dict:
        """Return a copy of the config with the stack depth set to `n` layers.

        T5 gets `n` encoder and `n` decoder layers. Per-layer lists
        (`layer_types` in Gemma-2 / Qwen2 configs saved by transformers 5) are
        cut or extended by repeating their pattern so the model still builds.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise MemFitError(f"`layers` must be a positive integer, got {n!r}")
        config = copy.deepcopy(self.config)
        aliases = _ALIASES.get(self.model_type, {})
        for key in self.layer_count_keys:
            _set_path(config, key, n)
            alias = aliases.get(key)
            if alias in config:
                config[alias] = n
        _fit_layer_lists(config, n, self.num_layers)
        return config

    @property
    def hand_written(self) -> bool:
        """Whether the family has hand-written fast formulas (else fast mode is calibrated from traces)."""
        return self.generic is None

    @property
    def moe(self) -> dict | None:
        """{"experts", "top_k"} when the model routes tokens to experts, else None."""
        return self.generic.get("moe") if self.generic else None

    # ---- tasks ---------------------------------------------------------------

    def check_task(self, task: str) -> str:
        """Return `task` (or the default task when None) if this model supports it; raise otherwise."""
        if task is None:
            return self.default_task
        if task not in self.supported_tasks:
            known = "" if task in TASKS else f" (tasks: {', '.join(TASKS)})"
            raise MemFitError(f"`task` `{task}` is not supported for {self.model_type} model `{self.name}`"
                              f"{known}; use one of: {', '.join(self.supported_tasks)}")
        return task

    # ---- parameter counts ------------------------------------------------------

    def parameter_count(self, task: str | None = None, num_labels: int = 2) -> dict[str, int]:
        """Count parameters in closed form, as transformers builds the task's Auto class.

        Keys: `embedding` (token and position tables, embedding norms, OPT's
        project_in, T5's relative-position tables), `per_layer` (one repeated
        block; the decoder block for T5), `layers` (all blocks), `final` (final
        norms, OPT's project_out, BERT's pooler), `head` (lm_head, 0 when tied;
        or the classifier for seq-cls) and `total`. T5 adds
        `per_encoder_layer` and `per_decoder_layer`. `total` equals
        `sum(p.numel() for p in model.parameters())`, tied weights once.
        """
        task = self.check_task(task)
        if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
            raise MemFitError(f"`num_labels` must be a positive integer, got {num_labels!r}")
        if self.generic is not None:
            from hf_memfit.generic import task_facts

            return dict(task_facts(self.name, self.config, self.generic, task, num_labels)["counts"])
        counts = _FAMILY_COUNTS[self.model_type](self, _Getter(self.model_type, self.config), task, num_labels)
        counts["total"] = counts["embedding"] + counts["layers"] + counts["final"] + counts["head"]
        return counts

    # ---- linear modules --------------------------------------------------------

    def linear_modules(self, task: str | None = None, num_labels: int = 2) -> list[LinearModule]:
        """List the model's nn.Linear / GPT-2 Conv1D modules, grouped by name and shape.

        Layer modules come first (scope "layer"), then other body modules
        ("other") and the task head ("head"). Identical (name, shape, bias,
        scope) entries are merged; same-named modules of different shapes
        (GPT-2's attention and MLP `c_proj`) are listed separately.
        """
        task = self.check_task(task)
        if self.generic is not None:
            from hf_memfit.generic import task_facts

            raw = task_facts(self.name, self.config, self.generic, task, num_labels)["linears"]
        else:
            raw = _FAMILY_LINEARS[self.model_type](self, _Getter(self.model_type, self.config), task, num_labels)
        merged: dict[tuple, int] = {}
        for name, fan_in, fan_out, bias, count, scope in raw:
            if count:
                key = (name, fan_in, fan_out, bias, scope)
                merged[key] = merged.get(key, 0) + count
        order = {"layer": 0, "other": 1, "head": 2}
        items = sorted(merged.items(), key=lambda kv: order[kv[0][4]])  # stable: keeps layer order
        return [LinearModule(n, i, o, b, c, s) for (n, i, o, b, s), c in items]

    def default_lora_target_modules(self) -> list[str]:
        """peft's default LoRA `target_modules` for this model type.

        Mirrors peft 0.21's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.
        peft has no default for some types (phi3); like peft, this raises then.
        """
        targets = self.generic["peft_targets"] if self.generic is not None else _PEFT_LORA_TARGETS.get(self.model_type)
        if targets is None:
            names = ", ".join(dict.fromkeys(m.name for m in self.linear_modules() if m.scope == "layer"))
            raise MemFitError(f"peft has no default LoRA target modules for model type `{self.model_type}`; "
                              f"pass `--lora-target-modules all-linear` or some of: {names}")
        return list(targets)


def resolve_model(model: str) -> ModelSpec:
    """Resolve MODEL (see `load_model_config`) and normalise it into a `ModelSpec`."""
    name, config = load_model_config(model)
    return ModelSpec.from_config(name, config)


def _set_path(config: dict, key: str, value: Any) -> None:
    """Set a dotted key (`text_config.num_hidden_layers`) in a nested config dict."""
    *parents, last = key.split(".")
    for part in parents:
        config = config.setdefault(part, {})
    config[last] = value


def _fit_layer_lists(config: dict, n: int, depth: int) -> None:
    """Cut or extend per-layer lists by their own pattern, in the config or its text_config.

    `layer_types` always; any other list as long as the real depth (SmolLM3's
    `no_rope_layers`) when the depth is known to be the stack's.
    """
    for holder in (config, config.get("text_config")):
        if not isinstance(holder, dict):
            continue
        for key, value in holder.items():
            if not isinstance(value, list) or not value:
                continue
            per_layer = depth > 1 and len(value) == depth and "token" not in key and key != "architectures"
            if key == "layer_types" or per_layer:
                holder[key] = [value[i % len(value)] for i in range(n)]


# --------------------------------------------------------------------------
# Per-family normalisation
# --------------------------------------------------------------------------


class _Getter:
    """Read a config key, falling back to an alias, then to the transformers default."""

    def __init__(self, model_type: str, config: dict) -> None:
        self.defaults = _DEFAULTS[model_type]
        self.aliases = _ALIASES.get(model_type, {})
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


def _pos_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{what}` = {value!r}")
    return value


def _common(get: _Getter, h: int, layers: int, heads: int) -> dict[str, Any]:
    return {
        "hidden_size": _pos_int(h, "hidden_size"),
        "num_layers": _pos_int(layers, "num_layers"),
        "num_attention_heads": _pos_int(heads, "num_attention_heads"),
        "vocab_size": _pos_int(get("vocab_size"), "vocab_size"),
    }


def _fields_gpt2(get: _Getter) -> dict[str, Any]:
    h, heads = get("n_embd"), get("n_head")
    return {
        **_common(get, h, get("n_layer"), heads),
        "num_decoder_layers": 0,
        "num_key_value_heads": heads,
        "head_dim": h // heads,
        "intermediate_size": get("n_inner") or 4 * h,
        "max_position_embeddings": get("n_positions"),
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


def _fields_bert(get: _Getter) -> dict[str, Any]:
    h, heads = get("hidden_size"), get("num_attention_heads")
    hidden_drop = float(get("hidden_dropout_prob"))
    return {
        **_common(get, h, get("num_hidden_layers"), heads),
        "num_decoder_layers": 0,
        "num_key_value_heads": heads,
        "head_dim": h // heads,
        "intermediate_size": get("intermediate_size"),
        "max_position_embeddings": get("max_position_embeddings"),
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


def _t5_ff(get: _Getter) -> tuple[str, bool]:
    # transformers: "gated-gelu" -> gated, activation gelu_new; "relu" -> plain relu.
    proj = get("feed_forward_proj")
    parts = proj.split("-")
    gated = parts[0] == "gated"
    act = "gelu_new" if proj == "gated-gelu" else parts[-1]
    return act, gated


def _fields_t5(get: _Getter) -> dict[str, Any]:
    h, heads = get("d_model"), get("num_heads")
    enc = get("num_layers")
    dec = get("num_decoder_layers")
    act, gated = _t5_ff(get)
    drop = float(get("dropout_rate"))
    return {
        **_common(get, h, enc, heads),
        "num_decoder_layers": _pos_int(enc if dec is None else dec, "num_decoder_layers"),
        "num_key_value_heads": heads,
        "head_dim": get("d_kv"),
        "intermediate_size": get("d_ff"),
        "max_position_embeddings": None,  # relative position buckets: no learned limit
        # transformers 5 always ties T5's lm_head to the shared embedding
        # (T5Config forces tie_word_embeddings=True, even for v1.1 configs).
        "tie_word_embeddings": True,
        "is_encoder_decoder": True,
        "default_task": "seq2seq",
        "supported_tasks": ("seq2seq",),
        "layer_count_keys": (get.key("num_layers"), "num_decoder_layers"),
        "hidden_act": act,
        "gated_mlp": gated, "norm_type": "rmsnorm", "norms_per_layer": 3, "fused_qkv": False,
        "qkv_bias": False, "attn_out_bias": False, "mlp_bias": False,
        "attention_dropout": drop, "hidden_dropout": drop, "embedding_dropout": drop,
        "activation_dropout": drop,
        "sliding_window": None, "layer_period": 1, "embedding_dim": h,
    }


def _fields_opt(get: _Getter) -> dict[str, Any]:
    h, heads = get("hidden_size"), get("num_attention_heads")
    bias = bool(get("enable_bias"))
    return {
        **_common(get, h, get("num_hidden_layers"), heads),
        "num_decoder_layers": 0,
        "num_key_value_heads": heads,
        "head_dim": h // heads,
        "intermediate_size": get("ffn_dim"),
        "max_position_embeddings": get("max_position_embeddings"),
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


def _kv_heads(get: _Getter, heads: int) -> int:
    kv = get("num_key_value_heads")
    return heads if kv is None else kv


def _fields_llama_like(get: _Getter) -> dict[str, Any]:
    """llama, mistral, qwen2, gemma2: RMSNorm, rotary, gated MLP, GQA."""
    model_type = get.config["model_type"]
    h, heads = get("hidden_size"), get("num_attention_heads")
    if model_type == "llama":
        qkv_bias = out_bias = bool(get("attention_bias"))
        mlp_bias = bool(get("mlp_bias"))
    elif model_type == "gemma2":
        qkv_bias = out_bias = bool(get("attention_bias"))
        mlp_bias = False
    elif model_type == "qwen2":
        qkv_bias, out_bias, mlp_bias = True, False, False  # hard-coded in modeling_qwen2
    else:
        qkv_bias = out_bias = mlp_bias = False
    if model_type == "qwen2":
        # Qwen2Config drops sliding_window unless use_sliding_window is set.
        sliding = get("sliding_window") if get("use_sliding_window") else None
    elif model_type in ("mistral", "gemma2"):
        sliding = get("sliding_window")
    else:
        sliding = None
    gemma = model_type == "gemma2"
    return {
        **_common(get, h, get("num_hidden_layers"), heads),
        "num_decoder_layers": 0,
        "num_key_value_heads": _kv_heads(get, heads),
        "head_dim": get("head_dim") or h // heads,
        "intermediate_size": get("intermediate_size"),
        "max_position_embeddings": get("max_position_embeddings"),
        "tie_word_embeddings": bool(get("tie_word_embeddings")),
        "is_encoder_decoder": False,
        "default_task": "causal-lm",
        "supported_tasks": ("causal-lm", "seq-cls"),
        "layer_count_keys": ("num_hidden_layers",),
        "hidden_act": get("hidden_activation") if gemma else get("hidden_act"),
        "gated_mlp": True, "norm_type": "rmsnorm", "norms_per_layer": 4 if gemma else 2,
        "fused_qkv": False, "qkv_bias": qkv_bias, "attn_out_bias": out_bias, "mlp_bias": mlp_bias,
        "attention_dropout": float(get("attention_dropout") or 0.0),
        "hidden_dropout": 0.0, "embedding_dropout": 0.0, "activation_dropout": 0.0,
        "sliding_window": sliding,
        "layer_period": 2 if gemma else 1,  # Gemma-2 alternates sliding and global attention
        "embedding_dim": h,
        "attn_logit_softcapping": get("attn_logit_softcapping") if gemma else None,
        "final_logit_softcapping": get("final_logit_softcapping") if gemma else None,
    }


def _fields_phi3(get: _Getter) -> dict[str, Any]:
    h, heads = get("hidden_size"), get("num_attention_heads")
    return {
        **_common(get, h, get("num_hidden_layers"), heads),
        "num_decoder_layers": 0,
        "num_key_value_heads": _kv_heads(get, heads),
        "head_dim": get("head_dim") or h // heads,
        "intermediate_size": get("intermediate_size"),
        "max_position_embeddings": get("max_position_embeddings"),
        "tie_word_embeddings": bool(get("tie_word_embeddings")),
        "is_encoder_decoder": False,
        "default_task": "causal-lm",
        "supported_tasks": ("causal-lm", "seq-cls"),
        "layer_count_keys": ("num_hidden_layers",),
        "hidden_act": get("hidden_act"),
        "gated_mlp": True, "norm_type": "rmsnorm", "norms_per_layer": 2, "fused_qkv": True,
        "qkv_bias": False, "attn_out_bias": False, "mlp_bias": False,
        "attention_dropout": float(get("attention_dropout")),
        "hidden_dropout": float(get("resid_pdrop")),
        "embedding_dropout": 0.0,  # embd_pdrop is unused by transformers 5's Phi-3
        "activation_dropout": 0.0,
        "sliding_window": get("sliding_window"), "layer_period": 1, "embedding_dim": h,
    }


def _fields_gpt_neox(get: _Getter) -> dict[str, Any]:
    h, heads = get("hidden_size"), get("num_attention_heads")
    bias = bool(get("attention_bias"))
    hidden_drop = float(get("hidden_dropout"))
    return {
        **_common(get, h, get("num_hidden_layers"), heads),
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


_FAMILY_FIELDS = {
    "gpt2": _fields_gpt2, "bert": _fields_bert, "t5": _fields_t5, "opt": _fields_opt,
    "llama": _fields_llama_like, "mistral": _fields_llama_like, "qwen2": _fields_llama_like,
    "gemma2": _fields_llama_like, "phi3": _fields_phi3, "gpt_neox": _fields_gpt_neox,
}


# --------------------------------------------------------------------------
# Linear modules, per family. Each entry: (name, in, out, bias, count, scope).
# Parameter counts are derived from these plus the non-linear parameters.
# --------------------------------------------------------------------------

_Lin = tuple[str, int, int, bool, int, str]


def _head_linears(s: ModelSpec, task: str, num_labels: int, width: int, cls_bias: bool = False,
                  cls_name: str = "score") -> list[_Lin]:
    if task == "seq-cls":
        return [(cls_name, width, num_labels, cls_bias, 1, "head")]
    # lm_head stays an nn.Linear module even when its weight is tied.
    return [("lm_head", width, s.vocab_size, False, 1, "head")]


def _linears_gpt2(s: ModelSpec, get: _Getter, task: str, num_labels: int) -> list[_Lin]:
    h, i, n = s.hidden_size, s.intermediate_size, s.num_layers
    return [
        ("c_attn", h, 3 * h, True, n, "layer"),
        ("c_proj", h, h, True, n, "layer"),  # attention output
        ("c_fc", h, i, True, n, "layer"),
        ("c_proj", i, h, True, n, "layer"),  # MLP output
        *_head_linears(s, task, num_labels, h),
    ]


def _linears_bert(s: ModelSpec, get: _Getter, task: str, num_labels: int) -> list[_Lin]:
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


def _linears_t5(s: ModelSpec, get: _Getter, task: str, num_labels: int) -> list[_Lin]:
    h, f = s.hidden_size, s.intermediate_size
    inner = s.num_attention_heads * s.head_dim
    enc, dec = s.num_layers, s.num_decoder_layers
    attn = enc + 2 * dec  # encoder self, decoder self and decoder cross attention
    ff = enc + dec
    out = [(p, h, inner, False, attn, "layer") for p in ("q", "k", "v")]
    out.append(("o", inner, h, False, attn, "layer"))
    if s.gated_mlp:
        out += [("wi_0", h, f, False, ff, "layer"), ("wi_1", h, f, False, ff, "layer")]
    else:
        out.append(("wi", h, f, False, ff, "layer"))
    out.append(("wo", f, h, False, ff, "layer"))
    out += _head_linears(s, task, num_labels, h)
    return out


def _linears_opt(s: ModelSpec, get: _Getter, task: str, num_labels: int) -> list[_Lin]:
    h, f, n, p = s.hidden_size, s.intermediate_size, s.num_layers, s.embedding_dim
    b = s.qkv_bias
    out = [(name, h, h, b, n, "layer") for name in ("k_proj", "v_proj", "q_proj", "out_proj")]
    out += [("fc1", h, f, b, n, "layer"), ("fc2", f, h, b, n, "layer")]
    if p != h:
        out += [("project_out", h, p, False, 1, "other"), ("project_in", p, h, False, 1, "other")]
    out += _head_linears(s, task, num_labels, p)
    return out


def _linears_llama_like(s: ModelSpec, get: _Getter, task: str, num_labels: int) -> list[_Lin]:
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
        *_head_linears(s, task, num_labels, h),
    ]


def _linears_phi3(s: ModelSpec, get: _Getter, task: str, num_labels: int) -> list[_Lin]:
    h, i, n = s.hidden_size, s.intermediate_size, s.num_layers
    q, kv = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    return [
        ("qkv_proj", h, q + 2 * kv, False, n, "layer"),
        ("o_proj", q, h, False, n, "layer"),
        ("gate_up_proj", h, 2 * i, False, n, "layer"),
        ("down_proj", i, h, False, n, "layer"),
        *_head_linears(s, task, num_labels, h),
    ]


def _linears_gpt_neox(s: ModelSpec, get: _Getter, task: str, num_labels: int) -> list[_Lin]:
    h, i, n = s.hidden_size, s.intermediate_size, s.num_layers
    return [
        ("query_key_value", h, 3 * h, s.qkv_bias, n, "layer"),
        ("dense", h, h, s.attn_out_bias, n, "layer"),
        ("dense_h_to_4h", h, i, True, n, "layer"),
        ("dense_4h_to_h", i, h, True, n, "layer"),
        *_head_linears(s, task, num_labels, h),
    ]


_FAMILY_LINEARS = {
    "gpt2": _linears_gpt2, "bert": _linears_bert, "t5": _linears_t5, "opt": _linears_opt,
    "llama": _linears_llama_like, "mistral": _linears_llama_like, "qwen2": _linears_llama_like,
    "gemma2": _linears_llama_like, "phi3": _linears_phi3, "gpt_neox": _linears_gpt_neox,
}


def _linear_params(entries: list[_Lin], scope: str) -> int:
    """Weights and biases of every entry in `scope` (entry counts included)."""
    return sum((i * o + (o if b else 0)) * c for _, i, o, b, c, sc in entries if sc == scope)


# --------------------------------------------------------------------------
# Parameter counts, per family
# --------------------------------------------------------------------------


def _head_params(s: ModelSpec, entries: list[_Lin], task: str) -> int:
    if task != "seq-cls" and s.tie_word_embeddings:
        return 0  # tied lm_head shares the embedding; model.parameters() yields it once
    return _linear_params(entries, "head")


def _decoder_counts(s: ModelSpec, entries: list[_Lin], task: str, embedding: int, norms_per_layer: int,
                    final: int) -> dict[str, int]:
    """Counts for a stack of identical layers whose only non-linear weights are norms."""
    per_layer = _linear_params(entries, "layer") // s.num_layers + norms_per_layer
    return {
        "embedding": embedding,
        "per_layer": per_layer,
        "layers": per_layer * s.num_layers,
        "final": final + _linear_params(entries, "other"),
        "head": _head_params(s, entries, task),
    }


def _counts_gpt2(s: ModelSpec, get: _Getter, task: str, num_labels: int) -> dict[str, int]:
    h = s.hidden_size
    entries = _linears_gpt2(s, get, task, num_labels)
    return _decoder_counts(s, entries, task, embedding=(s.vocab_size + s.max_position_embeddings) * h,
                           norms_per_layer=2 * 2 * h, final=2 * h)


def _counts_bert(s: ModelSpec, get: _Getter, task: str, num_labels: int) -> dict[str, int]:
    h = s.hidden_size
    entries = _linears_bert(s, get, task, num_labels)
    tables = s.vocab_size + s.max_position_embeddings + get("type_vocab_size")
    return _decoder_counts(s, entries, task, embedding=tables * h + 2 * h,
                           norms_per_layer=2 * 2 * h, final=0)


def _counts_t5(s: ModelSpec, get: _Getter, task: str, num_labels: int) -> dict[str, int]:
    h, f = s.hidden_size, s.intermediate_size
    inner = s.num_attention_heads * s.head_dim
    attn = 4 * h * inner + h  # q, k, v, o and the layer's RMSNorm weight
    ff = (3 if s.gated_mlp else 2) * h * f + h
    per_enc, per_dec = attn + ff, 2 * attn + ff
    # Layer 0 of each stack owns a relative-position bias table; it is counted
    # with the embeddings so every layer of a stack has the same size.
    relative = 2 * get("relative_attention_num_buckets") * s.num_attention_heads
    entries = _linears_t5(s, get, task, num_labels)
    return {
        "embedding": s.vocab_size * h + relative,
        "per_layer": per_dec,
        "per_encoder_layer": per_enc,
        "per_decoder_layer": per_dec,
        "layers": per_enc * s.num_layers + per_dec * s.num_decoder_layers,
        "final": 2 * h,  # encoder and decoder final RMSNorms
        "head": _head_params(s, entries, task),
    }


def _counts_opt(s: ModelSpec, get: _Getter, task: str, num_labels: int) -> dict[str, int]:
    h, p = s.hidden_size, s.embedding_dim
    entries = _linears_opt(s, get, task, num_labels)
    norm = 2 * h if get("layer_norm_elementwise_affine") else 0
    final_norm = norm if get("do_layer_norm_before") and not get("_remove_final_layer_norm") else 0
    # OPT's learned positions keep 2 extra rows (a fairseq offset).
    embedding = s.vocab_size * p + (s.max_position_embeddings + 2) * h
    counts = _decoder_counts(s, entries, task, embedding=embedding, norms_per_layer=2 * norm,
                             final=final_norm)
    # project_in widens the embeddings, so it belongs with them, not in `final`.
    if p != h:
        counts["embedding"] += p * h
        counts["final"] -= p * h
    return counts


def _counts_llama_like(s: ModelSpec, get: _Getter, task: str, num_labels: int) -> dict[str, int]:
    h = s.hidden_size
    entries = _linears_llama_like(s, get, task, num_labels)
    return _decoder_counts(s, entries, task, embedding=s.vocab_size * h,
                           norms_per_layer=s.norms_per_layer * h, final=h)


def _counts_phi3(s: ModelSpec, get: _Getter, task: str, num_labels: int) -> dict[str, int]:
    h = s.hidden_size
    entries = _linears_phi3(s, get, task, num_labels)
    return _decoder_counts(s, entries, task, embedding=s.vocab_size * h, norms_per_layer=2 * h, final=h)


def _counts_gpt_neox(s: ModelSpec, get: _Getter, task: str, num_labels: int) -> dict[str, int]:
    h = s.hidden_size
    entries = _linears_gpt_neox(s, get, task, num_labels)
    return _decoder_counts(s, entries, task, embedding=s.vocab_size * h, norms_per_layer=2 * 2 * h,
                           final=2 * h)


_FAMILY_COUNTS = {
    "gpt2": _counts_gpt2, "bert": _counts_bert, "t5": _counts_t5, "opt": _counts_opt,
    "llama": _counts_llama_like, "mistral": _counts_llama_like, "qwen2": _counts_llama_like,
    "gemma2": _counts_llama_like, "phi3": _counts_phi3, "gpt_neox": _counts_gpt_neox,
}

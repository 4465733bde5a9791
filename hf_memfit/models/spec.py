"""Model specs: find a model's config and describe its shape without torch.

`load_model_config` turns what the user typed (a catalogue name, a Hub id, a
local directory or a config.json path) into a config dict. `ModelSpec` reads
that dict once and normalises the per-family key names (GPT-2's `n_embd`,
T5's `d_model`, OPT's `ffn_dim`, ...) into one set of fields, and counts
parameters and linear modules.

For a family with a hand-written module (`models/<family>.py`: its
transformers defaults, field normalisation and closed-form counts, checked
against transformers 5.23 meta-device builds in `tests/test_spec.py`) this
module imports neither torch nor transformers. Any other model type takes the
generic path (`generic.py`): transformers' own config class and a meta-device
build, cached on disk so that later calls need neither.
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

from hf_memfit import models
from hf_memfit.errors import MemFitError
from hf_memfit.tasks import TASKS
from hf_memfit.models._shared import Getter

CATALOGUE_DIR = Path(__file__).parent.parent / "catalogue"  # hf_memfit/catalogue: data, shipped as package data

# Connecting to the Hub must never make an offline machine wait: probe the
# endpoint with a short TCP connect first (huggingface_hub itself retries a
# failed DNS lookup for ~25 s), then give the download a short etag timeout.
_HUB_PROBE_TIMEOUT_S = 1.5
_HUB_ETAG_TIMEOUT_S = 5.0

# What is hand-written about a family lives in its module under models/; these
# views of it are kept for readers and tests.
SUPPORTED_MODEL_TYPES = models.hand_written_types()  # the types with hand-written fast formulas
_DEFAULTS = models.defaults()
_PEFT_LORA_TARGETS = models.peft_lora_targets()


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
    processor = CATALOGUE_DIR / "processors" / path.name  # its preprocessor_config.json, where the inputs need it
    if processor.is_file():
        return _with_processor(config, json.loads(processor.read_text(encoding="utf-8")))
    return config


def _with_processor(config: dict, processor: dict | None) -> dict:
    """The config carrying its processor config (`models/inputs.py` reads the input shapes from it)."""
    if isinstance(processor, dict):
        processor = {k: v for k, v in processor.items() if k != "_source"}
        config["memfit_processor"] = processor
    return config


def _local_processor(folder: Path) -> dict | None:
    path = folder / "preprocessor_config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        return None


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
            return text, _with_processor(_read_config_file(path / "config.json", text + "/config.json"),
                                         _local_processor(path))
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
    project_in/out) or "head" (lm_head / score / classifier). `packed`: bitsandbytes packs it to 4 bits under
    `load_in_4bit` (`build.bnb_packed_modules`; never the head, nor a family's `UNPACKED_4BIT`).
    """

    name: str
    in_features: int
    out_features: int
    bias: bool
    count: int
    scope: str = "layer"
    packed: bool = True

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
    # A learned position table (GPT-2, BERT, OPT) has `max_position_embeddings` rows: no sequence can be longer.
    # Rotary, ALiBi and relative positions have no such table, and models train past their configured length.
    learned_positions: bool = False
    # Each layer has a dense `mlp` that ALST's TiledMLP can compute in sequence shards (`--tiled-mlp`).
    tileable_mlp: bool = False
    # transformers builds the model with SDPA attention by default. False where it has only eager: a model
    # with no attention at all (Mamba) refuses every other implementation (`models/build.instantiate`).
    sdpa: bool = True
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
        family = models.family(model_type)
        if family is None:
            from hf_memfit.models.generic import describe  # imports transformers unless cached

            facts = describe(name, config)
            fields = dict(facts["fields"])
            fields["supported_tasks"] = tuple(fields["supported_tasks"])
            fields["layer_count_keys"] = tuple(fields["layer_count_keys"])
            return cls(name=name, model_type=model_type, config=copy.deepcopy(config), dtype=dtype,
                       generic=facts, **fields)
        get = Getter(family.DEFAULTS[model_type], family.ALIASES.get(model_type, {}), config)
        try:
            fields = family.fields(get)
        except (TypeError, ValueError, ZeroDivisionError) as exc:
            raise MemFitError(f"`model` `{name}`: its config.json has a missing or invalid size "
                              f"({exc}); pass an unmodified transformers config.json") from None
        fields.setdefault("tileable_mlp", hasattr(family.Forward, "_mlp"))  # the fast forward can tile it
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
        family = models.family(self.model_type)
        aliases = family.ALIASES.get(self.model_type, {}) if family is not None else {}
        for key in self.layer_count_keys:
            _set_path(config, key, n)
            alias = aliases.get(key)
            if alias in config:
                config[alias] = n
        _fit_layer_lists(config, n, self.num_layers)
        for holder in (config, config.get("vision_config")):
            if isinstance(holder, dict) and "stage_names" in holder:
                # a backbone's per-stage outputs (DINOv2, ...) are named by depth; only AutoBackbone reads them
                for key in ("stage_names", "out_features", "out_indices"):
                    holder.pop(key, None)
        return config

    def _getter(self) -> Getter:
        family = models.family(self.model_type)
        return Getter(family.DEFAULTS[self.model_type], family.ALIASES.get(self.model_type, {}), self.config)

    @property
    def hand_written(self) -> bool:
        """Whether the family has hand-written fast formulas (else fast mode is a parametric fit to traces)."""
        return self.generic is None

    @property
    def ssm_mixers(self) -> list[dict]:
        """The model's state-space mixer layouts (`models/ssm.py`); empty for models without them."""
        return list((self.generic or {}).get("ssm_mixers") or [])

    def ssm_kernel_problems(self, settings) -> list[str]:
        """What mamba-ssm / causal-conv1d (or sequence parallelism) refuse for this model's mixers."""
        from hf_memfit.models.ssm import kernel_problems

        return kernel_problems(self.ssm_mixers, settings, self)

    def sequence_shard_problem(self, backend: str) -> str | None:
        """Why the installed transformers / accelerate / DeepSpeed cannot split this model's sequence, else None.

        backend "ulysses": DeepSpeed's `UlyssesSPAttentionHF.register_with_transformers` reads
        `num_key_value_heads` from the text config (GPT-2, OPT, GPT-NeoX, BERT, T5 configs have no such
        attribute), its wrapper drops the attention mask (causal self-attention only: no encoder, no cross
        attention), and accelerate refuses linear-attention layer types (`_refuse_recurrent_layers_under_
        sequence_parallelism`). backend "ring": accelerate's `_attach_context_parallel_hooks` replaces the mask
        with `is_causal=True`, and refuses sliding-window or chunked layers.
        """
        text = self.config.get("text_config") if isinstance(self.config.get("text_config"), dict) else self.config
        layer_types = set(text.get("layer_types") or self.config.get("layer_types") or ())
        if self.is_encoder_decoder or self.default_task not in ("causal-lm", "image-text-to-text"):
            return f"{self.name} is not a decoder-only causal LM (sequence parallelism shards causal self-attention)"
        if backend == "ulysses":
            family = models.family(self.model_type)
            named = "num_key_value_heads" in text or (family is not None and
                                                      "num_key_value_heads" in family.DEFAULTS[self.model_type])
            if not named:
                return (f"DeepSpeed's Ulysses reads `num_key_value_heads` from the config, which {self.model_type} "
                        "configs do not have")
            recurrent = sorted(t for t in layer_types if "linear_attention" in t)
            if recurrent:
                return f"its {', '.join(recurrent)} layers carry a state along the sequence (accelerate refuses them)"
        elif backend == "ring":
            other = sorted(t for t in layer_types if t != "full_attention")
            if other or (not layer_types and self.sliding_window):
                return (f"its {', '.join(other) or 'sliding-window'} layers need a mask that context parallelism "
                        "drops (accelerate refuses them)")
        return None

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
            from hf_memfit.models.generic import task_facts

            return dict(task_facts(self.name, self.config, self.generic, task, num_labels)["counts"])
        counts = models.family(self.model_type).counts(self, self._getter(), task, num_labels)
        counts["total"] = counts["embedding"] + counts["layers"] + counts["final"] + counts["head"]
        return counts

    def freezable_modules(self, task: str | None = None, num_labels: int = 2) -> list[dict]:
        """The towers beside the trained model a plan may freeze (`models/freezable.py`): [{module, kind, params}].

        Only image, audio and VLM tasks run a tower on their inputs; the hand-written families are text models.
        """
        from hf_memfit.tasks import MEDIA_TASKS

        task = self.check_task(task)
        if self.generic is None or task not in MEDIA_TASKS:
            return []
        from hf_memfit.models.generic import task_facts

        return [dict(m) for m in task_facts(self.name, self.config, self.generic, task, num_labels).get("freezable", [])]

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
            from hf_memfit.models.generic import task_facts

            raw = task_facts(self.name, self.config, self.generic, task, num_labels)["linears"]
        else:
            family = models.family(self.model_type)
            unpacked = set(getattr(family, "UNPACKED_4BIT", ()))
            raw = [[*entry, entry[5] != "head" and entry[0] not in unpacked]
                   for entry in family.linears(self, self._getter(), task, num_labels)]
        merged: dict[tuple, int] = {}
        for name, fan_in, fan_out, bias, count, scope, packed in raw:
            if count:
                key = (name, fan_in, fan_out, bias, scope, packed)
                merged[key] = merged.get(key, 0) + count
        order = {"layer": 0, "other": 1, "head": 2}
        items = sorted(merged.items(), key=lambda kv: order[kv[0][4]])  # stable: keeps layer order
        return [LinearModule(n, i, o, b, c, s, p) for (n, i, o, b, s, p), c in items]

    def resolve_inputs(self, settings):
        """(settings with the input shape of an image / audio task filled in, problems): `models/inputs.py`."""
        from hf_memfit.models.inputs import resolve_inputs

        return resolve_inputs(self, settings)

    def default_lora_target_modules(self) -> list[str]:
        """peft's default LoRA `target_modules` for this model type.

        Mirrors peft 0.21's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.
        peft has no default for some types (phi3); like peft, this raises then.
        """
        targets = self.generic["peft_targets"] if self.generic is not None else _PEFT_LORA_TARGETS.get(self.model_type)
        if targets is None:
            names = ", ".join(dict.fromkeys(m.name for m in self.linear_modules() if m.scope == "layer"))
            raise MemFitError(f"peft has no default LoRA target modules for model type `{self.model_type}`; "
                              f"pass `--lora-target-modules all-linear` or some of: {names} (or a pattern, "
                              "`--lora-target-regex`)")
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

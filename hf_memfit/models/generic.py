"""The generic path: describe any model transformers can build, with no per-family code.

`generic_spec_fields(name, config)` asks transformers itself: its config class
fills in the defaults a published config.json leaves out, its Auto mappings
say which tasks the model builds for, and the model built on the meta device
(no memory, no weights) gives the parameter counts, the linear modules peft
can target and the repeating pattern of the layer stacks.

What this learns is stored on disk per config (`hf_memfit.cache`), so that
after the first call fast mode reads it back without importing torch or
transformers.
"""

from __future__ import annotations

import copy
from typing import Any

from hf_memfit.cache import config_key, library_version, read_cache, write_cache
from hf_memfit.errors import CannotEstimate, MemFitError
from hf_memfit.models import ssm
from hf_memfit.models.build import bnb_packed_modules, derived_attributes, hf_config, instantiate
from hf_memfit.models.layer_order import distinct, kinds, main_order, write_order
from hf_memfit.tasks import TASK_TABLE

# --------------------------------------------------------------------------
# Building the transformers config and model
# --------------------------------------------------------------------------


def supported_tasks(model_type: str) -> tuple[str, ...]:
    """Our tasks whose Auto class has a model for `model_type`, in `TASKS` order."""
    from transformers.models.auto import modeling_auto

    return tuple(task for task, info in TASK_TABLE.items()
                 if model_type in getattr(modeling_auto, info.mapping, {}))


def transformers_tasks(model_type: str) -> list[str]:
    """Every `AutoModelFor...` class the installed transformers builds for `model_type` (for error messages)."""
    from transformers.models.auto import modeling_auto

    return sorted(getattr(modeling_auto, name)[model_type] for name in dir(modeling_auto)
                  if name.startswith("MODEL_FOR_") and name.endswith("_MAPPING_NAMES")
                  and isinstance(getattr(modeling_auto, name).get(model_type), str))


def default_task(tasks: tuple[str, ...], is_encoder_decoder: bool) -> str:
    """seq2seq for encoder-decoders, else causal LM, else the first task the model builds for."""
    order = ("seq2seq", "speech-seq2seq", "causal-lm", "image-text-to-text", "seq-cls", "token-cls") \
        if is_encoder_decoder else ("causal-lm", "image-text-to-text", "seq2seq", "seq-cls", "token-cls",
                                    "image-cls", "ctc", "audio-cls", "qa", "multiple-choice")
    for task in order:
        if task in tasks:
            return task
    return tasks[0]


def meta_model(config: dict, task: str, num_labels: int = 2):
    """The task's transformers model built on the meta device: every parameter, no memory."""
    import torch

    return instantiate(config, task, num_labels, dtype=torch.float32, attn_implementation=None, meta=True)


# --------------------------------------------------------------------------
# What the meta model tells
# --------------------------------------------------------------------------


def layer_stacks(model) -> list[tuple[str, Any]]:
    """(name, ModuleList) of the outermost ModuleLists: the repeated layer stacks, found by structure."""
    import torch
    import torch.nn.utils.parametrize  # noqa: F401 - ParametrizationList

    stacks: list[tuple[str, Any]] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix, _ in stacks):
            continue
        # (a weight-norm parametrization is a ModuleList too: wav2vec2's positional convolution)
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0 and \
                not isinstance(module, torch.nn.utils.parametrize.ParametrizationList):
            stacks.append((name, module))
    return stacks


def _layer_signature(layer, layer_type: Any) -> tuple:
    shapes = tuple((n, tuple(p.shape)) for n, p in layer.named_parameters())
    classes = tuple(type(m).__name__ for m in layer.modules())
    attention = tuple(sorted({str(getattr(m, attr)) for m in layer.modules()
                              for attr in ("attention_type", "sliding_window", "is_sliding")
                              if isinstance(getattr(m, attr, None), (str, int, bool))}))
    return shapes, classes, attention, layer_type


def layer_period(stack, layer_types: list | None) -> int:
    """The smallest p with layer i shaped like layer i - p for every i (1 for a uniform stack).

    Layer 0 may differ from the rest (T5's relative-position bias), so the
    pattern is checked from layer 1 on; extrapolation traces at 2p and 3p
    layers, which keeps the first layer out of the added ones.
    """
    n = len(stack)
    sigs = [_layer_signature(layer, layer_types[i] if layer_types and i < len(layer_types) else None)
            for i, layer in enumerate(stack)]
    def same(i: int, j: int) -> bool:
        # Against layer 0 only the attention kind counts: its parameters may differ.
        return sigs[i][2:] == sigs[j][2:] if j == 0 else sigs[i] == sigs[j]

    for p in range(1, n):
        if all(same(i, i - p) for i in range(p, n)):
            return p
    return max(n, 1)


def _linear_entries(model, stack_names: list[str]) -> list[list]:
    """[name, in, out, bias, count, scope, packed] of every nn.Linear / GPT-2 Conv1D, merged by shape; `packed`:
    bitsandbytes packs it to 4 bits (`build.bnb_packed_modules`)."""
    import torch

    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers always has it
        Conv1D = ()
    prefix = getattr(model, "base_model_prefix", "") or ""
    has_base = bool(prefix) and hasattr(model, prefix) and getattr(model, prefix) is not model
    packed = {id(module) for _, module in bnb_packed_modules(model)}
    merged: dict[tuple, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            fan_in, fan_out = module.in_features, module.out_features
        elif Conv1D and isinstance(module, Conv1D):
            fan_in, fan_out = module.weight.shape
        else:
            continue
        if any(name.startswith(s + ".") for s in stack_names):
            scope = "layer"
        elif (has_base and not name.startswith(prefix + ".")) or (not has_base and "." not in name):
            scope = "head"  # lm_head, score, classifier: outside the base model (or top-level, without one)
        else:
            scope = "other"
        key = (name.rsplit(".", 1)[-1], int(fan_in), int(fan_out), module.bias is not None, scope, id(module) in packed)
        merged[key] = merged.get(key, 0) + 1
    order = {"layer": 0, "other": 1, "head": 2}
    return [[n, i, o, b, c, s, p] for (n, i, o, b, s, p), c in sorted(merged.items(), key=lambda kv: order[kv[0][4]])]


def _parameter_counts(model, stack_names: list[str], depth_stack: str, depth: int) -> dict[str, int]:
    """Parameters by where they live, each shared (tied) tensor once, as `model.parameters()` yields them."""
    import torch

    prefix = getattr(model, "base_model_prefix", "") or ""
    has_base = bool(prefix) and hasattr(model, prefix) and getattr(model, prefix) is not model
    embedding_params = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    counts = {"embedding": 0, "layers": 0, "final": 0, "head": 0}
    in_depth_stack = 0
    for name, param in model.named_parameters():  # named_parameters yields a tied tensor once
        n = param.numel()
        if any(name.startswith(s + ".") for s in stack_names):
            counts["layers"] += n
            if name.startswith(depth_stack + "."):
                in_depth_stack += n
        elif id(param) in embedding_params:
            counts["embedding"] += n
        elif has_base and not name.startswith(prefix + "."):
            counts["head"] += n
        else:
            counts["final"] += n
    counts["per_layer"] = in_depth_stack // max(depth, 1)
    counts["total"] = counts["embedding"] + counts["layers"] + counts["final"] + counts["head"]
    return counts


def _depth_paths(config: dict, hf, text) -> tuple[list[str], list[int]]:
    """Dotted config keys that set each stack's depth, and the depths."""
    nested = "text_config" if text is not hf and isinstance(config.get("text_config"), dict) else ""
    where = config.get(nested, {}) if nested else config
    attribute_map = getattr(type(text), "attribute_map", {}) or {}
    reverse = {}
    for alias, canonical in attribute_map.items():
        reverse.setdefault(canonical, alias)

    def path(*keys: str) -> str:
        for key in keys:
            for candidate in (key, reverse.get(key)):
                if candidate and candidate in where:
                    return f"{nested}.{candidate}" if nested else candidate
        return f"{nested}.{keys[0]}" if nested else keys[0]

    if getattr(hf, "is_encoder_decoder", False):
        enc = next((k for k in ("encoder_layers", "num_layers", "num_hidden_layers") if getattr(text, k, None)), None)
        dec = next((k for k in ("decoder_layers", "num_decoder_layers") if getattr(text, k, None)), None)
        if enc and dec:
            return [path(enc), path(dec)], [int(getattr(text, enc)), int(getattr(text, dec))]
    return [path("num_hidden_layers")], [int(text.num_hidden_layers)]


def _int(value: Any, default: int = 0) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else default


def _moe(text) -> dict[str, int] | None:
    """Experts per layer and experts per token, when the model routes tokens to experts."""
    experts = next((getattr(text, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if _int(getattr(text, k, None))), 0)
    top_k = _int(getattr(text, "num_experts_per_tok", None))
    if experts and top_k:
        return {"experts": int(experts), "top_k": top_k}
    return None


def describe(name: str, config: dict) -> dict:
    """Everything the spec needs about a model outside the hand-written families (cached on disk)."""
    key = config_key(config)
    cached = read_cache("specs", key)
    if cached is not None:
        return cached
    hf = hf_config(config, name)
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    model_type = hf.model_type
    tasks = supported_tasks(model_type)
    if not tasks:
        built = transformers_tasks(model_type)
        raise CannotEstimate(f"`model` `{name}` has model_type `{model_type}`, which transformers "
                             f"{library_version('transformers')} builds for none of hf-memfit's tasks "
                             f"({', '.join(TASK_TABLE)}); it builds {', '.join(built) or 'no Auto class'} for it")
    encdec = bool(getattr(hf, "is_encoder_decoder", False))
    depth_keys, depths = _depth_paths(config, hf, text)
    heads = _int(getattr(text, "num_attention_heads", None), 1)
    hidden = _int(getattr(text, "hidden_size", None))
    head_dim = _int(getattr(text, "head_dim", None)) or (hidden // heads if heads else 0)
    kv = _int(getattr(text, "num_key_value_heads", None), heads)
    tie = getattr(hf, "tie_word_embeddings", None)
    if tie is None:
        tie = getattr(text, "tie_word_embeddings", False)
    positions = getattr(text, "max_position_embeddings", None)
    sliding = getattr(text, "sliding_window", None)
    if getattr(text, "use_sliding_window", True) is False:
        sliding = None
    peft_targets = _peft_targets(model_type)
    fields = {
        "hidden_size": hidden,
        "num_layers": depths[0],
        "num_decoder_layers": depths[1] if len(depths) > 1 else 0,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "intermediate_size": _int(getattr(text, "intermediate_size", None)),
        "vocab_size": _int(getattr(text, "vocab_size", None)),
        "max_position_embeddings": _int(positions) or None,
        "tie_word_embeddings": bool(tie),
        "is_encoder_decoder": encdec,
        "default_task": default_task(tasks, encdec),
        "supported_tasks": list(tasks),
        "layer_count_keys": depth_keys,
        "hidden_act": str(getattr(text, "hidden_act", getattr(text, "hidden_activation", "")) or ""),
        "sliding_window": _int(sliding) or None,
        "embedding_dim": hidden,
    }
    facts = {"fields": fields, "moe": _moe(text), "peft_targets": peft_targets, "tasks": {}}
    facts["tasks"][_task_key(fields["default_task"], 2)] = _task_facts(config, fields["default_task"], 2, fields)
    facts["layer_period"] = facts["tasks"][_task_key(fields["default_task"], 2)].pop("layer_period")
    fields["layer_period"] = facts["layer_period"]
    fields["learned_positions"] = facts["tasks"][_task_key(fields["default_task"], 2)].pop("learned_positions")
    fields["tileable_mlp"] = facts["tasks"][_task_key(fields["default_task"], 2)].pop("tileable_mlp")
    fields["sdpa"] = facts["tasks"][_task_key(fields["default_task"], 2)].pop("sdpa")
    facts["ssm_mixers"] = facts["tasks"][_task_key(fields["default_task"], 2)].pop("ssm_mixers")
    facts["towers"] = facts["tasks"][_task_key(fields["default_task"], 2)].pop("towers")
    facts["layer_kinds"] = facts["tasks"][_task_key(fields["default_task"], 2)].pop("layer_kinds")
    write_cache("specs", key, facts)
    return facts


def _task_key(task: str, num_labels: int) -> str:
    return f"{task}|{num_labels}"


def _task_facts(config: dict, task: str, num_labels: int, fields: dict) -> dict:
    try:
        model = meta_model(config, task, num_labels)
    except MemFitError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to build is the config's, reported in one line
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise CannotEstimate(f"`model`: transformers {library_version('transformers')} could not build model_type "
                          f"`{config.get('model_type')}` for task {task} from this config "
                          f"({type(exc).__name__}: {reason}); pass an unmodified config.json") from None
    stacks = layer_stacks(model)
    names = [n for n, _ in stacks]
    depth = fields["num_layers"]
    towers = _tower_axes(config, stacks)
    # The stack whose length is the configured depth is the one the depth key sets (not a tower of that depth).
    main = next((n for n, s in stacks if len(s) == depth and n not in {t["stack"] for t in towers}),
                names[0] if names else "")
    stack = dict(stacks).get(main)
    lists = _layer_lists(model, depth)
    layer_types = kinds(lists) if lists else None  # one tuple of the lists' values per layer
    period = layer_period(stack, layer_types) if stack is not None else 1
    counts = _parameter_counts(model, names, main, depth)
    if fields["is_encoder_decoder"]:  # Whisper: one layer of each stack (layer 1; layer 0 may differ)
        for stack_name, layers in stacks:
            side = "decoder" if "decoder" in stack_name.split(".") else "encoder"
            counts.setdefault(f"per_{side}_layer", sum(p.numel() for p in layers[min(1, len(layers) - 1)].parameters()))
    from hf_memfit.models.freezable import freezable_modules

    return {
        "towers": towers,
        "freezable": freezable_modules(model, towers),  # what `plan(allow_freeze=True)` may freeze, by task
        "linears": _linear_entries(model, names),
        "counts": counts,
        "layer_period": period,
        "layer_kinds": None if fields["is_encoder_decoder"] else _settable(config, fields["layer_count_keys"][0],
                                                                            layer_kinds(stack, lists, period)),
        "learned_positions": _has_position_table(model, fields["max_position_embeddings"]),
        "tileable_mlp": bool(stack is not None and dense_mlps(stack)),
        "ssm_mixers": ssm.mixers(model),
        "sdpa": getattr(model.config, "_attn_implementation", "sdpa") == "sdpa",  # built as transformers picks
    }


# Where a sub-config (`vision_config`, `audio_config`) sets its tower's depth.
_TOWER_DEPTH_KEYS = ("depth", "num_hidden_layers", "num_layers", "encoder_layers")


def _tower_axes(config: dict, stacks: list) -> list[dict]:
    """The towers beside the language model that a sub-config sets the depth of (a VLM's vision encoder),
    each a depth axis of its own (`models/depths.py`): {stack, key, depth, period, index_key, special}.

    A stack is its sub-config's when its path names the sub-config's kind (`vision_config` -> `visual`,
    `vision_tower`, `vision_model`) and its length is the sub-config's depth. A tower whose layers come in
    two kinds by an index list in its sub-config (Qwen2.5-VL's `fullatt_block_indexes`), two or more of
    each, gets one axis per kind; a tower of one layer signature gets one axis; any other runs at its full
    depth (period = depth). So does a tower whose features are read at a layer a shallower copy would not
    have (`vision_feature_layer` deeper than -2, or a list of layers)."""
    feature_layers = [v for k, v in config.items() if "feature_layer" in k]
    readable = all(isinstance(v, int) and not isinstance(v, bool) and -2 <= v < 0 for v in feature_layers)
    found = []
    for sub, holder in config.items():
        if not isinstance(holder, dict) or not sub.endswith("_config") or sub == "text_config":
            continue
        stem = sub[:3]
        for name, stack in stacks:
            key = next((k for k in _TOWER_DEPTH_KEYS if holder.get(k) == len(stack)), None)
            if key is None or len(stack) < 2 or not any(part.startswith(stem) for part in name.split(".")):
                continue
            lists = {k: v for k, v in holder.items() if ("index" in k or "indices" in k) and isinstance(v, list)
                     and v and all(isinstance(i, int) and 0 <= i < len(stack) for i in v)}
            tower = {"stack": name, "key": f"{sub}.{key}", "depth": len(stack), "period": len(stack),
                     "index_key": None, "special": None}
            if len(lists) == 1 and readable:
                (index_key, special), = lists.items()
                if len(set(special)) >= 2 and len(stack) - len(set(special)) >= 2:
                    tower.update(period=1, index_key=index_key, special=sorted(set(special)))
            elif not lists and readable and layer_period(stack, None) == 1:
                tower["period"] = 1
            found.append(tower)
            break
    return found


def dense_mlps(layers) -> list:
    """Each layer's `mlp` child that ALST's TiledMLP can shard over the sequence: a dense MLP, not a
    mixture of experts (a router's block routes tokens across experts and returns its logits too)."""
    found = []
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and not any(hasattr(mlp, name) for name in ("experts", "router", "gate_up_proj_experts")):
            found.append(mlp)
    return found


def _has_position_table(model, positions: int | None) -> bool:
    """Whether the model looks positions up in a learned table sized by `max_position_embeddings`.

    Such a table (BERT's `position_embeddings`, OPT's `embed_positions` with its offset of 2) is a hard
    limit on the sequence length; rotary, ALiBi and NoPE models have none and train past the configured length.
    """
    import torch

    if not positions:
        return False
    tokens = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return any(isinstance(m, torch.nn.Embedding) and m is not tokens and positions <= m.num_embeddings <= positions + 2
               for m in model.modules())


def _layer_lists(model, depth: int) -> dict[str, list]:
    """The per-layer config lists of the main stack (`layer_types`, SmolLM3's `no_rope_layers`, ...), by key."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    if text is None or depth <= 1:
        return {}
    # Lists the config derives from a pattern (Jamba's `layers_block_type` from a period and an offset) are
    # properties of its class, not in vars(); `build.hf_config` takes them as given where a traced copy sets them.
    derived = {}
    for name in derived_attributes(type(text)):
        try:
            derived[name] = getattr(text, name)
        except Exception:  # noqa: BLE001 - a property this config cannot answer is no per-layer list
            continue
    return {key: list(value) for key, value in {**vars(text), **derived}.items()
            if isinstance(value, (list, tuple)) and len(value) == depth and "token" not in key
            and all(isinstance(v, (str, int, bool)) for v in value)}


def _settable(config: dict, depth_key: str, lists: dict[str, list] | None) -> dict[str, list] | None:
    """`lists` where the config builds a stack of another order from them as given; None where it derives
    them (from a pattern) instead, which would trace other kinds than the copy asks for. Checked on the base
    order a trace by kinds uses (`layer_order.main_order`), in the holder of the depth key."""
    if not lists:
        return None
    per_layer = kinds(lists)
    order = main_order(per_layer, {kind: 2 for kind in distinct(per_layer)})
    trial = copy.deepcopy(config)
    holder = write_order(trial, depth_key, lists, order)
    holder[depth_key.rsplit(".", 1)[-1]] = len(order)
    try:
        built = hf_config(trial)
    except MemFitError:
        return None
    text = built.get_text_config() if hasattr(built, "get_text_config") else built
    return lists if all(list(getattr(text, name, ())) == holder[name] for name in lists) else None


def layer_kinds(stack, lists: dict[str, list], period: int) -> dict[str, list] | None:
    """The main stack's per-layer config lists, where they set its layers' kinds and tracing by kinds is shorter
    than tracing by periods (`models/depths.py`): two layers of each kind against two periods. Gemma-3's 5 sliding
    : 1 global pattern is 4 layers by kinds and 12 by periods.

    None where the stack repeats with a period under 3 (Gemma-2: 4 layers either way), where a kind has fewer than
    two layers, or where the lists do not decide a layer's shape: layers of one kind (from layer 1 on; against
    layer 0 only the attention counts, as in `layer_period`) must have one signature.
    """
    if stack is None or not lists or period < 3:
        return None
    per_layer = kinds(lists)
    counts = {kind: per_layer.count(kind) for kind in per_layer}
    if not 2 <= len(counts) < period or min(counts.values()) < 2:
        return None
    signatures: dict[tuple, tuple] = {}
    for i in list(range(1, len(stack))) + [0]:
        signature = _layer_signature(stack[i], per_layer[i])
        seen = signatures.setdefault(per_layer[i], signature)
        if (seen[2:] if i == 0 else seen) != (signature[2:] if i == 0 else signature):
            return None
    return lists


def task_facts(name: str, config: dict, facts: dict, task: str, num_labels: int) -> dict:
    """Linear modules and parameter counts for one task (meta-built once, then cached with the spec)."""
    key = _task_key(task, num_labels)
    if key not in facts["tasks"]:
        found = _task_facts(config, task, num_labels, facts["fields"])
        found.pop("layer_period", None)
        found.pop("towers", None)
        found.pop("layer_kinds", None)
        found.pop("learned_positions", None)
        found.pop("tileable_mlp", None)
        found.pop("sdpa", None)
        facts["tasks"][key] = found
        write_cache("specs", config_key(config), facts)
    return facts["tasks"][key]


def _peft_targets(model_type: str) -> list[str] | None:
    """peft's own default LoRA target modules for the model type (None: peft has none and asks for them)."""
    mapping = _peft_lora_mapping_from_source()
    if mapping is None:
        import logging

        previous = logging.root.manager.disable
        logging.disable(logging.WARNING)  # importing peft loads torchao and bitsandbytes, which log their kernels
        try:
            from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping
        except ImportError:
            return None
        finally:
            logging.disable(previous)
    targets = mapping.get(model_type)
    return list(targets) if targets else None


def _peft_lora_mapping_from_source() -> dict | None:
    """The installed peft's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, read from its source without
    importing peft: `import peft` loads transformers' quantizers, bitsandbytes and torchao (3.4 s of a cold
    plan for a dict literal). None where the source is not there or the mapping is not a literal any more,
    and the caller imports peft instead."""
    import ast
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec("peft")
        path = os.path.join(spec.submodule_search_locations[0], "utils", "constants.py")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TRANSFORMERS_MODELS_TO_LORA_TARGET_"
                                                    "MODULES_MAPPING" for t in node.targets):
                return ast.literal_eval(node.value)
    except (ImportError, AttributeError, TypeError, OSError, SyntaxError, ValueError):
        return None
    return None


def moe_note(moe: dict, settings) -> str:
    """What the estimate assumes about routing, for a mixture-of-experts model."""
    rows = settings.batch_size * settings.seq_len * moe["top_k"]
    return (f"mixture of experts ({moe['experts']} experts, top-{moe['top_k']}): experts run through transformers' "
            f"default grouped_mm, whose buffers hold every token-expert pair ({rows} rows per layer here) whatever "
            "the routing; the estimate is exact for the traced tokens and is also the worst case for any routing, "
            "balanced or not")

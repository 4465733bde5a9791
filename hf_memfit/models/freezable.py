"""The towers a plan may freeze beside the model it trains (`plan(allow_freeze=True)`), found by structure.

Two kinds, each one that transformers itself or the models' usual recipes freeze:

- **transformers' own freeze hook**: a module whose class defines `_freeze_parameters`, which the model's
  `freeze_feature_encoder()` (wav2vec2, HuBERT, WavLM, data2vec-audio, SEW, UniSpeech: the convolutional
  feature encoder on raw samples) or `freeze_encoder()` (Whisper's encoder, Qwen2-Audio's audio tower) calls.
  The hook also stops the input gradient (`_requires_grad = False`), so nothing of its backward runs.
- **a VLM's vision tower** (or any tower a sub-config other than `text_config` sets the depth of):
  the stack `generic._tower_axes` finds by its sub-config, frozen from the module its path enters the
  tower at (`model.vision_tower`, `model.visual`, `model.vision_model`), as
  `model.vision_tower.requires_grad_(False)` does in LLaVA's recipes. A projector outside that module
  (LLaVA's `multi_modal_projector`) stays trained; one inside it (Qwen2-VL's `visual.merger`) is frozen with it.

What is never offered: a module holding half the model's parameters or more (Whisper's encoder under
`WhisperForAudioClassification` is the whole model but its head: freezing it is linear probing, another
training), and anything the language model or the task head lives in. A tower runs on the inputs only for
image, audio and VLM tasks, so only those get candidates (a text-only run of a VLM never runs its tower:
its parameters get no gradients and no optimizer state, and freezing it would save nothing).
"""

from __future__ import annotations

# A tower holding at least this share of the model's parameters is the model, not a tower beside it.
MAX_FROZEN_SHARE = 0.5


def freezable_modules(model, towers: list[dict]) -> list[dict]:
    """[{module, kind, params}] for the meta-built `model`: outermost first, none inside another."""
    import torch

    modules = dict(model.named_modules())
    total = sum(p.numel() for p in model.parameters()) or 1
    hooks = _freeze_methods(model)
    found: dict[str, str] = {}
    for name, module in modules.items():
        if name and callable(getattr(type(module), "_freeze_parameters", None)):
            how = " or ".join(f"`{method}()`" for method in hooks) or "its `_freeze_parameters` hook"
            found.setdefault(name, f"the {type(module).__name__}, what the model's {how} freezes")
    for tower in towers:
        stem = tower["key"].split(".", 1)[0][:3]  # `vision_config.depth` -> the path part named `vis...`
        parts = tower["stack"].split(".")
        entry = next((i for i, part in enumerate(parts) if part.startswith(stem)), None)
        if entry is not None:
            kind = tower["key"].split(".", 1)[0].removesuffix("_config").replace("_", " ")
            found.setdefault(".".join(parts[:entry + 1]), f"the {kind} tower")
    picked = []
    for name in sorted(found, key=lambda n: n.count(".")):
        if name not in modules or any(name.startswith(outer["module"] + ".") for outer in picked):
            continue
        params = sum(p.numel() for p in modules[name].parameters())
        if params and params < MAX_FROZEN_SHARE * total:
            # the speed model times a frozen tower's linear layers as forward only (`planner/speed.py`)
            linear = sum(m.weight.numel() for m in modules[name].modules() if isinstance(m, torch.nn.Linear))
            picked.append({"module": name, "kind": found[name], "params": int(params), "linear_params": int(linear)})
    return picked


def _freeze_methods(model) -> list[str]:
    """The model's `freeze_*` methods that call a `_freeze_parameters` hook (`freeze_feature_encoder`, ...)."""
    import inspect

    names = []
    for name in dir(type(model)):
        method = getattr(type(model), name, None)
        if name.startswith("freeze_") and callable(method):
            try:
                if "_freeze_parameters" in inspect.getsource(method):
                    names.append(name)
            except (OSError, TypeError):  # no source to read (a compiled or dynamically made method)
                continue
    return names

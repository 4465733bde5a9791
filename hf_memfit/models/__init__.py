"""Hand-written knowledge of model families: one module per family, nothing about a family elsewhere.

A family module (`models/<family>.py`) holds everything hf-memfit knows by hand
about its model types: `MODEL_TYPES`, the transformers config `DEFAULTS` (a
published config.json leaves out every key equal to its default), `ALIASES`,
peft's `PEFT_LORA_TARGETS`, `fields(get)` (the `ModelSpec` fields), `linears`
and `counts` (the linear modules and parameter counts in closed form), and
`Forward`, the symbolic forward fast mode runs (written in `forward.py`, run by `estimator/fast.py`). Optional:
`embedding_tables(spec)`, `EAGER_ATTENTION_ONLY`, `USES_KV_CACHE`, `CONV1D_BODY`.

Adding a family is adding one module here: every module in this package whose
name does not start with "_" is a family module, except the three that serve
them all: `spec.py` (config -> `ModelSpec`), `build.py` (the transformers model for a config), `forward.py` (the symbolic ops a
family's `Forward` is written in), `generic.py`, and `inputs.py` / `vision_language.py` (a task's inputs from the
config and the processor config). A model type no module
claims takes the generic path (`generic.py`): exact mode traces it, and fast
mode is fitted to a few exact traces (`estimator/parametric.py`).

Nothing here imports torch or transformers.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache
from types import ModuleType


# The modules here that are not families (see above).
_SHARED_MODULES = ("build", "depths", "forward", "freezable", "generic", "inputs", "int8_linear", "layer_order", "spec",
                   "ssm", "tiling", "vision_language")


@lru_cache(maxsize=1)
def family_modules() -> tuple[ModuleType, ...]:
    """Every family module in this package, by name."""
    names = sorted(info.name for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_")
                   and info.name not in _SHARED_MODULES)
    return tuple(importlib.import_module(f"{__name__}.{name}") for name in names)


@lru_cache(maxsize=1)
def _registry() -> dict[str, ModuleType]:
    registry: dict[str, ModuleType] = {}
    for module in family_modules():
        for model_type in module.MODEL_TYPES:
            if model_type in registry:
                raise RuntimeError(f"model type {model_type} is claimed by both {registry[model_type].__name__} "
                                   f"and {module.__name__}")
            registry[model_type] = module
    return registry


def family(model_type: str) -> ModuleType | None:
    """The hand-written family module for `model_type`, or None (the generic path)."""
    return _registry().get(model_type)


def hand_written_types() -> tuple[str, ...]:
    """Every model type with a hand-written family module, sorted."""
    return tuple(sorted(_registry()))


def defaults() -> dict[str, dict]:
    """model type -> the transformers config defaults its family module records."""
    return {t: m.DEFAULTS[t] for t, m in _registry().items()}


def peft_lora_targets() -> dict[str, list[str]]:
    """model type -> peft's default LoRA targets, where peft has them."""
    return {t: m.PEFT_LORA_TARGETS[t] for t, m in _registry().items() if t in m.PEFT_LORA_TARGETS}

"""Hand-written knowledge of model families: one module per family, nothing about a family elsewhere.

A family module (`models/<family>.py`) holds everything hf-memfit knows by hand
about its model types: `MODEL_TYPES`, the transformers config `DEFAULTS` (a
published config.json leaves out every key equal to its default), `ALIASES`,
peft's `PEFT_LORA_TARGETS`, `fields(get)` (the `ModelSpec` fields), `linears`
and `counts` (the linear modules and parameter counts in closed form), and
`Forward`, the symbolic forward fast mode runs (`formulas.py`). Optional:
`embedding_tables(spec)`, `EAGER_ATTENTION_ONLY`, `USES_KV_CACHE`, `CONV1D_BODY`.

Adding a family is adding one module here and its name to `_MODULES`. A model
type no module claims takes the generic path (`generic.py`): exact mode traces
it, and fast mode is calibrated from exact traces (`calibrated.py`).

Nothing here imports torch or transformers.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from types import ModuleType

_MODULES = ("gpt2", "bert", "t5", "opt", "llama", "gemma2", "phi3", "gpt_neox")


@lru_cache(maxsize=1)
def _registry() -> dict[str, ModuleType]:
    registry: dict[str, ModuleType] = {}
    for name in _MODULES:
        module = importlib.import_module(f"hf_memfit.models.{name}")
        for model_type in module.MODEL_TYPES:
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

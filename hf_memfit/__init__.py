"""hf-memfit: predict the peak memory of Hugging Face fine-tuning, offline, and fit it to a budget.

    import hf_memfit
    hf_memfit.estimate("gpt2-xl", batch_size=1, seq_len=1024)
    hf_memfit.plan("gpt2-xl", gpu_memory="12GiB", seq_len=1024, global_batch_size=64)

The layers, bottom up (docs/architecture.md draws them): the shared vocabulary
(`settings`, `hardware`, `optimizers`, `units`, `errors`, `cache`), `models`
(config -> model spec), `estimator` (step memory, fast or exact, sharded),
`planner` (the fastest settings that fit, and their configs), `report`, and
the two faces: `integrations` (the trainers) and `cli`.

The estimator and planner import no torch (fast mode stays fast); the
trainer classes, which need transformers and torch, load on first use.
"""

from hf_memfit import _moved
from hf_memfit.errors import MemFitError
from hf_memfit.estimator import MemoryEstimate, estimate
from hf_memfit.models.spec import ModelSpec, resolve_model
from hf_memfit.planner import Plan, PlanResult, plan
from hf_memfit.settings import TrainSettings

__version__ = "0.1.0"

# The trainer classes need transformers and torch, the TRL ones TRL (`pip install hf-memfit[trl]`):
# they load on first use, so `import hf_memfit` works without them.
_LAZY = {"MemFitArguments": "hf_memfit.integrations.args", "MemFitTrainer": "hf_memfit.integrations.trainer",
         "MemFitMixin": "hf_memfit.integrations.mixin", "MemFitSeq2SeqTrainer": "hf_memfit.integrations.trainer",
         "MemFitSeq2SeqTrainingArguments": "hf_memfit.integrations.trainer",
         "MemFitSFTConfig": "hf_memfit.integrations.trl", "MemFitSFTTrainer": "hf_memfit.integrations.trl",
         "MemFitDPOConfig": "hf_memfit.integrations.trl", "MemFitDPOTrainer": "hf_memfit.integrations.trl",
         "apply_tiled_mlp": "hf_memfit.integrations.tiled"}

__all__ = ["MemFitArguments", "MemFitDPOConfig", "MemFitDPOTrainer", "MemFitError", "MemFitMixin", "MemFitSFTConfig",
           "MemFitSFTTrainer", "MemFitSeq2SeqTrainer", "MemFitSeq2SeqTrainingArguments", "MemFitTrainer",
           "MemoryEstimate", "ModelSpec", "Plan", "PlanResult", "TrainSettings", "apply_tiled_mlp", "estimate", "plan",
           "resolve_model"]

_moved.install()


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_memfit' has no attribute {name!r}")

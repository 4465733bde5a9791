"""hf-memfit: predict the peak memory of Hugging Face fine-tuning, offline, and fit it to a budget.

    import hf_memfit
    hf_memfit.estimate("gpt2-xl", batch_size=1, seq_len=1024)
    hf_memfit.plan("gpt2-xl", gpu_memory="12GiB", seq_len=1024, global_batch_size=64)

Imports are lazy so that `hf-memfit estimate` (fast mode) never loads torch.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "estimate": "hf_memfit.estimate",
    "MemoryEstimate": "hf_memfit.estimate",
    "TrainSettings": "hf_memfit.settings",
    "resolve_model": "hf_memfit.spec",
    "ModelSpec": "hf_memfit.spec",
    "MemFitError": "hf_memfit.errors",
    "plan": "hf_memfit.plan",
    "Plan": "hf_memfit.plan",
    "MemFitArguments": "hf_memfit.args",
    "MemFitTrainer": "hf_memfit.trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hf_memfit' has no attribute {name!r}")

"""Step memory: what one training step holds at its peak, in fast mode (formulas) or exact mode (a traced step).

Bottom up: `breakdown` (the currency: peak candidates by region and category), `fast` (closed form, no torch)
and `parametric` (families with no hand-written formulas) or `trace` (the real step on fake tensors, run by
`step`), then `sharding` (ZeRO, FSDP, DDP), `cuda_overhead` (what a GPU adds) and `assemble` (the estimate).
`measure` runs the same step on real CPU tensors under the profiler; `timeline` traces one step for `explain`.
"""

from hf_memfit.estimator.assemble import MemoryEstimate, estimate, estimate_settings

__all__ = ["MemoryEstimate", "estimate", "estimate_settings"]

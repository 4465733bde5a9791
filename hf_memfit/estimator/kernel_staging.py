"""Blocks a CUDA kernel takes from the caching allocator and gives back inside one op, which a trace on fake
tensors never sees. Today one kind: the partial sums CUDA's reduction stages when it splits one output's inputs
over several CTAs (`reduction_staging.py`), which a bias gradient's `grad.sum(0)` does in every biased linear's
backward (BERT-base at 32 x 512 tokens: 132 MiB on an H200).

A run replayed through the allocator simulator (`run_of_shapes.py`) gets these blocks in its event stream, where
the GPU's SMs are known. The estimate does not: exact mode's 2-3-layer traces and fast mode's formulas share one
slack model and agree with each other, and a block whose size is piecewise in the rows would need a term of its
own in the fitted modes (docs/benchmarks.md section 19) to keep them agreeing.
"""

from __future__ import annotations

import torch

from hf_memfit.estimator.reduction_staging import sum_staging_requests

# The ops whose CUDA kernels run `gpu_reduce_kernel` on a sum. Autograd's `sum_to_size` (a broadcast bias's
# gradient) dispatches `sum.dim_IntList`.
_SUMS = (torch.ops.aten.sum.dim_IntList, torch.ops.aten.sum.default)


def reduction_staging(gpu):
    """A `StorageTracker.after_op` adding each CUDA sum's staged blocks, for `gpu`; None where its SM count or
    threads per SM are not known (an unnamed GPU), which then leaves the blocks out."""
    if gpu is None or not gpu.sm_count or not gpu.max_threads_per_sm:
        return None

    def after_op(tracker, func, args, kwargs) -> None:
        if func not in _SUMS:
            return
        x = args[0]
        # `sum_staging_requests` re-states the kernel's choices for a contiguous input; a strided one's
        # coalescing differs, and is left out (autograd's bias gradients are contiguous).
        if not x.dtype.is_floating_point or not x.is_contiguous():
            return
        dims = args[1] if len(args) > 1 else (kwargs or {}).get("dim")
        held, launches = sum_staging_requests(tuple(x.shape), list(dims or ()), x.element_size(), gpu.sm_count,
                                              gpu.max_threads_per_sm)
        if launches or held:
            tracker.transient(launches, held=held)

    return after_op

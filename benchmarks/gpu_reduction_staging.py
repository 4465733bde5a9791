"""How much CUDA's reduction stages in global memory for a bias gradient's `grad.sum(0)` (run on a GPU).

Section 19 found a 96 MiB block in BERT's backward that no CPU trace has: the partial sums and semaphores that
`aten/src/ATen/native/cuda/Reduce.cuh` allocates through the caching allocator when one output's reduction is
split over several CTAs (`ReduceConfig::global_memory_size`, `semaphore_size`). This measures that block for the
shapes biased linears make, rows (tokens) x outputs (features), in bf16 and fp32: the peak allocated during the
sum less the input and the output. The rows are what a model of the block (section 21: the one-step replay is
under on biased models by 130-394 MiB) would be checked against.

    python benchmarks/gpu_reduction_staging.py --json staging.json
"""

from __future__ import annotations

import argparse
import json

ROWS = (256, 1024, 4096, 8192, 16384, 32768, 65536)
OUTPUTS = (768, 1024, 3072, 4096, 8192)


def staged_bytes(torch, rows: int, outputs: int, dtype) -> int:
    grad = torch.randn(rows, outputs, device="cuda", dtype=dtype)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = grad.sum(0)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    # the output as the allocator counts it: its request rounded up to a 512-byte block (an 8-element bf16 output
    # would otherwise read as 496 B of staging)
    staged = peak - before - -(-out.untyped_storage().nbytes() // 512) * 512
    del grad, out
    return staged


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for outputs in OUTPUTS:
            for n in ROWS:
                rows.append({"dtype": str(dtype).removeprefix("torch."), "rows": n, "outputs": outputs,
                             "staged_bytes": staged_bytes(torch, n, outputs, dtype)})
                print(rows[-1], flush=True)
    json.dump({"gpu": props.name, "multi_processor_count": props.multi_processor_count,
               "max_threads_per_multi_processor": props.max_threads_per_multi_processor,
               "torch": torch.__version__, "rows": rows}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()

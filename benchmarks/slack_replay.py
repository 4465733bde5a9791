"""The allocator's slack on the GPU rows: measured, against the formula and a full-depth replay through the simulator.

Every GPU row of `benchmarks/results/gpu_*/rows.json` measured `max_memory_reserved` and `max_memory_allocated`
on a card with room to spare. Their difference is the caching allocator's slack on that card. Two predictions
of it, per row:
- the formula both estimator modes add (`cuda_overhead.allocator_slack_bytes`: 0.25 x the activations and
  temporaries at the peak), sized for the *needed* slack (the smallest capacity the step runs in);
- `benchmarks/allocator.py`'s replay: the row's step traced at full depth on fake CUDA tensors, after a full first
  step, and replayed through `CachingAllocatorSimulator`. Its *free gap* (reserved - allocated with no capacity
  limit) is what a roomy card shows, and its *needed gap* what decides a fit.

    PYTHONPATH=$PWD python benchmarks/slack_replay.py   # ~2 min; -> results/slack_replay.json

Rows whose model was a config made on the GPU machine are rebuilt as `gpu_results.row_spec` does. Quantized
(4- or 8-bit) rows are left out: their weights are bitsandbytes' packed tensors, which the full-depth trace
here does not build.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_MEMFIT_CACHE", tempfile.mkdtemp(prefix="hf_memfit_slack_"))
warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).parent))

import allocator  # noqa: E402 - its measure()
import gpu_results  # noqa: E402 - its row_spec()

GiB = 2**30
HERE = Path(__file__).parent
RESULTS = HERE / "results" / "slack_replay.json"
SOURCES = ["gpu_h100/rows.json", "gpu_h200_2/rows.json", "gpu_h200_6/rows.json"]
_NOT_SETTINGS = ("mode", "device", "num_labels", "optim_args")


def main() -> int:
    from hf_memfit.estimator.cuda_overhead import allocator_slack_bytes

    out = []
    for source in SOURCES:
        for row in json.loads((HERE / "results" / source).read_text()):
            settings = {k: v for k, v in row["settings"].items() if v is not None and k not in _NOT_SETTINGS}
            if settings.get("load_in_4bit") or settings.get("load_in_8bit") or settings.get("expandable_segments"):
                continue
            measured = row["measured"]
            replayed = allocator.measure(gpu_results.row_spec(row), settings)
            result = {"row": row["name"], "source": source, "model": row["model"],
                      "measured_slack": measured["peak_reserved_bytes"] - measured["peak_allocated_bytes"],
                      "formula_slack": allocator_slack_bytes(replayed["transient"]),
                      "replay_free_gap": replayed["free_gap"], "replay_need_gap": replayed["need_gap"]}
            out.append(result)
            print(f"{row['name']:30s} measured {result['measured_slack'] / GiB:5.2f} GiB | formula "
                  f"{result['formula_slack'] / GiB:6.2f} | replay free {result['replay_free_gap'] / GiB:5.2f}, "
                  f"need {result['replay_need_gap'] / GiB:5.2f}", flush=True)
    for key in ("formula_slack", "replay_free_gap"):
        misses = [abs(r[key] - r["measured_slack"]) / GiB for r in out]
        print(f"{key}: |predicted - measured| median {statistics.median(misses):.2f} GiB, max {max(misses):.2f} GiB, "
              f"over {len(out)} rows")
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cold first plans of issue 18's catalogue entries: wall time and traces, lazy search as shipped.

Issue 18 asks that a cold first plan of each new catalogue entry take at most 10 s. `lazy_grid.py` times the rows
it also compares with the exhaustive search; this script times every other entry of that catalogue once, in a fresh
process with an empty cache (`HF_MEMFIT_CACHE`), and counts its traces from the progress lines ("tracing") and
its exact confirmations ("confirming").

    PYTHONPATH=$PWD python benchmarks/cold_catalogue.py               # every row -> results/cold_catalogue.json
    PYTHONPATH=$PWD python benchmarks/cold_catalogue.py jamba         # some rows, replacing theirs

Run on an otherwise idle machine, one row at a time (the Jamba row takes minutes: docs/benchmarks.md, section 18).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import lazy_grid  # noqa: E402 - the cold run it times its rows with

ROWS = {
    "dinov2-large": ["facebook/dinov2-large", "--gpu", "a100", "--global-batch-size", "32"],
    "siglip-base": ["google/siglip-base-patch16-224", "--gpu", "a100", "--global-batch-size", "32"],
    "wav2vec2-large": ["facebook/wav2vec2-large-960h-lv60-self", "--gpu", "a100", "--global-batch-size", "32",
                       "--audio-seconds", "10"],
    "hubert-large": ["facebook/hubert-large-ls960-ft", "--gpu", "a100", "--global-batch-size", "32",
                     "--audio-seconds", "10"],
    "whisper-large-v3": ["openai/whisper-large-v3", "--gpu", "a100", "--global-batch-size", "32"],
    "qwen2.5-vl-7b": ["Qwen/Qwen2.5-VL-7B-Instruct", "--gpu", "a100", "--global-batch-size", "32", "--task",
                      "image-text-to-text", "--seq-len", "512"],
    "llava-next-mistral-7b": ["llava-hf/llava-v1.6-mistral-7b-hf", "--gpu", "a100", "--global-batch-size", "32",
                              "--task", "image-text-to-text", "--seq-len", "512"],
    "mamba-2.8b": ["state-spaces/mamba-2.8b-hf", "--gpu", "a100", "--global-batch-size", "32", "--seq-len", "2048"],
    "jamba-v0.1": ["ai21labs/Jamba-v0.1", "--gpu", "h100", "--num-gpus", "8", "--global-batch-size", "32",
                   "--seq-len", "2048"],
}
RESULTS = Path(__file__).parent / "results" / "cold_catalogue.json"


def run(args: list[str]) -> dict:
    """One cold plan as shipped (`lazy_grid.run`, which gives it an empty cache of its own)."""
    load = os.getloadavg()[0]
    done = lazy_grid.run(args, lazy=True)
    row = {"command": "hf-memfit plan " + " ".join(args), "load_before": round(load, 2),
           **{k: done[k] for k in ("wall_s", "rc", "traces", "exact_confirmations")}}
    if done["rc"] == 0:
        row["plan"] = {k: done["answer"]["plan"].get(k) for k in ("per_device_train_batch_size",
                                                                   "gradient_accumulation_steps",
                                                                   "gradient_checkpointing", "optim", "zero_stage")}
    else:
        row["error"] = done["answer"]["error"]
    return row


def main(names: list[str]) -> int:
    unknown = [name for name in names if name not in ROWS]
    if unknown:
        print(f"cold_catalogue.py: unknown row(s) {', '.join(unknown)}; the rows are: {', '.join(ROWS)}",
              file=sys.stderr)
        return 2
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for name in names or list(ROWS):
        results[name] = run(ROWS[name])
        row = results[name]
        print(f"{name:24s} {row['wall_s']:7.1f} s  {row['traces']:4d} traces  {row['exact_confirmations']} exact "
              f"confirmation(s)  rc {row['rc']}  (load {row['load_before']})", flush=True)
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Pinned host bytes of offloaded activations, fast mode against exact mode (known problem 9, docs/benchmarks.md).

Offloaded checkpoints (`--offload-activations`) and TRL's activation offloading (`--activation-offloading`) copy
tensors to pinned host memory, rounded up per tensor by CUDA's host allocator. The fitted fast modes (batch fits
for image / audio / VLM steps, parametric fits for generic families) must give exact mode's host bytes at shapes
they did not trace. Each row estimates one step in both modes (fresh cache) and prints both host figures and both
device peaks.

    PYTHONPATH=$PWD python benchmarks/pinned_host.py [--json benchmarks/results/pinned_host.json] [--real]

`--real` adds catalogue models at full size (Qwen3-8B-Base and LLaVA-1.5-7B; a few minutes). On a tree before the
fix, the same command shows the old fits' misses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["HF_MEMFIT_CACHE"] = tempfile.mkdtemp(prefix="hf_memfit_pinned_host_")  # every fit made afresh
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the suite's tiny configs

from test_vlm import LLAVA  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from hf_memfit.estimator.assemble import estimate_settings  # noqa: E402
from hf_memfit.models.spec import ModelSpec, resolve_model  # noqa: E402
from hf_memfit.settings import TrainSettings  # noqa: E402

TINY_QWEN3 = dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=32, vocab_size=512)
CHECKPOINTS = dict(gradient_checkpointing=True, offload_activations=True)
TRL = dict(trainer="sft", activation_offloading=True)


def rows(real: bool):
    llava = ModelSpec.from_config("tiny-llava", AutoConfig.for_model(**LLAVA).to_dict())
    qwen = ModelSpec.from_config("tiny-qwen3", AutoConfig.for_model(**TINY_QWEN3).to_dict())
    vlm = dict(task="image-text-to-text", seq_len=32)
    for b, acc in ((1, 1), (3, 2), (5, 1), (8, 1), (11, 1)):
        yield llava, "offloaded checkpoints", dict(vlm, **CHECKPOINTS), b, acc
    for seq, shapes in ((96, ((1, 1), (3, 2), (5, 1))), (1000, ((1, 1), (2, 1), (7, 1)))):
        for b, acc in shapes:
            yield qwen, "offloaded checkpoints", dict(seq_len=seq, **CHECKPOINTS), b, acc
    for spec, extra in ((qwen, dict(seq_len=200)), (llava, vlm)):
        for checkpointing in (True, False):
            for b, acc in ((1, 1), (3, 2), (5, 1)):
                yield (spec, f"TRL offloading, checkpointing {'on' if checkpointing else 'off'}",
                       dict(extra, gradient_checkpointing=checkpointing, **TRL), b, acc)
    if real:
        qwen8b = resolve_model("Qwen/Qwen3-8B-Base")
        for b in (1, 3, 5):
            yield qwen8b, "offloaded checkpoints", dict(seq_len=2048, **CHECKPOINTS), b, 1
        llava7b = resolve_model("llava-hf/llava-1.5-7b-hf")
        for b in (1, 3, 5):
            yield llava7b, "offloaded checkpoints", dict(task="image-text-to-text", seq_len=512, **CHECKPOINTS), b, 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--real", action="store_true", help="add catalogue models at full size")
    args = parser.parse_args()
    out = []
    print(f"{'model':24s} {'lever':38s} {'shape':>7s} {'fast host':>14s} {'exact host':>14s} {'host':>7s} "
          f"{'device fast vs exact':>20s}")
    for spec, lever, extra, b, acc in rows(args.real):
        settings = TrainSettings(batch_size=b, gradient_accumulation_steps=acc, device="cuda", gpu="A100",
                                 precision="bf16-mixed", **extra).validate(spec)
        fast = estimate_settings(spec, settings.replace(mode="fast"))
        exact = estimate_settings(spec, settings.replace(mode="exact"))
        host = (fast.cpu_bytes - exact.cpu_bytes) / max(exact.cpu_bytes, 1)
        device = (fast.peak_allocated_bytes - exact.peak_allocated_bytes) / exact.peak_allocated_bytes
        print(f"{spec.name:24s} {lever:38s} {f'{b}x{acc}':>7s} {fast.cpu_bytes:>14,} {exact.cpu_bytes:>14,} "
              f"{100 * host:>+6.1f}% {100 * device:>+19.2f}%", flush=True)
        out.append({"model": spec.name, "lever": lever, "batch_size": b, "gradient_accumulation_steps": acc,
                    "seq_len": extra.get("seq_len"), "fast_host_bytes": fast.cpu_bytes,
                    "exact_host_bytes": exact.cpu_bytes, "fast_peak_bytes": fast.peak_allocated_bytes,
                    "exact_peak_bytes": exact.peak_allocated_bytes})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""BERT-large on a V100: hf-memfit's device total vs the nvidia-smi figures the transformers docs published.

Source: transformers' "Methods and tools for efficient training on a single GPU" (perf_train_gpu_one.md,
v4.18-v4.27) and "Model training anatomy" (model_memory_anatomy.md): google-bert/bert-large-uncased,
AutoModelForSequenceClassification (2 labels), 512 random tokens per sample, the HF Trainer, a Tesla
V100-SXM2 16 GB, nvidia-smi "GPU memory occupied" (MiB) after `trainer.train()`, January 2022 (CUDA 11.2,
driver 460; torch 1.10 era, so eager attention, `adamw_hf` and a context loaded without lazy loading).
The same page measured the bare context with its kernels at 1343 MiB (`torch.ones((1, 1)).to("cuda")`).

    python benchmarks/v100_bert.py [--exact]

The comparison is loose in known ways (docs/benchmarks.md, section 8): the measurements predate torch's
lazy CUDA module loading, so their context is 1343 MiB where hf-memfit models today's 0.9 GiB; the Trainer's
2022 default optimizer was transformers' own AdamW (a per-tensor loop, modelled here as `adamw_torch_fused`,
which keeps no step temporaries); and nvidia-smi was read after training, not at the peak.
"""

from __future__ import annotations

import argparse
import io
import os
import warnings
from contextlib import redirect_stderr, redirect_stdout

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

MiB = 2**20
CONTEXT_MEASURED_2022 = 1343 * MiB  # the same page, after torch.ones((1, 1)).to("cuda")

# (label, settings beyond the common ones, published nvidia-smi MiB)
ROWS = [
    ("bs4 fp32", dict(batch_size=4), 14949),
    ("bs1 ga4", dict(batch_size=1, gradient_accumulation_steps=4), 8681),
    ("bs1 ga4 gc", dict(batch_size=1, gradient_accumulation_steps=4, gradient_checkpointing=True), 6775),
    ("bs4 fp16", dict(batch_size=4, precision="fp16-mixed"), 13939),
    ("bs1 ga4 gc fp16", dict(batch_size=1, gradient_accumulation_steps=4, gradient_checkpointing=True,
                             precision="fp16-mixed"), 7275),
    ("bs4 adafactor", dict(batch_size=4, optim="adafactor"), 12295),
    ("bs1 ga4 gc fp16 adafactor", dict(batch_size=1, gradient_accumulation_steps=4, gradient_checkpointing=True,
                                       precision="fp16-mixed", optim="adafactor"), 4847),
    ("bs4 bnb 8-bit Adam", dict(batch_size=4, optim="adamw_bnb_8bit"), 13085),
    ("bs1 ga4 gc fp16 bnb 8-bit Adam", dict(batch_size=1, gradient_accumulation_steps=4, gradient_checkpointing=True,
                                            precision="fp16-mixed", optim="adamw_bnb_8bit"), 5363),
]
COMMON = dict(seq_len=512, task="seq-cls", num_labels=2, attn_implementation="eager", gpu="v100",
              optim="adamw_torch_fused")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exact", action="store_true", help="also run exact mode (minutes per row)")
    args = parser.parse_args(argv)
    from hf_memfit.estimator.assemble import estimate

    modes = ("fast", "exact") if args.exact else ("fast",)
    head = "| row | published |" + "".join(f" {m} alloc | {m} nvidia-smi | {m} vs published |" for m in modes)
    print(head + " fast, 2022 context | vs published |")
    print("|---|---:|" + "---:|---:|---:|" * len(modes) + "---:|---:|")
    for label, changes, published in ROWS:
        cells = [label, f"{published} MiB"]
        fast_total = None
        for mode in modes:
            with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
                est = estimate("google-bert/bert-large-uncased", mode=mode, **{**COMMON, **changes})
            total = est.device_total_bytes
            fast_total = total if mode == "fast" else fast_total
            cells += [f"{est.peak_allocated_bytes / MiB:.0f} MiB", f"{total / MiB:.0f} MiB",
                      f"{100 * (total / MiB / published - 1):+.1f}%"]
        context_now = est.device_total_bytes - est.peak_reserved_bytes
        with_2022_context = fast_total - context_now + CONTEXT_MEASURED_2022
        cells += [f"{with_2022_context / MiB:.0f} MiB", f"{100 * (with_2022_context / MiB / published - 1):+.1f}%"]
        print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Exact- and fast-mode results of ~55 tiny configurations, to show that a change moved nothing.

A change that should not move any figure (a faster trace, a refactor) is checked by running this script on the
tree before and on the tree after, then comparing: every exact-mode peak candidate (bytes by category, region by
region), host bytes and parameter count, and with `--fast` the fast-mode totals of the families fast mode fits
by tracing (parametric and batch fits). The rows are 160-400 tokens long, past the trace's 128-token warm-up.

    PYTHONPATH=/path/to/before python benchmarks/trace_identity.py /tmp/before.json [--fast]
    PYTHONPATH=$PWD python benchmarks/trace_identity.py /tmp/after.json [--fast]
    python benchmarks/trace_identity.py --compare /tmp/before.json /tmp/after.json

~1 min for the exact rows and ~3 min more for `--fast` on 2 idle cores (docs/benchmarks.md, section 17).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["HF_MEMFIT_CACHE"] = tempfile.mkdtemp(prefix="hf_memfit_identity_")  # every fit made afresh
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the suite's tiny configs

from conftest import TINY_BERT, TINY_GENERIC, TINY_GPT2, TINY_LLAMA, TINY_T5
from test_modalities import VIT, WAV2VEC2, WHISPER
from test_modalities import config as auto_config
from test_ssm import TINY_JAMBA, TINY_MAMBA
from test_vlm import IDEFICS3, LLAVA, QWEN25VL
from transformers import AutoConfig

from hf_memfit.models.spec import ModelSpec
from hf_memfit.settings import TrainSettings

# Fast mode for these traces the model (parametric or batch fits); the rest are formulas, and the Mamba / Jamba
# torch fallback calibrates with a per-token loop (minutes).
FAST = ("qwen3-cuda", "gemma3_text-cuda", "olmo2-cpu", "qwen3_moe-cuda", "modernbert-cuda", "vit", "wav2vec2-ctc",
        "whisper", "llava", "qwen25vl", "idefics3")


def cases() -> list[tuple[str, dict, dict]]:
    found = []

    def add(name, cfg, **kw):
        found.append((name, cfg, kw))

    base = dict(batch_size=2, seq_len=256, device="cpu")
    for dev in ("cpu", "cuda"):
        d = dict(base, device=dev)
        add(f"llama-{dev}", TINY_LLAMA, **d)
        add(f"llama-ckpt-{dev}", TINY_LLAMA, **d, gradient_checkpointing=True)
        add(f"llama-acc4-{dev}", TINY_LLAMA, **d, gradient_accumulation_steps=4)
        add(f"llama-bf16-{dev}", TINY_LLAMA, **d, precision="bf16-mixed")
        add(f"llama-lora-{dev}", TINY_LLAMA, **d, lora_r=8)
        add(f"llama-qlora-{dev}", TINY_LLAMA, **d, lora_r=8, load_in_4bit=True, precision="bf16-mixed")
        add(f"gpt2-{dev}", TINY_GPT2, **d)
        add(f"gpt2-fp16-{dev}", TINY_GPT2, **d, precision="fp16-mixed", gradient_accumulation_steps=2)
        add(f"t5-{dev}", TINY_T5, **dict(d, task="seq2seq"), decoder_seq_len=200)
        add(f"bert-{dev}", TINY_BERT, **dict(d, task="seq-cls"))
        for k, cfg in TINY_GENERIC.items():
            add(f"{k}-{dev}", cfg, **dict(d, task="seq-cls" if k == "modernbert" else "causal-lm"))
    for optim in ("adamw_bnb_8bit", "adamw_torch_8bit", "galore_adamw", "galore_adamw_layerwise", "apollo_adamw",
                  "adafactor", "sgd"):
        kw = dict(base, optim=optim)
        if optim.startswith(("galore", "apollo")):
            kw["optim_target_modules"] = ("all-linear",)
        add(f"llama-{optim}", TINY_LLAMA, **kw)
    add("llama-sft", TINY_LLAMA, **base, trainer="sft")
    add("llama-dpo", TINY_LLAMA, **base, trainer="dpo", lora_r=8, reference_model="adapters")
    add("llama-dpo-model", TINY_LLAMA, **base, trainer="dpo")
    add("llama-padfree", TINY_LLAMA, **base, trainer="sft", padding_free=True)
    add("llama-liger", TINY_LLAMA, **dict(base, device="cuda"), use_liger_kernel=True, precision="bf16-mixed")
    add("llama-tiled", TINY_LLAMA, **dict(base, device="cuda", seq_len=512), tiled_mlp=True,
        gradient_checkpointing=True, precision="bf16-mixed")
    add("llama-offload-act", TINY_LLAMA, **dict(base, device="cuda"), gradient_checkpointing=True,
        offload_activations=True)
    add("llama-long", TINY_LLAMA, **dict(base, seq_len=400))
    add("vit", auto_config(**VIT), batch_size=2, seq_len=None, task="image-cls", device="cpu")
    audio = dict(batch_size=2, seq_len=None, device="cpu", audio_seconds=0.5)
    add("wav2vec2-ctc", auto_config(**WAV2VEC2), **audio, task="ctc", label_len=6)
    add("wav2vec2-cls", auto_config(**WAV2VEC2), **audio, task="audio-cls")
    add("whisper", auto_config(**WHISPER), batch_size=2, seq_len=None, task="speech-seq2seq", device="cpu",
        label_len=12)
    add("llava", LLAVA, batch_size=2, seq_len=256, task="image-text-to-text", device="cpu")
    add("mamba", TINY_MAMBA, batch_size=2, seq_len=160, device="cpu")
    add("jamba", TINY_JAMBA, batch_size=2, seq_len=200, device="cpu")
    vlm = dict(batch_size=2, seq_len=200, task="image-text-to-text", device="cpu")
    add("qwen25vl", AutoConfig.for_model(**QWEN25VL).to_dict(), **vlm, image_size=112)
    idefics3 = AutoConfig.for_model(**IDEFICS3).to_dict()
    idefics3["memfit_processor"] = {"size": {"longest_edge": 128}, "max_image_size": {"longest_edge": 64}}
    add("idefics3", idefics3, **vlm)
    add("llama-acc3-ckpt-lora-bf16-cuda", TINY_LLAMA, **dict(base, device="cuda"), gradient_accumulation_steps=3,
        gradient_checkpointing=True, lora_r=4, precision="bf16-mixed")
    return found


def run(fast: bool) -> dict:
    from hf_memfit.estimator.assemble import estimate_settings
    from hf_memfit.estimator.exact import exact_candidates

    try:  # the fast rows' traces on workers kept for the whole run, warm from row to row (where the tree has them)
        from hf_memfit.estimator.worker_pool import keep_workers
    except ImportError:
        keep_workers = contextlib.nullcontext
    with keep_workers():
        return _rows(fast, estimate_settings, exact_candidates)


def _rows(fast: bool, estimate_settings, exact_candidates) -> dict:
    out = {}
    for name, cfg, kw in cases():
        if fast and name not in FAST:
            continue
        start = time.monotonic()
        try:
            spec = ModelSpec.from_config(f"tiny-{name}", cfg)
            if fast:
                estimate = estimate_settings(spec, TrainSettings(**kw, mode="fast"))
                out[name] = {"peak": estimate.peak_allocated_bytes, "device_total": estimate.device_total_bytes}
            else:
                step = exact_candidates(spec, TrainSettings(**kw).validate(spec), extrapolate=False)
                out[name] = {"candidates": step.candidates, "host": step.host_bytes,
                             "params": [step.trainable_params, step.total_params]}
        except Exception as exc:  # noqa: BLE001 - a row that fails is a result too (compared as such)
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(f"{name}: {time.monotonic() - start:.1f} s{' ' + out[name]['error'] if 'error' in out[name] else ''}",
              flush=True)
    return out


def compare(before: dict, after: dict) -> int:
    moved = 0
    for mode in sorted(set(before) | set(after)):
        rows_a, rows_b = before.get(mode, {}), after.get(mode, {})
        for name in sorted(set(rows_a) | set(rows_b)):
            if rows_a.get(name) != rows_b.get(name):
                moved += 1
                print(f"{mode} {name}: moved\n  before {rows_a.get(name)}\n  after  {rows_b.get(name)}")
        same = sum(rows_a.get(n) == rows_b.get(n) for n in rows_a)
        print(f"{mode}: {same} of {len(set(rows_a) | set(rows_b))} rows identical")
    return 1 if moved else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="?", help="where to write this tree's results")
    parser.add_argument("--fast", action="store_true", help="also the fast-mode rows (fits made afresh)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        return compare(*(json.loads(Path(p).read_text()) for p in args.compare))
    if not args.json:
        parser.error("give the JSON path to write, or --compare BEFORE AFTER")
    result = {"exact": run(fast=False)}
    if args.fast:
        result["fast"] = run(fast=True)
    Path(args.json).write_text(json.dumps(result, indent=0, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CUDA-side sanity check: hf-memfit (device="cuda") vs published GPU measurements.

The rows of `shared/reference_measurements.csv` were measured by others on
real GPUs (the peft README, peft's method comparison, Liger-Kernel's
examples, LitGPT). This script expresses each one as `TrainSettings` where
hf-memfit can, runs fast and exact mode, and prints both next to the
published figure. None of it is a precise test: most rows leave the sequence
length open (dynamic padding), some measure something other than
`max_memory_allocated`, and the software versions differ (Dec 2022 torch
1.13 vs the torch 2.x semantics hf-memfit models). Read the notes column.

    python benchmarks/reference.py [--json PATH] [--fast-only]
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import sys
import time
import warnings
from contextlib import redirect_stderr, redirect_stdout

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

GiB, GB = 2**30, 1e9

# bigscience/T0_3B is T5 v1.1 (LM-adapted) XL; its published config.json.
T0_3B = {
    "model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_ff": 5120, "d_kv": 64,
    "d_model": 2048, "decoder_start_token_id": 0, "dropout_rate": 0.1, "eos_token_id": 1,
    "feed_forward_proj": "gated-gelu", "initializer_factor": 1.0, "is_encoder_decoder": True,
    "layer_norm_epsilon": 1e-06, "num_decoder_layers": 24, "num_heads": 32, "num_layers": 24,
    "pad_token_id": 0, "relative_attention_num_buckets": 32, "tie_word_embeddings": False, "vocab_size": 32128,
}
# bigscience/mt0-xxl is an mT5-XXL (model_type "mt5", which hf-memfit does not list). mT5 is the T5 v1.1
# architecture with a 250k vocabulary, so the same shapes are given as a "t5" config.
MT0_XXL_AS_T5 = {
    "model_type": "t5", "d_ff": 10240, "d_kv": 64, "d_model": 4096, "decoder_start_token_id": 0,
    "dropout_rate": 0.1, "eos_token_id": 1, "feed_forward_proj": "gated-gelu", "num_decoder_layers": 24,
    "num_heads": 64, "num_layers": 24, "pad_token_id": 0, "relative_attention_num_buckets": 32,
    "tie_word_embeddings": False, "vocab_size": 250112,
}
# bigscience/bloomz-7b1 is BLOOM (model_type "bloom": ALiBi, an embedding LayerNorm), which hf-memfit does
# not model. The closest family it does model is GPT-NeoX (fused query_key_value, LayerNorm, 4h GELU MLP,
# biases); the shapes below give BLOOM-7b1's parameter count (7.07 B) with tied embeddings. An approximation.
BLOOMZ_7B1_AS_NEOX = {
    "model_type": "gpt_neox", "hidden_size": 4096, "num_hidden_layers": 30, "num_attention_heads": 32,
    "intermediate_size": 16384, "vocab_size": 250880, "max_position_embeddings": 2048, "rotary_pct": 1.0,
    "tie_word_embeddings": True, "hidden_act": "gelu", "use_parallel_residual": False,
    "attention_dropout": 0.0, "hidden_dropout": 0.0,
}

PEFT_README = "peft README (Dec 2022), A100-80GB, max_memory_allocated"


def rows():
    """(label, model, settings, published bytes or None, unit text, notes)."""
    out = []
    for seq in (32, 64, 128):
        out.append((f"T0_3B full FT, b8 s{seq}", ("bigscience/T0_3B", T0_3B),
                    dict(batch_size=8, seq_len=seq, precision="fp32", optim="adamw_torch", gpu="a100"),
                    47.14, "GB", "seq len not stated (tweets, dynamic padding); labels as long as inputs here"))
    for seq in (32, 64, 128):
        out.append((f"T0_3B LoRA r8 q,v, b8 s{seq}", ("bigscience/T0_3B", T0_3B),
                    dict(batch_size=8, seq_len=seq, lora_r=8, lora_alpha=32, gpu="a100"),
                    14.4, "GB", ""))
    out.append(("T0_3B LoRA r8 + ZeRO-3 offload param+optim, b8 s64", ("bigscience/T0_3B", T0_3B),
                dict(batch_size=8, seq_len=64, lora_r=8, lora_alpha=32, zero_stage=3, offload_param="cpu",
                     offload_optimizer="cpu", gpu="a100"),
                9.8, "GB", "CPU 17.8 GB published"))
    for seq in (32, 64, 128):
        out.append((f"mt0-xxl (as t5) LoRA r8 q,v, b8 s{seq}", ("bigscience/mt0-xxl~t5", MT0_XXL_AS_T5),
                    dict(batch_size=8, seq_len=seq, lora_r=8, lora_alpha=32, gpu="a100"),
                    56.0, "GB", "mt5 given as a t5 config of the same shapes"))
    out.append(("bloomz-7b1 (~NeoX) LoRA r8 qkv, b8 s64", ("bigscience/bloomz-7b1~neox", BLOOMZ_7B1_AS_NEOX),
                dict(batch_size=8, seq_len=64, lora_r=8, lora_alpha=32, lora_target_modules=("query_key_value",),
                     gpu="a100"),
                32.0, "GB", "APPROXIMATION: BLOOM given as GPT-NeoX shapes"))
    out.append(("bloomz-7b1 (~NeoX) LoRA + ZeRO-3 offload, b8 s64", ("bigscience/bloomz-7b1~neox", BLOOMZ_7B1_AS_NEOX),
                dict(batch_size=8, seq_len=64, lora_r=8, lora_alpha=32, lora_target_modules=("query_key_value",),
                     zero_stage=3, offload_param="cpu", offload_optimizer="cpu", gpu="a100"),
                18.1, "GB", "APPROXIMATION; CPU 35 GB published"))
    out.append(("Llama-3.2-3B full, bf16, b4 s768", "meta-llama/Llama-3.2-3B",
                dict(batch_size=4, seq_len=768, precision="bf16", optim="adamw_torch", attn_implementation="sdpa",
                     gpu="l40s"),
                35516, "MiB", "published: max_memory_reserved minus init, incl. eval generation; s768 = longest batch"))
    out.append(("Llama-3.2-3B LoRA r32 q,v, bf16, b4 s768", "meta-llama/Llama-3.2-3B",
                dict(batch_size=4, seq_len=768, precision="bf16", lora_r=32, lora_alpha=64,
                     lora_target_modules=("q_proj", "v_proj"), attn_implementation="sdpa", gpu="l40s"),
                21242, "MiB", "published: max_memory_reserved minus init, as above"))
    # The same benchmark's 2026-07 rows (bf16 weights, fp32 adapters, no checkpointing), in bytes.
    out.append(("Llama-3.2-3B LoRA r64 q,v, bf16, b4 s768 (2026-07)", "meta-llama/Llama-3.2-3B",
                dict(batch_size=4, seq_len=768, precision="bf16", lora_r=64, lora_alpha=128,
                     lora_target_modules=("q_proj", "v_proj"), attn_implementation="sdpa", gpu="l40s"),
                22552772608 / 2**20, "MiB", "published: max_memory_reserved minus init (bytes), incl. eval generation"))
    out.append(("Llama-3.2-3B LoRA r10 gate,up,down, bf16, b4 s768 (2026-07)", "meta-llama/Llama-3.2-3B",
                dict(batch_size=4, seq_len=768, precision="bf16", lora_r=10, lora_alpha=20,
                     lora_target_modules=("gate_proj", "up_proj", "down_proj"), attn_implementation="sdpa",
                     gpu="l40s"),
                24698159104 / 2**20, "MiB", "published: max_memory_reserved minus init (bytes), incl. eval generation"))
    out.append(("Qwen2-7B (Qwen2.5-7B shapes) FSDP x4, gc, bf16, b32 s512", "Qwen/Qwen2.5-7B",
                dict(batch_size=32, seq_len=512, precision="bf16", gradient_checkpointing=True, fsdp="full_shard",
                     num_gpus=4, attn_implementation="sdpa", gpu="a100"),
                51154, "MiB", "FSDP2 full_shard; Qwen2.5-7B has Qwen2-7B's shapes; dynamic padding up to 512"))
    out.append(("LitGPT Llama-2-7b LoRA r8 q,v, bf16, b1 s1304", "meta-llama/Llama-2-7b-hf",
                dict(batch_size=1, seq_len=1304, precision="bf16", lora_r=8, lora_alpha=16,
                     lora_target_modules=("q_proj", "v_proj"), gpu="a100-40gb"),
                21.30, "GB", "NOT COMPARABLE: LitGPT's own model code and chunked LM-head loss, not transformers"))
    out.append(("LitGPT Llama-2-7b QLoRA nf4, b1 s1304", "meta-llama/Llama-2-7b-hf",
                dict(batch_size=1, seq_len=1304, precision="bf16", lora_r=8, lora_alpha=16, load_in_4bit=True,
                     lora_target_modules=("q_proj", "v_proj"), optim="paged_adamw_32bit", gpu="a100-40gb",
                     prepare_model_for_kbit_training=False),  # LitGPT runs no peft
                14.14, "GB", "NOT COMPARABLE (LitGPT); bnb PagedAdamW"))
    # peft's docs, Llama-2-70B with QLoRA (NF4, double quantisation, quant storage bf16, r8 a16 on all linear
    # layers), 2048 packed tokens, micro-batch 2 x accumulation 2, checkpointing, flash-attention-2, on 2 GPUs.
    qlora_70b = dict(batch_size=2, seq_len=2048, gradient_accumulation_steps=2, precision="bf16-mixed",
                     load_in_4bit=True, bnb_4bit_quant_storage="bfloat16", lora_r=8, lora_alpha=16,
                     lora_target_modules=ALL_LINEAR_LLAMA, gradient_checkpointing=True,
                     attn_implementation="flash_attention_2", num_gpus=2)
    out.append(("Llama-2-70B QLoRA + ZeRO-3 x2, b2 s2048", "meta-llama/Llama-2-70b-hf",
                dict(qlora_70b, zero_stage=3, gpu="a100-40gb"),
                36.6, "GB", "per-GPU memory as nvidia-smi shows it; GPU assumed A100-40GB", "device_total"))
    out.append(("Llama-2-70B QLoRA + FSDP x2, b2 s2048", "meta-llama/Llama-2-70b-hf",
                dict(qlora_70b, fsdp="full_shard", fsdp_version=1, gpu="a100"),
                35.6, "GB", "FSDP1 (use_orig_params false); nvidia-smi style; GPU not stated (over 24 GB)",
                "device_total"))
    out.append(("Llama-2-70B QLoRA + FSDP + CPU offload x2, b2 s2048", "meta-llama/Llama-2-70b-hf",
                dict(qlora_70b, fsdp="full_shard", fsdp_version=1, fsdp_offload=True, gpu="rtx4090"),
                19.6, "GB", "FSDP1; nvidia-smi style; 2 x 24 GB (RTX 4090 assumed); CPU RAM ~107 GB published",
                "device_total"))
    out.append(("Llama-2-70B LoRA + ZeRO-3 x8 H100, b8 s2048", "meta-llama/Llama-2-70b-hf",
                dict(batch_size=8, seq_len=2048, gradient_accumulation_steps=4, precision="bf16", lora_r=8,
                     lora_alpha=16, lora_target_modules=ALL_LINEAR_LLAMA, gradient_checkpointing=True,
                     attn_implementation="flash_attention_2", num_gpus=8, zero_stage=3, gpu="h100"),
                64, "GB", "screenshot reading (80% of 80 GB), rounded", "device_total"))
    return out


# torchao/optim/README.md: Llama-2-7B full BF16 fine-tuning with torchtune on an A100, "peak memory allocated (GB)",
# one row per AdamW implementation. The recipe's batch and sequence length are not stated, so the totals cannot be
# reproduced; the differences between rows are model states only (activations are the same run), which is what
# this table compares. The first row is the baseline.
TORCHAO_LLAMA2_7B = [("adamw_torch_fused", 51.6), ("adamw_bnb_8bit", 39.3), ("adamw_torch_8bit", 39.1),
                     ("adamw_torch_4bit", 33.2)]


def lever_deltas(fast_only: bool = False) -> list[dict]:
    """Published savings of torchao's / bitsandbytes' low-bit AdamW against fused AdamW, and hf-memfit's.

    The step is pure bf16 (weights, gradients; `precision="bf16"`), micro-batch 1 x 2048 tokens with
    checkpointing on an A100-80GB: any fixed shape gives the same state differences as long as the peak stays in
    the region where the states are live (it does: the optimizer step or the backward).
    """
    from hf_memfit.estimator.assemble import estimate_settings
    from hf_memfit.settings import TrainSettings
    from hf_memfit.models.spec import resolve_model

    spec = resolve_model("meta-llama/Llama-2-7b-hf")
    print("\n| Llama-2-7B full bf16 (torchao README, A100) | published GB | published saving | "
          "fast saving | exact saving |")
    print("|---|---:|---:|---:|---:|")
    out, base = [], {}
    for optim, published in TORCHAO_LLAMA2_7B:
        row = {"optim": optim, "published_gb": published}
        for mode in ("fast",) if fast_only else ("fast", "exact"):
            settings = TrainSettings(batch_size=1, seq_len=2048, precision="bf16", optim=optim,
                                     gradient_checkpointing=True, gpu="a100", mode=mode)
            row[mode] = _quiet(estimate_settings, spec, settings).peak_allocated_bytes
            base.setdefault(mode, row[mode])
        base.setdefault("published", published)
        saving = {k: (base[k] - row[k]) / GB for k in ("fast", "exact") if k in row}
        row.update({f"{k}_saving_gb": v for k, v in saving.items()},
                   published_saving_gb=base["published"] - published)
        out.append(row)
        print(f"| {optim} | {published} | {base['published'] - published:.1f} GB | "
              f"{saving.get('fast', 0):.1f} GB | " + (f"{saving['exact']:.1f} GB |" if "exact" in saving else "- |"),
              flush=True)
    return out

ALL_LINEAR_LLAMA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quiet(fn, *a, **k):
    sink = io.StringIO()
    with redirect_stdout(sink), redirect_stderr(sink):
        return fn(*a, **k)


def _to_bytes(value, unit):
    return value * (2**20 if unit == "MiB" else GB)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--fast-only", action="store_true")
    parser.add_argument("--only", metavar="TEXT", help="run only the rows whose label contains TEXT")
    args = parser.parse_args(argv)
    from hf_memfit.models.spec import ModelSpec, resolve_model
    from hf_memfit.settings import TrainSettings

    estimator = None
    for name in ("hf_memfit.estimator.assemble", "hf_memfit.estimate"):
        try:
            estimator = __import__(name, fromlist=["estimate_settings"])
            break
        except ImportError:
            continue

    results = []
    print("| reference row | published | fast alloc | fast reserved | fast nvidia-smi | exact alloc | "
          "exact reserved | exact nvidia-smi | vs published | notes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for label, model, kw, published, unit, notes, *metric in rows():
        if args.only and args.only not in label:
            continue
        if isinstance(model, tuple):
            spec = ModelSpec.from_config(model[0], copy.deepcopy(model[1]))
        else:
            spec = resolve_model(model)
        row = {"label": label, "model": spec.name, "settings": kw, "published": published, "unit": unit,
               "notes": notes, "metric": metric[0] if metric else None}
        for mode in ("fast",) if args.fast_only else ("fast", "exact"):
            settings = TrainSettings(mode=mode, device="cuda", **kw)
            t0 = time.perf_counter()
            try:
                est = _quiet(estimator.estimate_settings, spec, settings)
            except Exception as exc:  # noqa: BLE001
                row[f"{mode}_error"] = f"{type(exc).__name__}: {exc}"[:200]
                continue
            row[mode] = {"allocated": est.peak_allocated_bytes, "reserved": est.peak_reserved_bytes,
                         "device_total": est.device_total_bytes, "cpu": est.cpu_bytes,
                         "total_params": est.total_params, "trainable_params": est.trainable_params,
                         "region": est.peak_region, "seconds": time.perf_counter() - t0}
        results.append(row)

        def fmt(mode, key):
            if mode not in row:
                return "error" if f"{mode}_error" in row else "-"
            value = row[mode][key]
            return f"{value / GB:.2f} GB" if unit == "GB" else f"{value / 2**20:.0f} MiB"

        ref = _to_bytes(published, unit)
        basis = metric[0] if metric else "reserved" if unit == "MiB" and "reserved" in notes else "allocated"
        # Against the published figure: exact mode where it ran, else fast mode (named).
        scored = "exact" if "exact" in row else "fast" if "fast" in row else None
        rel = (f"{100 * (row[scored][basis] - ref) / ref:+.0f}% ({scored} {basis})" if scored else "-")
        cpu = (f"; predicted CPU {row[scored]['cpu'] / GB:.1f} GB"
               if scored and row[scored]["cpu"] >= 0.05 * GB else "")
        print(f"| {label} | {published} {unit} | {fmt('fast', 'allocated')} | {fmt('fast', 'reserved')} | "
              f"{fmt('fast', 'device_total')} | {fmt('exact', 'allocated')} | {fmt('exact', 'reserved')} | "
              f"{fmt('exact', 'device_total')} | {rel} | {notes}{cpu} |", flush=True)
        for mode in ("fast", "exact"):
            if f"{mode}_error" in row:
                print(f"    {mode} failed: {row[mode + '_error']}")

    lever_rows = lever_deltas(args.fast_only)
    from hf_memfit.estimator import cuda_overhead
    from hf_memfit.hardware import find_gpu

    ctx = cuda_overhead.cuda_context_bytes(find_gpu("a100"))
    print(f"\nCUDA context modelled for A100-80GB: {ctx / GiB:.2f} GiB "
          "(stas00 ml-engineering: 0.47-0.92 GiB measured on A100)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": results, "lever_deltas": lever_rows, "cuda_context_bytes_a100": ctx}, f, indent=2,
                      default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Parametric fast mode (issue 20) against exact mode, for families without hand-written formulas.

Accuracy: for each generic family (the catalogue's, and configs built here for other transformers
families), a few setting groups (bf16 mixed on an H100, pure bf16 with checkpointing, 4-bit QLoRA,
LoRA on the CPU). The first row of a group pays for the group's one calibration; every row (other
lengths, micro-batches, accumulation, optimizers) is then read from that fit and compared with exact
mode at the same settings. None of the rows' shapes is a traced point (`parametric._points`).

Speed (`--timing`): `hf-memfit plan` in fresh processes with an empty cache (cold) and then at a new
sequence length and a new optimizer (warm), for Qwen3-8B-Base and Qwen3-30B-A3B; with `--before DIR`
(a checkout of the code before this change) the same runs of the old calibrated fast mode.

    python benchmarks/parametric.py [--families qwen3,mixtral] [--timing] [--before DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

K = 1024

# Catalogue models whose model_type has no hand-written formulas.
CATALOGUE = {
    "qwen3": "Qwen/Qwen3-8B-Base",
    "qwen3_moe": "Qwen/Qwen3-30B-A3B",
    "olmo2": "allenai/OLMo-2-1124-7B",
    "smollm3": "HuggingFaceTB/SmolLM3-3B",
    "modernbert": "answerdotai/ModernBERT-base",
    "gemma3": "google/gemma-3-4b-it",
    "gpt_oss": "openai/gpt-oss-20b",
}

# Other transformers families, at their published sizes (the shapes of the named checkpoints' configs).
BUILT = {
    "granite": dict(model_type="granite", hidden_size=4096, num_hidden_layers=40, num_attention_heads=32,
                    num_key_value_heads=8, intermediate_size=12800, vocab_size=49155, max_position_embeddings=131072,
                    tie_word_embeddings=True, embedding_multiplier=12.0, logits_scaling=16.0,
                    residual_multiplier=0.22, attention_multiplier=0.0078125),  # granite-3.1-8b
    "mixtral": dict(model_type="mixtral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                    vocab_size=32000, max_position_embeddings=32768),  # Mixtral-8x7B
    "starcoder2": dict(model_type="starcoder2", hidden_size=4608, num_hidden_layers=32, num_attention_heads=36,
                       num_key_value_heads=4, intermediate_size=18432, vocab_size=49152,
                       max_position_embeddings=16384, sliding_window=4096),  # starcoder2-7b
    "gemma": dict(model_type="gemma", hidden_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=16, head_dim=256, intermediate_size=24576, vocab_size=256000,
                  max_position_embeddings=8192),  # gemma-7b
    "cohere": dict(model_type="cohere", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, intermediate_size=14336, vocab_size=256000,
                   max_position_embeddings=131072, use_qk_norm=False),  # a 8B command-r-like shape
    "stablelm": dict(model_type="stablelm", hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                     num_key_value_heads=32, intermediate_size=5632, vocab_size=100352,
                     max_position_embeddings=4096, partial_rotary_factor=0.25),  # stablelm-2-1_6b
}

# Setting groups: (name, common settings, rows of (batch, seq, extra settings)). The first row calibrates.
GROUPS = [
    ("bf16-mixed H100", dict(device="cuda", gpu="H100", precision="bf16-mixed", optim="adamw_torch_fused"),
     [(1, 8 * K, {}), (16, 8 * K, {}), (4, 32 * K, {"gradient_accumulation_steps": 4}), (1, 128 * K, {}),
      (2, 16 * K, {"optim": "adamw_bnb_8bit"}), (8, 8 * K, {"optim": "adamw_torch"})]),
    ("bf16 + checkpointing", dict(device="cuda", gpu="H100", precision="bf16", gradient_checkpointing=True),
     [(1, 16 * K, {}), (16, 8 * K, {}), (2, 64 * K, {"optim": "adafactor"}), (1, 128 * K, {})]),
    ("QLoRA r16 + ckpt", dict(device="cuda", precision="bf16-mixed", load_in_4bit=True, lora_r=16,
                              gradient_checkpointing=True),
     [(1, 8 * K, {}), (8, 16 * K, {"gradient_accumulation_steps": 2}), (1, 128 * K, {})]),
    ("LoRA r8 fp32 CPU", dict(device="cpu", lora_r=8),
     [(1, 8 * K, {}), (4, 16 * K, {})]),
]


def _spec(family: str):
    from hf_memfit.models.spec import ModelSpec, resolve_model

    if family in CATALOGUE:
        return resolve_model(CATALOGUE[family])
    return ModelSpec.from_config(f"{family} (built)", BUILT[family])


def accuracy(families: list[str]) -> list[dict]:
    from hf_memfit.estimator.assemble import estimate
    from hf_memfit.estimator.parametric import _points
    from hf_memfit.settings import TrainSettings

    rows = []
    print(f"{'family':<11} {'group':<21} {'b':>3} {'seq':>7} {'extra':<28} {'fast GiB':>9} {'exact GiB':>9} "
          f"{'error':>7}  timing")
    for family in families:
        spec = _spec(family)
        assert not spec.hand_written, family
        for group, common, shapes in GROUPS:
            if "lora_r" in common and spec.default_task != "causal-lm":
                continue
            if "lora_r" in common:  # peft has no default targets for some types (granite, olmo2): name them
                common = dict(common, lora_target_modules=("all-linear",))
            limit = spec.max_position_embeddings or 1 << 30
            first = True
            for batch, seq, extra in shapes:
                if seq > limit:  # declared positions: 7/8 of the longest the model takes (the longest is traced)
                    seq = limit * 7 // 8 // 128 * 128
                settings = dict(common, batch_size=batch, seq_len=seq, **extra)
                traced = any((b, s) == (batch, seq) for b, s, _ in
                             _points(spec, TrainSettings(**settings).validate(spec)))
                started = time.perf_counter()
                fast = estimate(spec, **settings)
                fast_s = time.perf_counter() - started
                warm_s = None
                if first:  # the same call again, served by the fit just made
                    started = time.perf_counter()
                    estimate(spec, **settings)
                    warm_s = time.perf_counter() - started
                started = time.perf_counter()
                exact = estimate(spec, mode="exact", **settings)
                exact_s = time.perf_counter() - started
                error = fast.peak_allocated_bytes / exact.peak_allocated_bytes - 1
                notes = [n for n in fast.notes if "parametric" in n]
                row = {"family": family, "model": spec.name, "group": group, "batch_size": batch, "seq_len": seq,
                       "extra": extra, "fast_bytes": fast.peak_allocated_bytes,
                       "exact_bytes": exact.peak_allocated_bytes, "error": error, "fast_region": fast.peak_region,
                       "exact_region": exact.peak_region, "fast_s": fast_s, "exact_s": exact_s,
                       "calibrated": first, "warm_s": warm_s, "notes": notes, "traced_point": traced}
                rows.append(row)
                timing = (f"calibration {fast_s:.1f} s, warm {1000 * warm_s:.1f} ms" if first
                          else f"fast {1000 * fast_s:.1f} ms") + f", exact {exact_s:.1f} s"
                extra_text = ",".join(f"{k}={v}" for k, v in extra.items())
                print(f"{family:<11} {group:<21} {batch:>3} {seq:>7} {extra_text:<28} "
                      f"{fast.peak_allocated_bytes / 2**30:>9.2f} {exact.peak_allocated_bytes / 2**30:>9.2f} "
                      f"{100 * error:>+6.2f}%  {timing}" + ("  [check missed]" if any("missed" in n for n in notes)
                                                           else "") + ("  [traced point]" if traced else ""),
                      flush=True)
                first = False
    return rows


PLAN = ["--gpu", "a10g", "--global-batch-size", "32", "--load-in-4bit", "--lora-r", "16"]
PLANS = [
    ("Qwen/Qwen3-8B-Base", ["--seq-len", "2048"] + PLAN),
    # peft has no default LoRA targets for qwen3_moe: named, as a user must
    ("Qwen/Qwen3-30B-A3B", ["--seq-len", "2048", "--gpu", "h100", "--global-batch-size", "32", "--load-in-4bit",
                            "--lora-r", "16", "--lora-target-modules", "q_proj,v_proj"]),
]


#: CPU seconds (user + sys) of the last `_plan` / `_estimate` process, with the children it forked: on a
#: shared machine the wall time mostly measures the other jobs, the CPU time what the command itself did.
LAST_CPU_S = [0.0]


def _run(code_root: str, cache: str, command: str, model: str, args: list[str]) -> float:
    import resource

    env = dict(os.environ, HF_MEMFIT_CACHE=cache, PYTHONPATH=code_root)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hf_memfit.cli.main", command, model, *args], env=env, check=True,
                   capture_output=True, text=True, cwd=code_root)  # `-m` puts the working folder first on the path
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    LAST_CPU_S[0] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall


def _plan(code_root: str, cache: str, model: str, args: list[str]) -> float:
    return _run(code_root, cache, "plan", model, args)


def _breakdown(code_root: str, model: str) -> dict:
    """Where a cold process's time goes before any trace: imports, and resolving the generic spec."""
    code = ("import time, logging, warnings; warnings.filterwarnings('ignore'); logging.disable(logging.WARNING)\n"
            "t = time.perf_counter(); import hf_memfit.cli.main; a = time.perf_counter() - t\n"
            "t = time.perf_counter(); import torch; b = time.perf_counter() - t\n"
            "t = time.perf_counter(); import transformers.modeling_utils; c = time.perf_counter() - t\n"
            "t = time.perf_counter(); import peft, bitsandbytes; d = time.perf_counter() - t\n"
            "t = time.perf_counter(); import transformers.trainer; e = time.perf_counter() - t\n"
            "from hf_memfit.models.spec import resolve_model\n"
            f"t = time.perf_counter(); resolve_model({model!r}); f = time.perf_counter() - t\n"
            "print(a, b, c, d, e, f)")
    env = dict(os.environ, HF_MEMFIT_CACHE=tempfile.mkdtemp(prefix="hf_memfit_bench_"), PYTHONPATH=code_root)
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True,
                         cwd=code_root)
    names = ("import_hf_memfit_cli_s", "import_torch_s", "import_transformers_modeling_utils_s",
             "import_peft_bitsandbytes_s", "import_transformers_trainer_s", "resolve_generic_spec_s")
    return dict(zip(names, map(float, out.stdout.split()[-6:])))


# A GPU the step reads as it reads the planned one (sm80+, `parametric._gpu_key`): its plan reuses the fits.
SAME_CLASS_GPU = {"a10g": "l4", "h100": "a100-80gb"}


def _estimate(code_root: str, cache: str, model: str, args: list[str]) -> float:
    return _run(code_root, cache, "estimate", model, args)


def timing(code_root: str, label: str, warm: bool = True) -> list[dict]:
    out = []
    for model, args in PLANS:
        cache = tempfile.mkdtemp(prefix="hf_memfit_bench_")
        row = {"code": label, "model": model, "load_average_before": os.getloadavg()[0],
               "cold_plan_s": _plan(code_root, cache, model, args), "cold_plan_cpu_s": LAST_CPU_S[0]}
        if warm:
            new_seq = [a if a != "2048" else "4096" for a in args]
            row["warm_plan_new_seq_len_s"] = _plan(code_root, cache, model, new_seq)
            row["warm_plan_new_optim_s"] = _plan(code_root, cache, model, new_seq + ["--optim", "adamw_torch"])
            gpu = args[args.index("--gpu") + 1]
            other = [SAME_CLASS_GPU[gpu] if a == gpu else a for a in new_seq]
            row["warm_plan_new_gpu_same_class_s"] = _plan(code_root, cache, model, other)
            row["warm_plan_repeat_s"] = _plan(code_root, cache, model, new_seq)
            row["warm_plan_repeat_cpu_s"] = LAST_CPU_S[0]
        row["load_average_after"] = os.getloadavg()[0]
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def precision_timing(code_root: str) -> dict:
    """`estimate` at bf16-mixed (cold: one fit), then the same at fp16-mixed (the fit's other autocast dtype)."""
    cache = tempfile.mkdtemp(prefix="hf_memfit_bench_")
    args = ["--seq-len", "4096", "--batch-size", "2", "--lora-r", "16", "--gpu", "h100", "--gradient-checkpointing"]
    row = {"model": PLANS[0][0], "args": args, "load_average_before": os.getloadavg()[0],
           "cold_estimate_bf16_mixed_s": _estimate(code_root, cache, PLANS[0][0], args + ["--precision", "bf16-mixed"]),
           "warm_estimate_fp16_mixed_s": _estimate(code_root, cache, PLANS[0][0], args + ["--precision", "fp16-mixed"])}
    print(json.dumps(row), flush=True)
    return row


def repeated_timing(root: str, before: str | None, repeats: int) -> dict:
    """Cold plans of this code and (with `before`) of the old one, alternated, `repeats` times; medians."""
    runs = []
    for _ in range(repeats):
        runs += timing(root, "parametric")
        if before:
            runs += timing(before, "before", warm=False)
    medians = {}
    for code in sorted({r["code"] for r in runs}):
        for model in sorted({r["model"] for r in runs}):
            mine = [r for r in runs if r["code"] == code and r["model"] == model]
            medians[f"{code} | {model}"] = {k: statistics.median(r[k] for r in mine) for k in mine[0]
                                           if k.endswith("_s") or k.startswith("load_average")}
    breakdown = {model: _breakdown(root, model) for model, _ in PLANS}
    return {"runs": runs, "medians": medians, "cold_process_breakdown": breakdown,
            "precision": precision_timing(root)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(list(CATALOGUE) + list(BUILT)))
    parser.add_argument("--timing", action="store_true", help="also time cold and warm `hf-memfit plan`")
    parser.add_argument("--timing-only", action="store_true")
    parser.add_argument("--before", metavar="DIR", help="a checkout of the code before the change, timed too")
    parser.add_argument("--repeat", type=int, default=3, help="timing runs of each code, alternated (medians)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    os.environ["HF_MEMFIT_CACHE"] = tempfile.mkdtemp(prefix="hf_memfit_parametric_bench_")
    logging.disable(logging.WARNING)
    results = {"machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg()[0]}}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if args.timing or args.timing_only:
        results["timing"] = repeated_timing(root, args.before, args.repeat)
    if not args.timing_only:
        rows = accuracy([f for f in args.families.split(",") if f])
        results["rows"] = rows
        results["summary"] = summary(rows)
        print(json.dumps(results["summary"], indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return 0


def summary(rows: list[dict]) -> dict:
    errors = [abs(r["error"]) for r in rows]
    untraced = [abs(r["error"]) for r in rows if not r["traced_point"]]
    calibrations = [r["fast_s"] for r in rows if r["calibrated"]]
    warm = [r["fast_s"] for r in rows if not r["calibrated"]]
    return {
        "rows": len(rows), "families": len({r["family"] for r in rows}),
        "median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
        "rows_within_5pct": sum(e <= 0.05 for e in errors),
        "rows_at_a_traced_point": sum(r["traced_point"] for r in rows),
        "untraced_rows": len(untraced), "untraced_median_abs_error": statistics.median(untraced),
        "untraced_max_abs_error": max(untraced),
        "rows_with_check_note": sum(any("missed" in n for n in r["notes"]) for r in rows),
        "calibration_s_median": statistics.median(calibrations), "calibration_s_max": max(calibrations),
        "warm_estimate_ms_median": 1000 * statistics.median(warm),
    }


if __name__ == "__main__":
    sys.exit(main())

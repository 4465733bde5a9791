"""Speed of the generic path (issue 9): exact mode on a family with no hand-written code vs a known one.

Pairs of the same size, traced in exact mode in this process, alternating, the
median of `--repeats` runs each:

- Qwen2.5-7B (hand-written family `qwen2`) vs the same shapes as `qwen3`
  (the generic path: QK-norm, no qkv bias), and vs the shipped Qwen3-8B-Base;
- Llama-3.2-1B (`llama`) vs the same shapes as `olmo2` (generic).

Then the fast mode of a generic family: the first call (which fits from
exact traces and caches the result) and a cached call in a fresh interpreter
(start-up included, as the CLI would pay it; best of 3).

    python benchmarks/generic_speed.py [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

SETTINGS = dict(batch_size=1, seq_len=1024, precision="bf16-mixed", mode="exact")


def _same_shapes(base: str, model_type: str, drop=()) -> dict:
    from hf_memfit.models.spec import resolve_model

    config = copy.deepcopy(resolve_model(base).config)
    for key in drop:
        config.pop(key, None)
    config["model_type"] = model_type
    config["architectures"] = []
    return config


def _time_exact(spec) -> float:
    from hf_memfit.estimator.assemble.assemble import estimate

    started = time.perf_counter()
    estimate(spec, **SETTINGS)
    return time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    os.environ["HF_MEMFIT_CACHE"] = tempfile.mkdtemp(prefix="hf_memfit_speed_cache_")

    import logging

    logging.disable(logging.WARNING)
    from hf_memfit.models.spec import ModelSpec, resolve_model

    qwen3_like = _same_shapes("Qwen/Qwen2.5-7B", "qwen3", drop=("use_sliding_window", "sliding_window"))
    qwen3_like["head_dim"] = 128
    olmo2_like = _same_shapes("meta-llama/Llama-3.2-1B", "olmo2", drop=("rope_scaling",))
    pairs = [
        ("Qwen2.5-7B (qwen2, hand-written)", resolve_model("Qwen/Qwen2.5-7B"),
         "same shapes as qwen3 (generic)", ModelSpec.from_config("qwen3-like-7b", qwen3_like)),
        ("Qwen2.5-7B (qwen2, hand-written)", resolve_model("Qwen/Qwen2.5-7B"),
         "Qwen3-8B-Base (qwen3, generic)", resolve_model("Qwen/Qwen3-8B-Base")),
        ("Llama-3.2-1B (llama, hand-written)", resolve_model("meta-llama/Llama-3.2-1B"),
         "same shapes as olmo2 (generic)", ModelSpec.from_config("olmo2-like-1b", olmo2_like)),
    ]
    results = {"settings": SETTINGS, "pairs": []}
    print(f"# exact mode, {SETTINGS}, median of {args.repeats} (alternating)", flush=True)
    for known_name, known, generic_name, generic in pairs:
        _time_exact(known), _time_exact(generic)  # warm both (imports, the generic spec's meta build)
        known_t, generic_t = [], []
        for _ in range(args.repeats):
            known_t.append(_time_exact(known))
            generic_t.append(_time_exact(generic))
        row = {"known": known_name, "known_params": known.parameter_count()["total"],
               "known_s": statistics.median(known_t), "generic": generic_name,
               "generic_params": generic.parameter_count()["total"], "generic_s": statistics.median(generic_t)}
        results["pairs"].append(row)
        print(f"{known_name}: {row['known_s']:.2f} s ({row['known_params'] / 1e9:.2f} B params) | "
              f"{generic_name}: {row['generic_s']:.2f} s ({row['generic_params'] / 1e9:.2f} B params)", flush=True)

    config_path = os.path.join(os.environ["HF_MEMFIT_CACHE"], "qwen3-like.json")
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(qwen3_like, f)
    fast = dict(SETTINGS, mode="fast")
    code = ("import time; t = time.perf_counter(); from hf_memfit import estimate; "
            f"e = estimate({config_path!r}, **{fast!r}); print(time.perf_counter() - t); "
            "print(next((n for n in e.notes if 'parametric fit' in n), ''))")
    env = dict(os.environ)
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    first_s, first_note = first.stdout.strip().splitlines()[-2:]
    cached = []
    for _ in range(3):
        started = time.perf_counter()
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        cached.append((float(run.stdout.strip().splitlines()[-2]), time.perf_counter() - started))
    results["fast_first_call_s"] = float(first_s)
    results["fast_first_call_note"] = first_note
    results["fast_cached_call_s"] = min(c[0] for c in cached)
    results["fast_cached_process_s"] = min(c[1] for c in cached)
    print(f"fast mode, qwen3 (generic): first call {float(first_s):.1f} s ({first_note[:90]}...)")
    print(f"fast mode, cached: estimate() {results['fast_cached_call_s']:.3f} s, whole fresh process "
          f"{results['fast_cached_process_s']:.2f} s (best of 3)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

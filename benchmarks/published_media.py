"""Published GPU memory of vision, speech and VLM fine-tunes vs hf-memfit (device="cuda"), issue 18.

The rows are `benchmarks/data/published_media.csv`: each names its source (URL and date), the settings as the
source states them, what it measured (`metric`: `reserved` = torch.cuda.max_memory_reserved, `allocated` =
max_memory_allocated, `device_total` = nvidia-smi's used memory) and `hf_memfit_settings`, the same step as
`TrainSettings` keyword arguments (JSON). `status` sorts the rows:

- `counted`: every setting is stated, or bounded by the dataset (an image size no dataset image exceeds);
  these make the headline median / max.
- `approximate`: a setting had to be chosen (the row's notes say which); shown, scored, not in the headline.
- `not_expressible`: hf-memfit has no setting for the run (8-bit LLM.int8() weights, LoRA on one tower with the
  other fully trained); listed, not estimated.

Each estimated row runs fast mode and exact mode and compares the estimate's figure for the row's metric with
the published one. No constant is fitted to these rows.

    PYTHONPATH=$PWD HF_MEMFIT_CACHE=/tmp/hfm-pub python benchmarks/published_media.py \
        [--json benchmarks/results/published_media.json] [--fast-only] [--only TEXT]
"""

from __future__ import annotations

import argparse
import copy
import csv
import io
import json
import os
import statistics
import sys
import time
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

HERE = Path(__file__).resolve().parent
CSV_PATH = HERE / "data" / "published_media.csv"
UNITS = {"GiB": 2**30, "GB": 1e9, "MiB": 2**20}
METRICS = {"reserved": "peak_reserved_bytes", "allocated": "peak_allocated_bytes", "device_total": "device_total_bytes"}

# Models the catalogue does not carry, as their published config.json gives the shapes. Qwen2-VL-7B-Instruct:
# https://huggingface.co/Qwen/Qwen2-VL-7B-Instruct/blob/main/config.json (8,291,375,616 parameters, which the spec
# built from it reproduces) and its preprocessor_config.json, with max_pixels as the ms-swift scripts set it
# (MAX_PIXELS=1003520).
INLINE_CONFIGS = {
    "Qwen/Qwen2-VL-7B-Instruct": {
        "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "vocab_size": 152064, "tie_word_embeddings": False, "sliding_window": 32768, "use_sliding_window": False,
        "max_window_layers": 28, "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
        "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_token_id": 151654,
        "image_token_id": 151655, "video_token_id": 151656,
        "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                          "hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
                          "temporal_patch_size": 2},
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "torch_dtype": "bfloat16",
        "memfit_processor": {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136,
                             "max_pixels": 1003520, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2},
    },
}


def load_rows(path: Path = CSV_PATH) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def spec_for(row: dict):
    from hf_memfit.models.spec import ModelSpec, resolve_model

    name = row["hf_memfit_model"]
    if name.startswith("inline:"):
        name = name[len("inline:"):]
        return ModelSpec.from_config(name, copy.deepcopy(INLINE_CONFIGS[name]))
    return resolve_model(name)


def settings_for(row: dict, mode: str):
    """The row's `hf_memfit_settings` as TrainSettings (lists become tuples), on a CUDA device."""
    from hf_memfit.settings import TrainSettings

    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(row["hf_memfit_settings"]).items()}
    return TrainSettings(mode=mode, device="cuda", **kw)


def _quiet(fn, *a, **k):
    sink = io.StringIO()
    with redirect_stdout(sink), redirect_stderr(sink):
        return fn(*a, **k)


def run_row(row: dict, modes: tuple[str, ...]) -> dict:
    from hf_memfit.estimator.assemble import estimate_settings

    published = float(row["value"]) * UNITS[row["unit"]]
    out = {k: row[k] for k in ("label", "source", "url", "date", "model_id", "hf_memfit_model", "status",
                               "metric", "value", "unit", "gpu", "measured", "notes")}
    out["published_bytes"] = published
    if row["status"] == "not_expressible":
        return out
    out["settings"] = json.loads(row["hf_memfit_settings"])
    spec = spec_for(row)
    for mode in modes:
        t0 = time.perf_counter()
        try:
            est = _quiet(estimate_settings, spec, settings_for(row, mode))
        except Exception as exc:  # noqa: BLE001 - a row that fails is reported, not hidden
            out[f"{mode}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        predicted = getattr(est, METRICS[row["metric"]])
        out[mode] = {"allocated": est.peak_allocated_bytes, "reserved": est.peak_reserved_bytes,
                     "device_total": est.device_total_bytes, "total_params": est.total_params,
                     "trainable_params": est.trainable_params, "region": est.peak_region,
                     "breakdown": dict(est.breakdown) if getattr(est, "breakdown", None) else None,
                     "predicted": predicted, "error": (predicted - published) / published,
                     "seconds": round(time.perf_counter() - t0, 1)}
    return out


def summary(results: list[dict], status: str) -> dict:
    out = {}
    for mode in ("fast", "exact"):
        errs = [abs(r[mode]["error"]) for r in results if r["status"] == status and mode in r]
        if errs:
            out[mode] = {"rows": len(errs), "median_abs_error": statistics.median(errs), "max_abs_error": max(errs)}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--fast-only", action="store_true")
    parser.add_argument("--only", metavar="TEXT", help="run only the rows whose label contains TEXT")
    args = parser.parse_args(argv)
    modes = ("fast",) if args.fast_only else ("fast", "exact")

    results = []
    print("| row | status | published | metric | fast | exact | fast error | exact error |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for row in load_rows():
        if args.only and args.only not in row["label"]:
            continue
        r = run_row(row, modes)
        results.append(r)
        unit = UNITS[row["unit"]]

        def cell(mode, key):
            if mode in r:
                return f"{r[mode][key] / unit:.2f} {row['unit']}" if key == "predicted" else f"{100 * r[mode][key]:+.1f}%"
            return "error" if f"{mode}_error" in r else "-"

        print(f"| {row['label']} | {row['status']} | {row['value']} {row['unit']} | {row['metric']} | "
              f"{cell('fast', 'predicted')} | {cell('exact', 'predicted')} | {cell('fast', 'error')} | "
              f"{cell('exact', 'error')} |", flush=True)
        for mode in modes:
            if f"{mode}_error" in r:
                print(f"    {mode} failed: {r[mode + '_error']}", flush=True)

    summaries = {status: summary(results, status) for status in ("counted", "approximate")}
    for status, s in summaries.items():
        for mode, v in s.items():
            print(f"{status} rows, {mode}: n={v['rows']}, median |error| {100 * v['median_abs_error']:.1f}%, "
                  f"max {100 * v['max_abs_error']:.1f}%")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": results, "summary": summaries, "csv": str(CSV_PATH.relative_to(HERE.parent))}, f,
                      indent=2, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tables of a GPU session's `hf-memfit check` results, with both modes' predictions (docs/benchmarks.md section 19).

`benchmarks/gpu_session.sh` runs `check --grid` with fast predictions only, so that the GPU's time goes to
measuring. Predictions are deterministic and offline, so this makes both modes' afresh from each row's
recorded settings (the GPU named as the run found it), with the estimator of this checkout: rerun it when the
estimator changes. The attention rows (`attn_*.json`, single `check --json` runs) are the suite's tiny Llama;
`rows.json` holds the named rows of `gpu_session.sh`'s part `rows` (benchmarks/data/gpu_rows.txt), whose configs
made on the GPU machine (`/tmp/tiny_llama.json`, `/tmp/gpt2_nodrop.json`) are made here the same way.

    python benchmarks/gpu_results.py benchmarks/results/gpu_h200 [--json PATH]
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import statistics
import sys
from contextlib import redirect_stderr, redirect_stdout

os.environ.setdefault("HF_HUB_OFFLINE", "1")
GiB, MiB = 2**30, 2**20


def settings_from_row(row: dict):
    from hf_memfit.settings import TrainSettings

    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in row["settings"].items()}
    return TrainSettings(**fields)


def predict_row(spec, row: dict) -> None:
    """Predict `row`'s settings in both modes with this checkout's estimator, as `check` writes them.

    The predictions the GPU run wrote are replaced: the measurements stand, the estimator moves on.
    """
    from hf_memfit.cli.check import _errors, _prediction, cuda_constants
    from hf_memfit.estimator.assemble import estimate_settings
    from hf_memfit.estimator.measure_device import Measurement

    measured = Measurement(**{k: v for k, v in row["measured"].items() if k != "snapshot_peak"})
    for mode in ("fast", "exact"):
        sink = io.StringIO()
        with redirect_stdout(sink), redirect_stderr(sink):
            est = estimate_settings(spec, settings_from_row(row).replace(mode=mode))
        row["predicted"][mode] = _prediction(est)
        row["error_percent"][mode] = _errors(est, measured)
    row["constants"] = cuda_constants(est, measured)


def _is_tiny_llama(row: dict) -> bool:
    """A row of the suite's tiny Llama: the first session's attention rows name no model (they predate `check
    --json` naming it), and `gpu_session.sh` writes the config to /tmp/tiny_llama.json on the GPU machine."""
    return row.get("model") is None or row["model"].endswith("tiny_llama.json")


def constants_lines(rows: list[dict], label) -> list[str]:
    """Each CUDA constant family (exact mode's prediction) beside the run's measurement, in MiB."""
    lines = ["| row | cuBLAS workspace (predicted / measured) | CUDA context | reserved - allocated |",
             "|---|---:|---:|---:|"]
    for row in rows:
        c = row["constants"]
        cells = [f"{c[k]['predicted'] / MiB:.0f} / {c[k]['measured'] / MiB:.0f}" if c[k]["measured"] is not None
                 else "-" for k in ("cublas_workspace_bytes", "cuda_context_bytes",
                                    "allocator_reserved_minus_allocated_bytes")]
        lines.append(f"| {label(row)} | " + " | ".join(cells) + " |")
    lines.append("(a grid's rows after its first find the workspaces already allocated: measured 0 there)")
    return lines


def row_spec(row: dict):
    """The model a row ran: a catalogue name, or a config the session wrote to /tmp on the GPU machine."""
    from hf_memfit.models.spec import ModelSpec, resolve_model

    if _is_tiny_llama(row):
        return tiny_llama_spec()
    if row["model"].endswith("gpt2_nodrop.json"):  # GPT-2 with its three dropouts at 0 (gpu_session.sh)
        config = dict(resolve_model("gpt2").config, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
        return ModelSpec.from_config("gpt2 (no dropout)", config)
    if row["model"].endswith("w2v_nolayerdrop.json"):  # wav2vec2-base-960h without LayerDrop (the fifth call)
        config = dict(resolve_model("facebook/wav2vec2-base-960h").config, layerdrop=0.0)
        return ModelSpec.from_config("wav2vec2-base-960h (no LayerDrop)", config)
    if row["model"].endswith("qwen2vl_7b.json"):  # Qwen2-VL-7B-Instruct's published config (published_media.py)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from published_media import INLINE_CONFIGS

        return ModelSpec.from_config("Qwen/Qwen2-VL-7B-Instruct", dict(INLINE_CONFIGS["Qwen/Qwen2-VL-7B-Instruct"]))
    return resolve_model(row["model"])


def tiny_llama_spec():
    """The attention rows' model: the suite's tiny Llama (tests/conftest.py), which `gpu_session.sh` writes out."""
    from hf_memfit.models.spec import ModelSpec

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from conftest import TINY_LLAMA

    return ModelSpec.from_config("tiny-llama", TINY_LLAMA)


def _size(b) -> str:
    return f"{b / GiB:.2f} GiB" if b >= GiB else f"{b / MiB:.0f} MiB"


def table(rows: list[dict], label) -> list[str]:
    lines = ["| settings | measured allocated | fast | exact | measured reserved | fast | exact | measured device "
             "total | fast | exact |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        m, e = row["measured"], row["error_percent"]
        cells = [label(row)]
        for key in ("peak_allocated", "peak_reserved", "device_total"):
            cells.append(_size(m[key + "_bytes"]))
            cells += [f"{e[mode][key]:+.1f}%" if mode in e else "-" for mode in ("fast", "exact")]
        lines.append("| " + " | ".join(cells) + " |")
    for mode in ("fast", "exact"):
        errors = [abs(row["error_percent"][mode]["peak_allocated"]) for row in rows if mode in row["error_percent"]]
        if errors:
            lines.append(f"\n{mode}: peak allocated |error| median {statistics.median(errors):.1f}%, "
                         f"max {max(errors):.1f}% over {len(errors)} rows")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--json", metavar="PATH", help="write the grid with exact predictions added")
    args = parser.parse_args(argv)
    grid_path = os.path.join(args.folder, "check_grid.json")
    if os.path.exists(grid_path):
        with open(grid_path, encoding="utf-8") as f:
            grid = json.load(f)
        from hf_memfit.models.spec import resolve_model

        spec = resolve_model(grid["model"])
        for row in grid["rows"]:
            if "measured" in row:
                predict_row(spec, row)
        print(f"`hf-memfit check --grid`: {grid['model']} on {grid['machine']['device_name']}, seq "
              f"{grid['rows'][0]['settings']['seq_len']}, bf16-mixed, AdamW, {grid['steps']} steps a row\n")
        print("\n".join(table([r for r in grid["rows"] if "measured" in r], lambda r: r["label"])))
        print()
        print("\n".join(constants_lines([r for r in grid["rows"] if "measured" in r], lambda r: r["label"])))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(grid, f, indent=2)
    rows = []
    for path in sorted(glob.glob(os.path.join(args.folder, "attn_*.json"))):  # the first session's, one a file
        with open(path, encoding="utf-8") as f:
            rows.append(json.load(f))
    if os.path.exists(os.path.join(args.folder, "single_rows.json")):  # gpu_session.sh gathers them since
        with open(os.path.join(args.folder, "single_rows.json"), encoding="utf-8") as f:
            rows += json.load(f)
    if rows:
        for row in rows:
            predict_row(row_spec(row), row)
        print("\nSingle `check --json` rows (bf16-mixed; tiny-llama is the suite's tiny Llama):\n")

        def label(row: dict) -> str:
            s = row["settings"]
            name = "tiny-llama" if _is_tiny_llama(row) else row["model"]
            return f"{name}, {s['attn_implementation'] or 'sdpa'}, batch {s['batch_size']}, seq {s['seq_len']:,}"

        print("\n".join(table(rows, label)))
        print()
        print("\n".join(constants_lines(rows, label)[:-1]))
    named_path = os.path.join(args.folder, "rows.json")
    if os.path.exists(named_path):
        with open(named_path, encoding="utf-8") as f:
            named = json.load(f)
        measured = [row for row in named if "measured" in row]
        for number, row in enumerate(measured, 1):
            print(f"[{number}/{len(measured)}] predicting {row['name']} ...", file=sys.stderr, flush=True)
            predict_row(row_spec(row), row)
        print(f"\nNamed rows (benchmarks/data/gpu_rows.txt) on {measured[0]['machine']['device_name']}:\n")
        print("\n".join(table(measured, lambda r: r["name"])))
        print()
        print("\n".join(constants_lines(measured, lambda r: r["name"])[:-1]))
        for row in named:
            if "failed" in row:
                print(f"\n{row['name']}: did not run: {row['failed'].strip().splitlines()[-1]}")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(named, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

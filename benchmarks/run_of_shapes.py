"""`estimate --vary-seq-len` against the H200's runs of varying shapes (docs/benchmarks.md section 21).

Section 19's GPU session trained runs of 64-96 micro-batches of drawn lengths (and, for Qwen2-VL, image sides)
and recorded, after each micro-batch, `max_memory_allocated` and `max_memory_reserved`; some runs were capped
at a card's size (`set_per_process_memory_fraction`), where the allocator frees its cache and retries before it
raises an OOM. This replays each run's own shapes, read from its record, through hf-memfit's run simulation
(`hf_memfit/estimator/run_of_shapes.py`: the run traced at full depth on fake CUDA tensors, its allocations
replayed through `CachingAllocatorSimulator`) and compares:

- uncapped runs: the predicted allocated and reserved peaks over the run against the measured ones;
- capped runs: whether the simulator runs out at the same cap, and at which micro-batch, and the smallest
  capacity on which the run completes (`needed`) against the cap.

Runs with the same settings and shapes (a run and its capped repeats) are traced once. Nothing here was fitted:
the simulator follows CUDACachingAllocator.cpp's rules, the tracer is exact mode's.

    python benchmarks/run_of_shapes.py --json benchmarks/results/run_of_shapes.json        # ~20 min here
    python benchmarks/run_of_shapes.py --only qwen05 --json /tmp/r.json                    # the 0.5B rows
    python benchmarks/run_of_shapes.py --session gpu_h200_3 --json benchmarks/results/run_of_shapes_3.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
GiB = 2**30
# The GPU sessions' runs: the one these replays were built beside, and two later calls whose runs were predicted
# and committed (gpu_h200_3/predicted/, gpu_h200_4/predicted/) before the GPU ran them.
SESSIONS = {"gpu_h200_2": ("drift.json", "drift_capped.json", "drift_plans.json"),
            "gpu_h200_3": ("drift_a.json", "drift_b.json"), "gpu_h200_4": ("drift_a.json", "drift_b.json")}
DATA = [os.path.join(HERE, "data", f) for f in ("gpu_drift.txt", "gpu_drift_2.txt", "gpu_drift_3.txt",
                                                "gpu_drift_4a.txt", "gpu_drift_4b.txt", "gpu_drift_5a.txt",
                                                "gpu_drift_5b.txt")]


def models_by_run() -> dict[str, str]:
    """Run name -> the model its line in the session's data files names."""
    names = {}
    for path in DATA:
        for line in open(path):
            if line.strip() and not line.startswith("#"):
                run, model = line.split()[:2]
                names[run] = model
    return names


def measured_runs(session: str) -> dict[str, dict]:
    """Every varying run the session recorded, uncapped and capped, by name."""
    runs = {}
    for file in SESSIONS[session]:
        for name, record in json.load(open(os.path.join(HERE, "results", session, file))).items():
            runs[name] = record["varying"] if "varying" in record and "summary" in record else record
    return runs


def spec_for(model: str):
    from hf_memfit.models.spec import ModelSpec, resolve_model

    if model == "QWEN2VL_7B":  # gpu_session.sh writes this inline config to /tmp/qwen2vl_7b.json on the GPU machine
        from published_media import INLINE_CONFIGS

        return ModelSpec.from_config("Qwen/Qwen2-VL-7B-Instruct",
                                     copy.deepcopy(INLINE_CONFIGS["Qwen/Qwen2-VL-7B-Instruct"]))
    return resolve_model(model)


def settings_of(record: dict, gpu: str | None):
    """The run's settings, on the GPU that ran it (its SMs size CUDA's reduction staging; None leaves it out)."""
    from hf_memfit.settings import TrainSettings

    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in record["settings"].items()}
    return TrainSettings(**fields).replace(mode="exact", gpu=gpu)


def shapes_of(record: dict) -> list[tuple[int, int | None]]:
    """The shapes the run met, the one it ran out at included."""
    shapes = [(t["seq_len"], t["image_size"]) for t in record["trace"]]
    if record.get("oom"):
        shapes.append((record["oom"]["seq_len"], record["oom"]["image_size"]))
    return shapes



CHECK_ROWS = [os.path.join(HERE, "results", d, "rows_predicted.json") for d in ("gpu_h100", "gpu_h200_2")]


def fixed_steps(only: str | None, staging: bool = True) -> list[dict]:
    """`--part steps`: the GPU sessions' `check` rows (two optimizer steps at one shape, in a fresh process),
    replayed at full depth through the simulator, against the measured reserved peak and the estimate's."""
    from gpu_results import row_spec, settings_from_row

    from hf_memfit.estimator.run_of_shapes import replay, replay_problems, trace_run, workspace_bytes

    rows = []
    for path in CHECK_ROWS:
        for row in json.load(open(path)):
            if only and only not in row["name"]:
                continue
            settings = settings_from_row(row).replace(mode="exact",
                                                      gpu=row["machine"]["device_name"] if staging else None)
            # check's steps: `--steps` (2) optimizer steps of at most two micro-batches (measure_device.train_on_cuda)
            fixed = settings.replace(gradient_accumulation_steps=min(settings.gradient_accumulation_steps, 2))
            spec = row_spec(row)
            problems = replay_problems(fixed.validate(spec))
            measured, predicted = row["measured"], row["predicted"].get("exact") or row["predicted"]["fast"]
            entry = {"row": row["name"], "model": row["model"], "gpu": row["machine"]["device_name"],
                     "measured_allocated": measured["peak_allocated_bytes"],
                     "measured_reserved": measured["peak_reserved_bytes"],
                     "estimate_reserved": predicted["peak_reserved_bytes"]}
            if problems:
                entry["not_replayed"] = problems[0]
                rows.append(entry)
                continue
            started = time.perf_counter()
            events, _, _ = trace_run(spec, fixed, [(fixed.seq_len, fixed.image_size)] *
                                  (2 * fixed.gradient_accumulation_steps))
            sim, _ = replay(events, workspace_bytes=workspace_bytes(fixed))
            entry.update(replay_allocated=sim.peak_allocated_bytes, replay_reserved=sim.peak_reserved_bytes,
                         seconds=round(time.perf_counter() - started, 1))
            rows.append(entry)
            print(f"{row['name']}: measured reserved {entry['measured_reserved'] / GiB:.3f} GiB, replay "
                  f"{sim.peak_reserved_bytes / GiB:.3f} ({(sim.peak_reserved_bytes - entry['measured_reserved']) / 2**20:+.0f}"
                  f" MiB), estimate {entry['estimate_reserved'] / GiB:.3f} GiB", flush=True)
    print("\n| row | GPU | measured allocated / reserved | replay allocated / reserved | replay - measured, "
          "reserved | the estimate's reserved |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        if "not_replayed" in r:
            print(f"| {r['row']} | {r['gpu']} | {r['measured_allocated'] / GiB:.3f} / {r['measured_reserved'] / GiB:.3f}"
                  f" GiB | not replayed: {r['not_replayed']} | | "
                  f"{100 * (r['estimate_reserved'] / r['measured_reserved'] - 1):+.1f}% |")
            continue
        print(f"| {r['row']} | {r['gpu']} | {r['measured_allocated'] / GiB:.3f} / {r['measured_reserved'] / GiB:.3f} "
              f"GiB | {r['replay_allocated'] / GiB:.3f} / {r['replay_reserved'] / GiB:.3f} GiB | "
              f"{(r['replay_reserved'] - r['measured_reserved']) / 2**20:+.0f} MiB "
              f"({100 * (r['replay_reserved'] / r['measured_reserved'] - 1):+.1f}%) | "
              f"{100 * (r['estimate_reserved'] / r['measured_reserved'] - 1):+.1f}% |")
    replayed = [r for r in rows if "replay_reserved" in r]
    errors = [abs(100 * (r["replay_reserved"] / r["measured_reserved"] - 1)) for r in replayed]
    estimate = [abs(100 * (r["estimate_reserved"] / r["measured_reserved"] - 1)) for r in replayed]
    if errors:
        print(f"\nreplayed rows: reserved median |error| {statistics.median(errors):.2f}%, max {max(errors):.2f}% "
              f"over {len(errors)}; the estimate's slack model on the same rows: median {statistics.median(estimate):.1f}%, "
              f"max {max(estimate):.1f}%")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--only", help="runs whose name contains this")
    parser.add_argument("--session", choices=tuple(SESSIONS), default="gpu_h200_2",
                        help="whose runs (default: the 2026-11-27 H200 session's 16; gpu_h200_3 and gpu_h200_4: the "
                             "later session's 6 and 4, predicted before they ran)")
    parser.add_argument("--part", choices=("runs", "steps"), default="runs",
                        help="runs (default): the H200's runs of varying shapes; steps: the GPU sessions' `check` "
                             "rows (one shape) replayed at full depth")
    parser.add_argument("--without-staging", action="store_true",
                        help="leave CUDA reductions' staged partial sums out (as before 2026-11-27's second session: no "
                             "GPU named), which needs the GPU's SMs")
    parser.add_argument("--segment-order", choices=("ascending", "descending"), default=None,
                        help="where the simulator puts a new segment (CachingAllocatorSimulator.SEGMENT_ORDER; "
                             "default ascending): descending replays the GPU snapshots' own events exactly on 10 of 11")
    args = parser.parse_args(argv)
    if args.segment_order:
        from hf_memfit.estimator.cuda_overhead import CachingAllocatorSimulator

        CachingAllocatorSimulator.SEGMENT_ORDER = args.segment_order
    gpu = None if args.without_staging else "H200"  # both sessions' runs ran on an H200
    if args.part == "steps":
        rows = fixed_steps(args.only, staging=not args.without_staging)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows}, f, indent=1)
        return 0
    from hf_memfit.estimator.run_of_shapes import needed_capacity, replay, trace_run, workspace_bytes

    models, runs = models_by_run(), measured_runs(args.session)
    groups: dict[str, list[str]] = {}  # one trace per (model, settings less the cap, shapes)
    for name, record in runs.items():
        if args.only and args.only not in name:
            continue
        settings = settings_of(record, gpu)
        if settings.expandable_segments:
            continue  # the simulator follows the default allocator (run_of_shapes.run_problems)
        key = json.dumps([models[name], settings.to_dict()], sort_keys=True, default=str)
        groups.setdefault(key, []).append(name)
    rows = []
    for names in groups.values():
        longest = max(names, key=lambda n: len(shapes_of(runs[n])))
        record, model = runs[longest], models[longest]
        spec, settings, shapes = spec_for(model), settings_of(record, gpu), shapes_of(record)
        started = time.perf_counter()
        events, ends, _ = trace_run(spec, settings, shapes)
        traced = time.perf_counter() - started
        workspace = workspace_bytes(settings)
        sim, running = replay(events, workspace_bytes=workspace, boundaries=ends)
        need = needed_capacity(events, low=sim.peak_allocated_bytes, high=sim.peak_reserved_bytes,
                               workspace_bytes=workspace, precision=16 * 2**20)
        print(f"{model} ({', '.join(names)}): traced {len(shapes)} micro-batches in {traced:.0f} s; "
              f"allocated {sim.peak_allocated_bytes / GiB:.2f} GiB, reserved {sim.peak_reserved_bytes / GiB:.2f} GiB, "
              f"needed {need / GiB:.2f} GiB", flush=True)
        for name in names:
            measured = runs[name]
            row = {"run": name, "model": model, "micro_batches": len(shapes_of(measured)),
                   "cap_bytes": measured.get("cap_bytes"), "measured_max_allocated": measured["max_allocated"],
                   "measured_max_reserved": measured["max_reserved"],
                   "measured_oom_micro_batch": measured["oom"]["micro_batch"] if measured.get("oom") else None,
                   "measured_reserved_after": [t["max_reserved"] for t in measured["trace"]],
                   "predicted_max_allocated": sim.peak_allocated_bytes,
                   "predicted_max_reserved": sim.peak_reserved_bytes, "predicted_needed": need,
                   "predicted_reserved_after": running, "trace_seconds": round(traced, 1)}
            if measured.get("cap_bytes"):
                capped, capped_running = replay(events, measured["cap_bytes"], workspace_bytes=workspace,
                                                boundaries=ends)
                row["predicted_oom_micro_batch"] = None if capped is not None else len(capped_running)
                row["predicted_capped_max_reserved"] = capped.peak_reserved_bytes if capped else None
            else:
                row["allocated_error_pct"] = 100 * (sim.peak_allocated_bytes / measured["max_allocated"] - 1)
                row["reserved_error_pct"] = 100 * (sim.peak_reserved_bytes / measured["max_reserved"] - 1)
            rows.append(row)
    print("\n| run | cap | measured: allocated / reserved (OOM) | predicted: allocated / reserved (OOM) | "
          "predicted smallest capacity | reserved error |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        cap = f"{r['cap_bytes'] / GiB:.2f} GiB" if r["cap_bytes"] else "none"
        m_oom = r["measured_oom_micro_batch"]
        p_oom = r.get("predicted_oom_micro_batch")
        measured = (f"{r['measured_max_allocated'] / GiB:.2f} / {r['measured_max_reserved'] / GiB:.2f} GiB"
                    + (f" (OOM at {m_oom + 1})" if m_oom is not None else ""))
        if not r["cap_bytes"]:
            predicted = f"{r['predicted_max_allocated'] / GiB:.2f} / {r['predicted_max_reserved'] / GiB:.2f} GiB"
        elif p_oom is None:  # the capped replay's own maxima (the allocated peak is the uncapped one's)
            predicted = (f"{r['predicted_max_allocated'] / GiB:.2f} / {r['predicted_capped_max_reserved'] / GiB:.2f} "
                         "GiB (no OOM)")
        else:
            predicted = f"OOM at {p_oom + 1}"
        error = f"{r['reserved_error_pct']:+.1f}%" if "reserved_error_pct" in r else "-"
        print(f"| {r['run']} | {cap} | {measured} | {predicted} | {r['predicted_needed'] / GiB:.2f} GiB | {error} |")
    uncapped = [abs(r["reserved_error_pct"]) for r in rows if "reserved_error_pct" in r]
    capped = [r for r in rows if r["cap_bytes"]]
    agree = sum((r["measured_oom_micro_batch"] is None) == (r.get("predicted_oom_micro_batch") is None)
                for r in capped)
    if uncapped:
        print(f"\nuncapped runs: reserved over the run, median |error| {statistics.median(uncapped):.1f}%, "
              f"max {max(uncapped):.1f}% over {len(uncapped)}")
    if capped:
        print(f"capped runs: OOM or not as measured in {agree} of {len(capped)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

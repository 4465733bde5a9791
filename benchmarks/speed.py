"""Speed benchmark, and two cross-checks of exact mode that need no real run.

1. Wall time of `hf_memfit.estimate(...)` in fast mode and in exact mode
   (GPT-2-XL, 48 layers, batch 1, seq 1024, fp32 AdamW; device cpu and cuda).
   Target from the issue: exact mode under 10 s.
2. Wall time of the fast CLI, `hf-memfit estimate gpt2-xl --batch-size 1
   --seq-len 1024`, in a fresh interpreter (start-up included), best of 3.
3. Exact mode vs PyTorch's own `torch.distributed._tools.mem_tracker.MemTracker`
   on the same step (the same `hf_memfit.estimator.step` functions: model creation, two
   optimizer steps) under `FakeTensorMode`, at full depth, device cpu.
   Target: within 2%. MemTracker's wall time is reported too.
4. Layer extrapolation: exact mode (traces 2 and 3 layers per stack and
   extrapolates) vs a full-depth trace (`exact_candidates(..., extrapolate=False)`)
   on a few catalogue models.

    python benchmarks/speed.py
    python benchmarks/speed.py --skip-memtracker --json speed.json
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from contextlib import redirect_stderr, redirect_stdout

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

MiB = 2**20
GPT2_XL = "gpt2-xl"
XL_SETTINGS = dict(batch_size=1, seq_len=1024, precision="fp32", optim="adamw_torch")


def _quiet(fn, *args, **kwargs):
    sink = io.StringIO()
    with redirect_stdout(sink), redirect_stderr(sink):
        return fn(*args, **kwargs)


def _timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    value = _quiet(fn, *args, **kwargs)
    return value, time.perf_counter() - t0


# --- 1. estimate() wall time ------------------------------------------------------------------


def time_estimate(results: dict, repeats: int) -> None:
    from hf_memfit import estimate

    print("## estimate() wall time (in-process)")
    rows = []
    # Fast mode: the first call pays module imports; later calls are the steady state.
    for device in ("cuda", "cpu"):
        try:
            est, first = _timed(estimate, GPT2_XL, mode="fast", device=device, **XL_SETTINGS)
            times = [_timed(estimate, GPT2_XL, mode="fast", device=device, **XL_SETTINGS)[1] for _ in range(repeats)]
            rows.append({"what": f"fast, gpt2-xl b1 s1024 fp32 adamw, device={device}", "first_s": first,
                         "best_s": min(times), "median_s": statistics.median(times),
                         "peak_allocated_bytes": est.peak_allocated_bytes})
        except Exception as exc:  # noqa: BLE001
            rows.append({"what": f"fast, gpt2-xl, device={device}", "error": f"{type(exc).__name__}: {exc}"[:200]})
    # Exact mode: every call re-traces (no caching across calls), so 3 calls are enough.
    for device in ("cpu", "cuda"):
        try:
            runs = [_timed(estimate, GPT2_XL, mode="exact", device=device, **XL_SETTINGS) for _ in range(3)]
            times = [t for _, t in runs]
            rows.append({"what": f"exact, gpt2-xl b1 s1024 fp32 adamw, device={device}", "first_s": times[0],
                         "best_s": min(times), "median_s": statistics.median(times),
                         "peak_allocated_bytes": runs[-1][0].peak_allocated_bytes,
                         "peak_reserved_bytes": runs[-1][0].peak_reserved_bytes,
                         "device_total_bytes": runs[-1][0].device_total_bytes})
        except Exception as exc:  # noqa: BLE001
            rows.append({"what": f"exact, gpt2-xl, device={device}", "error": f"{type(exc).__name__}: {exc}"[:200]})
    print("| call | first call | best | median | peak allocated |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['what']} | failed: {r['error']} | | | |")
        else:
            print(f"| {r['what']} | {r['first_s'] * 1000:.1f} ms | {r['best_s'] * 1000:.1f} ms | "
                  f"{r['median_s'] * 1000:.1f} ms | {r['peak_allocated_bytes'] / MiB:.1f} MiB |")
    exact = [r for r in rows if r["what"].startswith("exact") and "error" not in r]
    if exact:
        worst = max(r["median_s"] for r in exact)
        print(f"exact mode on GPT-2-XL under 10 s: {'PASS' if worst < 10 else 'FAIL'} (slowest median {worst:.2f} s)")
    print()
    results["estimate"] = rows


# --- 2. CLI wall time -------------------------------------------------------------------------------


def time_cli(results: dict) -> None:
    exe = shutil.which("hf-memfit")
    cmd = [exe, "estimate", "gpt2-xl", "--batch-size", "1", "--seq-len", "1024"] if exe else \
        [sys.executable, "-m", "hf_memfit.cli", "estimate", "gpt2-xl", "--batch-size", "1", "--seq-len", "1024"]
    print("## CLI wall time (fresh interpreter, fast mode)")
    print("$ " + " ".join(["hf-memfit"] + cmd[1:] if exe else cmd))
    times, last = [], None
    for _ in range(3):
        t0 = time.perf_counter()
        last = subprocess.run(cmd, capture_output=True, text=True)
        times.append(time.perf_counter() - t0)
    # Does the fast path import torch? (It should not.)
    probe = subprocess.run([sys.executable, "-X", "importtime", "-c",
                            "import sys; from hf_memfit.cli.main import main; "
                            "rc = main(['estimate', 'gpt2-xl', '--batch-size', '1', '--seq-len', '1024']); "
                            "print('TORCH_LOADED' if 'torch' in sys.modules else 'TORCH_NOT_LOADED')"],
                           capture_output=True, text=True)
    torch_loaded = "TORCH_LOADED" in probe.stdout
    entry = {"command": " ".join(cmd), "times_s": times, "best_s": min(times), "returncode": last.returncode,
             "stdout": last.stdout[-2000:], "stderr": last.stderr[-2000:], "torch_imported": torch_loaded}
    print(f"best of 3: {min(times) * 1000:.0f} ms (all: {', '.join(f'{t * 1000:.0f}' for t in times)} ms); "
          f"exit code {last.returncode}; torch imported: {torch_loaded}")
    if last.returncode == 0:
        print("output:")
        print("\n".join("    " + line for line in last.stdout.rstrip().splitlines()))
    else:
        print("stderr: " + last.stderr.strip()[-500:])
    print()
    results["cli"] = entry


# --- 3. MemTracker cross-check -----------------------------------------------------------------


def memtracker_peak(config: dict, settings, *, steps: int = 2) -> tuple[int, dict]:
    """MemTracker's peak over model creation and `steps` optimizer steps, on fake CPU tensors, full depth."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from hf_memfit.estimator import step as training

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    tracker = MemTracker()
    with fake_mode, tracker:
        model = training.build_model(config, settings)
        optimizer = training.make_optimizer(model, settings)
        for _ in range(steps):
            for _ in range(min(settings.gradient_accumulation_steps, 2)):
                # MemTracker refuses a second forward of a tracked module unless its per-module stats are
                # cleared; this clears only those (the device-wide peak is kept).
                tracker.reset_mod_stats()
                batch = training.make_batch(settings, config)
                training.forward_backward(model, batch, settings, device_type="cpu")
                del batch
            training.optimizer_step(model, optimizer)
        del model, optimizer
    peak = tracker.get_tracker_snapshot("peak")
    device = next(iter(peak))
    snap = {str(k): int(v) for k, v in peak[device].items()}
    return int(snap["Total"]), snap


def check_memtracker(results: dict) -> None:
    from hf_memfit.estimator.assemble import estimate_settings
    from hf_memfit.settings import TrainSettings
    from hf_memfit.models.spec import resolve_model

    print("## exact mode vs torch MemTracker (FakeTensorMode, full depth, device cpu)")
    cases = [("gpt2-xl", XL_SETTINGS), ("gpt2", dict(batch_size=4, seq_len=512, precision="bf16-mixed",
                                                       gradient_checkpointing=True))]
    rows = []
    for name, kw in cases:
        spec = resolve_model(name)
        settings = TrainSettings(device="cpu", mode="exact", **kw).validate(spec)
        est, exact_s = _timed(estimate_settings, spec, settings)
        row = {"model": name, "settings": kw, "exact_bytes": est.peak_allocated_bytes, "exact_s": exact_s}
        try:
            (peak, snap), mt_s = _timed(memtracker_peak, spec.config, settings)
            row.update(memtracker_bytes=peak, memtracker_s=mt_s, memtracker_snapshot=snap,
                       diff_pct=100.0 * (est.peak_allocated_bytes - peak) / peak)
        except Exception as exc:  # noqa: BLE001
            row["memtracker_error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
    print("| model / settings | exact | exact time | MemTracker | MemTracker time | exact - MemTracker |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        label = f"{r['model']} " + " ".join(f"{k}={v}" for k, v in r["settings"].items())
        if "memtracker_error" in r:
            print(f"| {label} | {r['exact_bytes'] / MiB:.1f} MiB | {r['exact_s']:.1f} s | failed: "
                  f"{r['memtracker_error']} | | |")
        else:
            print(f"| {label} | {r['exact_bytes'] / MiB:.1f} MiB | {r['exact_s']:.1f} s | "
                  f"{r['memtracker_bytes'] / MiB:.1f} MiB | {r['memtracker_s']:.1f} s | {r['diff_pct']:+.4f}% "
                  f"({r['exact_bytes'] - r['memtracker_bytes']:+,d} B) |")
    ok = [r for r in rows if "diff_pct" in r]
    if ok:
        worst = max(abs(r["diff_pct"]) for r in ok)
        print(f"within 2% of MemTracker: {'PASS' if worst <= 2 and len(ok) == len(rows) else 'FAIL'} "
              f"(max |diff| {worst:.3f}%)")
    print()
    results["memtracker"] = rows


# --- 4. Layer extrapolation ---------------------------------------------------------------------


def check_extrapolation(results: dict) -> None:
    from hf_memfit.estimator.assemble import assemble
    from hf_memfit.settings import TrainSettings
    from hf_memfit.models.spec import resolve_model
    from hf_memfit.estimator.exact import exact_candidates

    print("## layer extrapolation: traced at 2 and 3 layers vs traced at full depth")
    cases = [
        ("gpt2", dict(batch_size=2, seq_len=512)),
        ("google-t5/t5-small", dict(batch_size=4, seq_len=256, precision="bf16-mixed")),
        ("meta-llama/Llama-3.2-1B", dict(batch_size=1, seq_len=512, precision="bf16-mixed",
                                         gradient_checkpointing=True)),
        ("EleutherAI/pythia-160m", dict(batch_size=2, seq_len=512, lora_r=8)),
    ]
    rows = []
    for name, kw in cases:
        spec = resolve_model(name)
        for device in ("cpu", "cuda"):
            settings = TrainSettings(device=device, mode="exact", **kw).validate(spec)
            try:
                step_x, t_x = _timed(exact_candidates, spec, settings)
                step_f, t_f = _timed(exact_candidates, spec, settings, extrapolate=False)
            except Exception as exc:  # noqa: BLE001
                rows.append({"model": name, "device": device, "settings": kw, "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            x = assemble(spec, settings, step_x)
            f = assemble(spec, settings, step_f)
            rows.append({"model": name, "device": device, "settings": kw, "layers": spec.num_layers,
                         "extrapolated_bytes": x.peak_allocated_bytes, "full_bytes": f.peak_allocated_bytes,
                         "extrapolated_s": t_x, "full_s": t_f,
                         "extrapolated_region": x.peak_region, "full_region": f.peak_region,
                         "diff_pct": 100.0 * (x.peak_allocated_bytes - f.peak_allocated_bytes) / f.peak_allocated_bytes})
    print("| model / settings | device | layers | extrapolated | full-depth trace | diff | time (extrap. / full) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        label = f"{r['model']} " + " ".join(f"{k}={v}" for k, v in r["settings"].items())
        if "error" in r:
            print(f"| {label} | {r['device']} | | failed: {r['error']} | | | |")
            continue
        print(f"| {label} | {r['device']} | {r['layers']} | {r['extrapolated_bytes'] / MiB:.1f} MiB | "
              f"{r['full_bytes'] / MiB:.1f} MiB | {r['diff_pct']:+.4f}% | {r['extrapolated_s']:.1f} s / {r['full_s']:.1f} s |")
    print()
    results["extrapolation"] = rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="fast-mode calls to time (default 20)")
    parser.add_argument("--skip-memtracker", action="store_true")
    parser.add_argument("--skip-extrapolation", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)

    import platform

    import torch

    print(f"# hf-memfit speed benchmark: torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} torch threads, Python {platform.python_version()}\n")
    results: dict = {}
    time_cli(results)  # first, before this process warms any cache the subprocess could share
    time_estimate(results, args.repeats)
    if not args.skip_memtracker:
        check_memtracker(results)
    if not args.skip_extrapolation:
        check_extrapolation(results)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

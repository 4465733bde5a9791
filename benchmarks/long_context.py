"""Long context (issue 17): ALST's TiledMLP against the CPU allocator, fast vs exact at real size, and
`plan --seq-len max` against ALST's published maxima.

    python benchmarks/long_context.py --json benchmarks/results/long_context.json            # all three parts
    python benchmarks/long_context.py --part tiled | --part scale | --part longest [--fork auto|always|never]

- `tiled`: tiny Llama / Qwen3 steps on the CPU with DeepSpeed's real `TiledMLP` (what
  `hf_memfit.apply_tiled_mlp` installs), measured with the profiler, against both modes.
- `scale`: Llama-3.1-8B with ALST's levers (Liger, checkpoints offloaded to the host, ZeRO-3 with
  offload, expandable segments) at 64K and 256K tokens, fast against exact, with and without TiledMLP.
- `longest`: `hf-memfit plan meta-llama/Llama-3.1-8B --seq-len max` on one H100 (and on 8 when the
  planner has sequence parallelism), cold (fresh cache, new process) and its answer against ALST
  (arXiv 2506.13996, Table 1 / Figure 1: 500K tokens on one H100, 3.7M on one 8xH100 node).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

TINY = {
    "llama": dict(model_type="llama", num_hidden_layers=4, hidden_size=64, intermediate_size=160,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096),
    "qwen3": dict(model_type="qwen3", num_hidden_layers=4, hidden_size=64, intermediate_size=160,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                  max_position_embeddings=4096, tie_word_embeddings=True),
}
TILED_ROWS = (
    ("llama", dict(batch_size=1, seq_len=512)),
    ("llama", dict(batch_size=2, seq_len=256, lora_r=8)),
    ("llama", dict(batch_size=1, seq_len=512, gradient_checkpointing=True)),
    ("llama", dict(batch_size=1, seq_len=400, precision="bf16-mixed")),
    ("llama", dict(batch_size=1, seq_len=512, precision="bf16", gradient_checkpointing=True, lora_r=8)),
    ("qwen3", dict(batch_size=1, seq_len=512)),
    ("qwen3", dict(batch_size=1, seq_len=512, gradient_checkpointing=True, precision="bf16-mixed")),
)
ALST_LEVERS = dict(precision="bf16-mixed", gpu="h100", gradient_checkpointing=True, use_liger_kernel=True,
                   offload_activations=True, expandable_segments=True, attn_implementation="flash_attention_2",
                   zero_stage=3, offload_optimizer="cpu", offload_param="cpu")
# ALST's published maxima for Llama-3.1-8B (arXiv 2506.13996, Figure 1 / Table 1).
ALST_MAXIMA = {1: 500_000, 8: 3_700_000}


def part_tiled() -> list[dict]:
    from hf_memfit.estimator.assemble import estimate_settings
    from hf_memfit.estimator.measure import measure_cpu_peak
    from hf_memfit.models.spec import ModelSpec
    from hf_memfit.settings import TrainSettings

    rows = []
    for family, changes in TILED_ROWS:
        spec = ModelSpec.from_config(f"tiny-{family}", dict(TINY[family]))
        settings = TrainSettings(device="cpu", tiled_mlp=True, **changes).validate(spec)
        measured = measure_cpu_peak(spec.config, settings)
        untiled = measure_cpu_peak(spec.config, settings.replace(tiled_mlp=False))
        exact = estimate_settings(spec, settings.replace(mode="exact")).peak_allocated_bytes
        fast = estimate_settings(spec, settings).peak_allocated_bytes
        row = {"model": family, "settings": changes, "measured": measured, "measured_untiled": untiled,
               "exact_error": (exact - measured) / measured, "fast_error": (fast - measured) / measured}
        rows.append(row)
        print(f"tiled {family:6s} {json.dumps(changes):90s} measured {measured / 2**20:7.2f} MiB "
              f"(untiled {untiled / 2**20:7.2f}) exact {100 * row['exact_error']:+.2f}% "
              f"fast {100 * row['fast_error']:+.2f}%", flush=True)
    return rows


def part_scale() -> list[dict]:
    from hf_memfit.estimator.assemble import estimate_settings
    from hf_memfit.models.spec import resolve_model
    from hf_memfit.settings import TrainSettings

    spec = resolve_model("meta-llama/Llama-3.1-8B")
    rows = []
    for seq_len in (65_536, 262_144):
        for tiled in (False, True):
            settings = TrainSettings(batch_size=1, seq_len=seq_len, tiled_mlp=tiled, **ALST_LEVERS).validate(spec)
            fast = estimate_settings(spec, settings).device_total_bytes
            exact = estimate_settings(spec, settings.replace(mode="exact")).device_total_bytes
            rows.append({"seq_len": seq_len, "tiled_mlp": tiled, "exact": exact, "fast": fast,
                         "fast_vs_exact": (fast - exact) / exact})
            print(f"scale {seq_len:>8,} tiled={tiled!s:5s} exact {exact / 2**30:6.2f} GiB fast "
                  f"{100 * (fast - exact) / exact:+.2f}%", flush=True)
    return rows


# `--fork always` runs the CLI as on an idle machine whatever the load here (the forked children of
# `estimator/forked.py` then run beside each other even on a busy machine, so its wall time is not an idle one).
_FORCED = ("import sys; from hf_memfit.estimator import forked; forked.idle_cpus = lambda: 2.0; "
           "from hf_memfit.cli.main import main; sys.exit(main(sys.argv[1:]))")


def part_longest(fork: str = "auto") -> list[dict]:
    import resource

    rows = []
    for gpus in (1, 8):
        argv = ["plan", "meta-llama/Llama-3.1-8B", "--seq-len", "max", "--global-batch-size", str(gpus),
                "--num-gpus", str(gpus), "--gpu", "h100", "--use-liger-kernel", "yes", "--expandable-segments",
                "--json"]
        argv = [sys.executable] + (["-c", _FORCED] if fork == "always" else ["-m", "hf_memfit.cli"]) + argv
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, HF_MEMFIT_CACHE=cache)
            if fork == "never":
                env["HF_MEMFIT_NO_FORK"] = "1"
            load = os.getloadavg()
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.monotonic()
            done = subprocess.run(argv, capture_output=True, text=True, env=env)
            seconds = time.monotonic() - start
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        if done.returncode != 0:
            rows.append({"gpus": gpus, "error": done.stderr.strip().splitlines()[-1], "seconds": seconds})
            print(f"longest {gpus} x H100: refused in {seconds:.1f} s: {rows[-1]['error']}", flush=True)
            continue
        # libraries may print to stdout at import (torchao's kernel loader): the JSON object starts a line with "{"
        start = done.stdout.index("\n{") + 1 if not done.stdout.startswith("{") else 0
        data = json.loads(done.stdout[start:])
        answer = data["longest_seq_len"]
        confirmed = next(p for p in data["scaling"] if p["seq_len"] == answer)
        rows.append({"gpus": gpus, "longest_seq_len": answer, "alst": ALST_MAXIMA[gpus],
                     "ratio": answer / ALST_MAXIMA[gpus], "seconds_cold": seconds, "cpu_seconds": cpu,
                     "load_average_before": list(load), "fork": fork,
                     "exact_device_total_bytes": confirmed["device_total_bytes"],
                     "confirmed_in_exact_mode": confirmed["confirmed_in_exact_mode"], "bound": data["bound"],
                     "plan": data["scaling"][-2 if not data["scaling"][-1]["fits"] else -1]["summary"]})
        print(f"longest {gpus} x H100: {answer:,} tokens ({answer / ALST_MAXIMA[gpus]:.2f}x ALST's "
              f"{ALST_MAXIMA[gpus]:,}) in {seconds:.1f} s cold ({cpu:.1f} s CPU, load {load[0]:.2f}, fork {fork}); "
              f"{rows[-1]['plan']}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("tiled", "scale", "longest"), action="append")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--fork", choices=("auto", "always", "never"), default="auto",
                        help="--part longest: fork as the CLI decides (idle CPUs), always, or never")
    args = parser.parse_args()
    parts = args.part or ["tiled", "scale", "longest"]
    result = {}
    for part in parts:
        if part == "longest":  # one key per fork mode: `longest` as the CLI decides, `longest_fork_never` ...
            result["longest" if args.fork == "auto" else f"longest_fork_{args.fork}"] = part_longest(args.fork)
        else:
            result[part] = {"tiled": part_tiled, "scale": part_scale}[part]()
    if args.json:
        previous = json.loads(Path(args.json).read_text()) if Path(args.json).exists() else {}
        Path(args.json).write_text(json.dumps({**previous, **result}, indent=1) + "\n")


if __name__ == "__main__":
    main()

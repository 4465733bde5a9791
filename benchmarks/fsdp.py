"""FSDP layouts against real PyTorch FSDP: each rank's measured peak vs the estimate, on the CPU.

PyTorch FSDP2 (`fully_shard`) and FSDP1 (`FullyShardedDataParallel`) shard over gloo
on the CPU with the same code they run on GPUs, so the shards, the gathered units,
the unsharded and sharded gradients and the optimizer state over DTensor shards that
`hf_memfit.sharding._fsdp` models are real allocations here. Each row launches 2
processes (torchrun-style environment), builds a small model with hf-memfit's own
step code (`hf_memfit.step`: the code the exact estimator traces), wraps it the way
accelerate 1.15's `fsdp2_prepare_model` / FSDP1 plugin does (each decoder layer, then
the root; `MixedPrecisionPolicy(param_dtype=reduce_dtype=output_dtype=bf16)` for
bf16-mixed; `CPUOffloadPolicy` / `CPUOffload(offload_params=True)` for offload), runs
three optimizer steps under the PyTorch profiler and takes each rank's allocator peak
over the steps (creation and wrapping excluded: a marker allocation separates them).
On the CPU "device" and "host" are one memory, so the prediction compared is
`device_total_bytes + cpu_bytes` (per rank).

    python benchmarks/fsdp.py [--json results.json] [--repeats 1] [--rows 0,1,...]

Process group: gloo; the CPU's FSDP collectives run synchronously, so this checks the
allocated bytes, not the GPU's stream pools (those are modelled from the allocator's
source, see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

ROWS = [
    # (name, family, precision, fsdp strategy, version, offload, lora_r)
    ("llama-L4 fp32 FSDP2 full_shard", "llama", "fp32", "full_shard", 2, False, None),
    ("llama-L4 fp32 FSDP2 shard_grad_op", "llama", "fp32", "shard_grad_op", 2, False, None),
    ("llama-L4 fp32 FSDP2 full_shard + CPU offload", "llama", "fp32", "full_shard", 2, True, None),
    ("llama-L4 bf16-mixed FSDP2 full_shard", "llama", "bf16-mixed", "full_shard", 2, False, None),
    ("llama-L4 bf16 weights FSDP2 full_shard", "llama", "bf16", "full_shard", 2, False, None),
    ("llama-L4 fp32 FSDP2 full_shard + LoRA r16", "llama", "fp32", "full_shard", 2, False, 16),
    ("gpt2-L4 fp32 FSDP2 full_shard", "gpt2", "fp32", "full_shard", 2, False, None),
    ("llama-L4 fp32 FSDP1 full_shard", "llama", "fp32", "full_shard", 1, False, None),
    ("llama-L4 fp32 FSDP1 shard_grad_op", "llama", "fp32", "shard_grad_op", 1, False, None),
    ("llama-L4 fp32 FSDP1 no_shard", "llama", "fp32", "no_shard", 1, False, None),
    ("llama-L4 fp32 FSDP1 full_shard + CPU offload", "llama", "fp32", "full_shard", 1, True, None),
]
CONFIGS = {
    "gpt2": dict(model_type="gpt2", n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=256,
                 bos_token_id=0, eos_token_id=0),
    "llama": dict(model_type="llama", num_hidden_layers=4, hidden_size=256, intermediate_size=688,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=8192, max_position_embeddings=512,
                  tie_word_embeddings=False),
}
BATCH, SEQ, STEPS, WORLD = 2, 128, 3, 2
MARKER_BYTES = 7_777_777  # a size nothing else allocates: marks where the training steps begin


def settings_for(row: tuple, mode: str = "fast"):
    from hf_memfit.settings import TrainSettings

    name, family, precision, strategy, version, offload, lora_r = row
    return TrainSettings(batch_size=BATCH, seq_len=SEQ, precision=precision, optim="adamw_torch", device="cpu",
                         num_gpus=WORLD, fsdp=strategy, fsdp_version=version, fsdp_offload=offload, lora_r=lora_r,
                         attn_implementation="sdpa", mode=mode, task="causal-lm")


def wrap(model, settings):
    """Shard `model` the way accelerate 1.15 does for the settings' FSDP version."""
    import torch

    from hf_memfit.step import torch_dtype

    layer_classes = tuple({type(m) for m in model.modules() if type(m).__name__ in
                           set(getattr(_base(model), "_no_split_modules", None) or [])})
    compute = torch_dtype(settings.autocast_dtype) if settings.autocast_dtype else None
    if settings.fsdp_version == 2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        kwargs = dict(mesh=mesh, reshard_after_forward=settings.fsdp != "shard_grad_op",
                      offload_policy=CPUOffloadPolicy(pin_memory=False) if settings.fsdp_offload else OffloadPolicy())  # pinning needs CUDA
        if compute is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=compute, output_dtype=compute)
        for module in model.modules():
            if isinstance(module, layer_classes):
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)
        return model
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(
        model, sharding_strategy=ShardingStrategy[settings.fsdp.upper()],
        auto_wrap_policy=ModuleWrapPolicy(set(layer_classes)), cpu_offload=CPUOffload(offload_params=settings.fsdp_offload),
        mixed_precision=MixedPrecision(param_dtype=compute, reduce_dtype=compute, buffer_dtype=compute) if compute else None,
        use_orig_params=True, device_id=torch.device("cpu"), limit_all_gathers=True)


def _base(model):
    return getattr(model, "get_base_model", lambda: model)()


def measure(row: tuple) -> int:
    """This rank's allocator peak over STEPS optimizer steps of the row's FSDP run."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from hf_memfit import step as training

    dist.init_process_group("gloo")
    settings = settings_for(row)
    config = dict(CONFIGS[row[1]])
    torch.manual_seed(0)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = wrap(training.build_model(config, settings), settings)
        optimizer = training.make_optimizer(model, settings)
        marker = torch.empty(MARKER_BYTES, dtype=torch.uint8)  # allocated and freed: the steps start here
        del marker
        for _ in range(STEPS):
            torch.manual_seed(1 + dist.get_rank())
            batch = training.make_batch(settings, config)
            training.forward_backward(model, batch, settings, device_type="cpu")
            del batch
            training.optimizer_step(model, optimizer)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live, peak, started = 0, 0, False
    for event in events:
        live += event.nbytes()
        started = started or event.nbytes() == MARKER_BYTES
        if started:
            peak = max(peak, live)
    # What the steps start from: the sharded model and the optimizer state that exist before the marker.
    dist.destroy_process_group()
    return peak


def predict(row: tuple, mode: str) -> int:
    from hf_memfit.estimator import estimate_settings
    from hf_memfit.spec import ModelSpec

    spec = ModelSpec.from_config(f"{row[1]}-small", dict(CONFIGS[row[1]]))
    est = estimate_settings(spec, settings_for(row, mode))
    return est.device_total_bytes + est.cpu_bytes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_row(index: int, timeout: int = 900) -> list[int]:
    """Launch the row's two ranks; return each rank's measured peak."""
    port = str(_free_port())
    with tempfile.TemporaryDirectory() as out:
        procs = []
        for rank in range(WORLD):
            env = os.environ | {"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
                                "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen([sys.executable, __file__, "--row", str(index), "--out", out], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
        peaks = []
        for rank in range(WORLD):
            path = os.path.join(out, f"rank{rank}.json")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} failed: {logs[rank][-1500:]}")
            with open(path) as handle:
                peaks.append(json.load(handle)["peak"])
    return peaks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--repeats", type=int, default=1, help="launches per row (the median is compared)")
    parser.add_argument("--rows", help="comma-separated row indices (default: all)")
    parser.add_argument("--row", type=int, help=argparse.SUPPRESS)  # child process: measure one row
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row is not None:
        peak = measure(ROWS[args.row])
        with open(os.path.join(args.out, f"rank{os.environ['RANK']}.json"), "w") as handle:
            json.dump({"peak": peak}, handle)
        return 0
    import torch
    import transformers

    print(f"# FSDP layouts vs real PyTorch FSDP on the CPU (gloo, {WORLD} ranks); torch {torch.__version__}, "
          f"transformers {transformers.__version__}; batch {BATCH} x seq {SEQ}, each rank's peak over {STEPS} steps")
    print("| layout | measured MiB, rank 0 / rank 1 | fast MiB | fast err | exact MiB | exact err |")
    print("|---|---:|---:|---:|---:|---:|")
    indices = [int(i) for i in args.rows.split(",")] if args.rows else range(len(ROWS))
    results = []
    for index in indices:
        row = ROWS[index]
        started = time.perf_counter()
        try:
            runs = [run_row(index) for _ in range(args.repeats)]
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            print(f"| {row[0]} | failed: {str(error)[-300:]!r} | | | | |")
            results.append({"row": row[0], "error": str(error)[-2000:]})
            continue
        per_rank = [sorted(r[rank] for r in runs)[len(runs) // 2] for rank in range(WORLD)]
        measured = max(per_rank)
        fast, exact = predict(row, "fast"), predict(row, "exact")
        result = {"row": row[0], "measured_bytes_per_rank": per_rank, "measured_runs": runs, "fast_bytes": fast,
                  "exact_bytes": exact, "fast_error": fast / measured - 1, "exact_error": exact / measured - 1,
                  "seconds": round(time.perf_counter() - started, 1)}
        results.append(result)
        print(f"| {row[0]} | {per_rank[0] / 2**20:.2f} / {per_rank[1] / 2**20:.2f} | {fast / 2**20:.2f} | "
              f"{100 * result['fast_error']:+.2f}% | {exact / 2**20:.2f} | {100 * result['exact_error']:+.2f}% |",
              flush=True)
    for mode in ("fast", "exact"):
        errors = [abs(r[f"{mode}_error"]) for r in results if f"{mode}_error" in r]
        if errors:
            print(f"{mode} mode: median |err| {100 * sorted(errors)[len(errors) // 2]:.2f}%, "
                  f"max {100 * max(errors):.2f}% over {len(errors)} rows (vs the larger rank)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rows": results, "torch": torch.__version__}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

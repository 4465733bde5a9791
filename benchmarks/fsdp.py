"""FSDP layouts against real PyTorch FSDP: each rank's measured peak vs the estimate, on the CPU.

PyTorch FSDP2 (`fully_shard`) and FSDP1 (`FullyShardedDataParallel`) shard over gloo
on the CPU with the same code they run on GPUs, so the shards, the gathered units,
the unsharded and sharded gradients and the optimizer state over DTensor shards that
`hf_memfit.estimator.sharding._fsdp` models are real allocations here. Each row launches 2
processes (torchrun-style environment), builds a small model with hf-memfit's own
step code (`hf_memfit.estimator.step`: the code the exact estimator traces), wraps it the way
accelerate 1.15's `fsdp2_prepare_model` / FSDP1 plugin does (each decoder layer, then
the root; `MixedPrecisionPolicy(param_dtype=reduce_dtype=output_dtype=bf16)` for
bf16-mixed; `CPUOffloadPolicy` / `CPUOffload(offload_params=True)` for offload), runs
three optimizer steps under the PyTorch profiler and takes each rank's allocator peak
over the steps (creation and wrapping excluded: a marker allocation separates them).
On the CPU "device" and "host" are one memory, so the prediction compared is
`device_total_bytes + cpu_bytes` (per rank).

Two process-group backends, each rank in its own process:
- `fake` (torch's FakeProcessGroup, `torch.testing._internal.distributed.fake_pg`): FSDP's
  real code and every buffer it allocates, with collectives that move no data. All
  allocations and frees happen on the main thread, so the profiler sees all of them:
  this is the number the estimate is scored against.
- `gloo`: real communication. gloo completes collectives on its worker threads, and when
  one of those drops the last reference to a buffer the free is not in the profiler's
  record (it records the profiling thread only; `profile_all_threads` drops memory
  events), so a rank can appear to keep tens of MiB it freed. Reported beside the fake
  run as a check that the two agree where no free went missing (the smaller rank).

    python benchmarks/fsdp.py [--json results.json] [--rows 0,1,...] [--backends fake,gloo]

Only allocated bytes are checked here: the CPU has no streams, so the GPU's stream pools
(reserved, not allocated) are modelled from the allocator's source (docs/benchmarks.md).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/common.py
from common import MARKER_BYTES, peak_after_marker  # noqa: E402

ROWS = [
    # (name, family, precision, fsdp strategy, version, offload, lora_r)
    ("llama-L4 fp32 FSDP2 full_shard", "llama", "fp32", "full_shard", 2, False, None),
    ("llama-L4 fp32 FSDP2 shard_grad_op", "llama", "fp32", "shard_grad_op", 2, False, None),
    ("llama-L4 fp32 FSDP2 full_shard + CPU offload", "llama", "fp32", "full_shard", 2, True, None),
    ("llama-L4 bf16-mixed FSDP2 full_shard", "llama", "bf16-mixed", "full_shard", 2, False, None),
    ("llama-L4 bf16 weights FSDP2 full_shard", "llama", "bf16", "full_shard", 2, False, None),
    ("llama-L4 fp32 FSDP2 full_shard + LoRA r16", "llama", "fp32", "full_shard", 2, False, 16),
    ("gpt2-L4 fp32 FSDP2 full_shard", "gpt2", "fp32", "full_shard", 2, False, None),
    ("llama-L4 QLoRA r16 (NF4, bf16 quant storage) FSDP2 full_shard", "llama", "bf16-mixed", "full_shard", 2, False, 16),
    ("llama-L4 fp32 FSDP1 full_shard", "llama", "fp32", "full_shard", 1, False, None),
    ("llama-L4 fp32 FSDP1 shard_grad_op", "llama", "fp32", "shard_grad_op", 1, False, None),
    ("llama-L4 fp32 FSDP1 no_shard", "llama", "fp32", "no_shard", 1, False, None),
]
# FSDP1 with CPU offload does not run on a CPU-only torch: FlatParamHandle pins the host shard
# (`_local_shard.pin_memory()`), which needs an accelerator; FSDP2 takes CPUOffloadPolicy(pin_memory=False).
CONFIGS = {
    "gpt2": dict(model_type="gpt2", n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=256,
                 bos_token_id=0, eos_token_id=0),
    "llama": dict(model_type="llama", num_hidden_layers=4, hidden_size=256, intermediate_size=688,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=8192, max_position_embeddings=512,
                  tie_word_embeddings=False),
}
BATCH, SEQ, STEPS, WORLD = 2, 128, 3, 2


def settings_for(row: tuple, mode: str = "fast"):
    from hf_memfit.settings import TrainSettings

    name, family, precision, strategy, version, offload, lora_r = row
    qlora = "QLoRA" in name
    return TrainSettings(batch_size=BATCH, seq_len=SEQ, precision=precision, optim="adamw_torch", device="cpu",
                         num_gpus=WORLD, fsdp=strategy, fsdp_version=version, fsdp_offload=offload, lora_r=lora_r,
                         attn_implementation="sdpa", mode=mode, task="causal-lm", load_in_4bit=qlora,
                         bnb_4bit_quant_storage="bfloat16" if qlora else None)


def build_4bit(folder: str, settings):
    """The QLoRA model as peft's FSDP recipe loads it: NF4 with double quantisation stored in bf16, LoRA on top.

    bitsandbytes quantizes on load, so the tiny checkpoint in `folder` is loaded with its CPU backend.
    """
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    quant = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=settings.bnb_4bit_use_double_quant,
        bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, quantization_config=quant,
                                                              attn_implementation="sdpa")
    model = get_peft_model(model, LoraConfig(r=settings.lora_r, task_type="CAUSAL_LM"))
    model.train()
    return model


def wrap(model, settings):
    """Shard `model` the way accelerate 1.15 does for the settings' FSDP version."""
    import torch

    from hf_memfit.estimator.step import torch_dtype

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


def measure(config: dict, settings) -> int:
    """This rank's allocator peak over STEPS optimizer steps of an FSDP run of `config` under `settings`."""
    import torch
    import torch.distributed as dist
    from hf_memfit.estimator.measure import profiled_allocations

    from hf_memfit.estimator import step as training

    checkpoint = None
    if settings.load_in_4bit:  # saved before the process group exists (transformers saves on the main rank only)
        import transformers

        checkpoint = tempfile.mkdtemp(prefix="fsdp-qlora-")
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config)).save_pretrained(checkpoint)
    if os.environ["MEMFIT_BACKEND"] == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=int(os.environ["RANK"]), world_size=WORLD)
    else:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    with profiled_allocations() as prof:
        built = build_4bit(checkpoint, settings) if checkpoint else training.build_model(config, settings)
        model = wrap(built, settings)
        optimizer = training.make_optimizer(model, settings)
        marker = torch.empty(MARKER_BYTES, dtype=torch.uint8)  # allocated and freed: the steps start here
        del marker
        for _ in range(STEPS):
            torch.manual_seed(1 + dist.get_rank())
            batch = training.make_batch(settings, config)
            training.forward_backward(model, batch, settings, device_type="cpu")
            del batch
            training.optimizer_step(model, optimizer)
    peak = peak_after_marker(prof)
    dist.destroy_process_group()
    return peak


def predict(row: tuple, mode: str) -> int:
    from hf_memfit.estimator.assemble import estimate_settings
    from hf_memfit.models.spec import ModelSpec

    spec = ModelSpec.from_config(f"{row[1]}-small", dict(CONFIGS[row[1]]))
    est = estimate_settings(spec, settings_for(row, mode))
    return est.device_total_bytes + est.cpu_bytes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_row(config: dict, settings, backend: str = "fake", timeout: int = 900) -> list[int]:
    """Launch WORLD ranks of `config` under `settings` over `backend`; return each rank's measured peak."""
    port = str(_free_port())
    with tempfile.TemporaryDirectory() as out:
        job = os.path.join(out, "job.json")
        with open(job, "w") as handle:
            json.dump({"config": config, "settings": settings.replace(mode="fast").to_dict()}, handle)
        procs = []
        for rank in range(WORLD):
            env = os.environ | {"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
                                "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "MEMFIT_BACKEND": backend}
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--job", job], env=env,
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
    parser.add_argument("--backends", default="fake,gloo", help="process groups to run each row over (fake is scored)")
    parser.add_argument("--rows", help="comma-separated row indices (default: all)")
    parser.add_argument("--rescore", metavar="JSON", help="re-predict the measurements stored in JSON (no runs)")
    parser.add_argument("--job", help=argparse.SUPPRESS)  # child process: measure one rank of a job
    args = parser.parse_args(argv)
    if args.job is not None:
        from hf_memfit.settings import TrainSettings

        with open(args.job) as handle:
            job = json.load(handle)
        settings = job["settings"]
        settings["lora_target_modules"] = tuple(settings["lora_target_modules"] or ()) or None
        peak = measure(job["config"], TrainSettings(**settings))
        with open(os.path.join(os.path.dirname(args.job), f"rank{os.environ['RANK']}.json"), "w") as handle:
            json.dump({"peak": peak}, handle)
        return 0
    import torch
    import transformers

    print(f"# FSDP layouts vs real PyTorch FSDP on the CPU (gloo, {WORLD} ranks); torch {torch.__version__}, "
          f"transformers {transformers.__version__}; batch {BATCH} x seq {SEQ}, each rank's peak over {STEPS} steps")
    backends = args.backends.split(",")
    print("| layout | " + " | ".join(f"{b} MiB, rank 0 / rank 1" for b in backends)
          + " | fast MiB | fast err | exact MiB | exact err |")
    print("|---|" + "---:|" * (len(backends) + 4))
    indices = [int(i) for i in args.rows.split(",")] if args.rows else range(len(ROWS))
    stored = {}
    if args.rescore:
        with open(args.rescore) as handle:
            stored = {r["row"]: r for r in json.load(handle)["rows"] if "error" not in r}
        indices = [i for i in indices if ROWS[i][0] in stored]
    results = []
    for index in indices:
        row = ROWS[index]
        started = time.perf_counter()
        result = {"row": row[0]}
        try:
            for backend in backends:
                result[f"{backend}_bytes_per_rank"] = (stored[row[0]][f"{backend}_bytes_per_rank"] if stored else
                                                       run_row(dict(CONFIGS[row[1]]), settings_for(row), backend))
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            print(f"| {row[0]} | failed: {str(error)[-300:]!r} |")
            results.append({"row": row[0], "error": str(error)[-2000:]})
            continue
        scored = result[f"{backends[0]}_bytes_per_rank"]
        measured = max(scored) if backends[0] == "fake" else min(scored)
        fast, exact = predict(row, "fast"), predict(row, "exact")
        result.update({"measured_bytes": measured, "measured_with": backends[0], "fast_bytes": fast,
                       "exact_bytes": exact, "fast_error": fast / measured - 1, "exact_error": exact / measured - 1,
                       "seconds": round(time.perf_counter() - started, 1)})
        results.append(result)
        cells = [" / ".join(f"{v / 2**20:.2f}" for v in result[f"{b}_bytes_per_rank"]) for b in backends]
        print(f"| {row[0]} | " + " | ".join(cells) + f" | {fast / 2**20:.2f} | {100 * result['fast_error']:+.2f}% | "
              f"{exact / 2**20:.2f} | {100 * result['exact_error']:+.2f}% |", flush=True)
    for mode in ("fast", "exact"):
        errors = [abs(r[f"{mode}_error"]) for r in results if f"{mode}_error" in r]
        if errors:
            print(f"{mode} mode: median |err| {100 * sorted(errors)[len(errors) // 2]:.2f}%, "
                  f"max {100 * max(errors):.2f}% over {len(errors)} rows")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rows": results, "torch": torch.__version__}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

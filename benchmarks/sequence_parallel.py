"""Ulysses sequence parallelism against real DeepSpeed: each rank's measured peak vs the plan, on the CPU.

DeepSpeed 0.19's Ulysses (`UlyssesSPAttentionHF`, `UlyssesSPDataLoaderAdapter`) trains through the HF
Trainer on the CPU in 2 processes, with accelerate 1.15's `ParallelismConfig(sp_size=2,
sp_backend="deepspeed")` and DeepSpeed's CPU accelerator (`DS_ACCELERATOR=cpu`). Each row launches 2
processes (torchrun-style environment) that build a small Llama, hand it to `MemFitTrainer` (or
`MemFitSFTTrainer`) with a DeepSpeed config carrying `sequence_parallel_size`, and train STEPS optimizer
steps under the PyTorch profiler. The trainer plans with the run's sequence split (introspect.py reads
`parallelism_config`) and logs its prediction; the row compares that prediction (`device_total_bytes +
cpu_bytes`: on the CPU device and host are one memory) with each rank's allocator peak over the steps
(model creation and DeepSpeed's setup count as live bytes but not as peaks: a marker allocation at
`on_train_begin` separates them).

Two process-group backends, as in benchmarks/fsdp.py:
- `fake` (torch's FakeProcessGroup): DeepSpeed's and the Trainer's real code and every buffer they
  allocate, with collectives that move no data. All frees happen on the main thread, so the profiler
  sees all of them: this is the number the estimate is scored against.
- `gloo`: real communication (the all-to-alls really exchange heads). gloo drops its references to
  collective buffers on its worker threads, and the profiler records the main thread only, so a rank
  appears to keep buffers it freed; reported beside the fake run, with the trainer's own measurement
  (`memfit/measured_peak_bytes`: a storage tracker that sees frees on any thread).

    python benchmarks/sequence_parallel.py [--json results.json] [--rows 0,1] [--backends fake,gloo]
    python benchmarks/sequence_parallel.py --published [--json published.json]

`--published` compares the estimate with published GPU figures instead (no run): the Hugging Face blog's
Ulysses table (Qwen3-4B on 4 x H100) and the sequence lengths of ALST's Llama-8B recipes on 8 x H100
(snowflakedb/ArcticTraining, projects/sequence-parallelism), in fast and exact mode.

Context parallelism is not measured: see docs/benchmarks.md, section 14 (`--cp` tries it and records why).
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

LLAMA = dict(model_type="llama", num_hidden_layers=4, hidden_size=256, intermediate_size=688,
             num_attention_heads=8, num_key_value_heads=2, vocab_size=8192, max_position_embeddings=512,
             tie_word_embeddings=False)
ROWS = [
    # (name, trainer, seq_len, zero_stage, precision, gradient checkpointing, memory budget)
    ("llama-L4 SP2 ZeRO-1 seq 1024", "trainer", 1024, 1, "fp32", False, "8GiB"),
    ("llama-L4 SP2 ZeRO-1 seq 4096", "trainer", 4096, 1, "fp32", False, "8GiB"),
    ("llama-L4 SP2 ZeRO-2 seq 2048", "trainer", 2048, 2, "fp32", False, "8GiB"),
    ("llama-L4 SP2 ZeRO-3 seq 2048", "trainer", 2048, 3, "fp32", False, "8GiB"),
    # a budget the step without checkpointing (420 MiB predicted) misses, so the plan turns checkpointing on
    ("llama-L4 SP2 ZeRO-1 seq 4096, checkpointing", "trainer", 4096, 1, "fp32", True, "350MiB"),
    ("llama-L4 SP2 ZeRO-1 seq 2048, TRL SFTTrainer", "sft", 2048, 1, "fp32", False, "8GiB"),
]
WORLD, SP, STEPS = 2, 2, 3


def _dataset(seq: int, rows: int = 32, arrow: bool = False):
    import torch

    if arrow:  # TRL's SFTTrainer takes a `datasets.Dataset` (already tokenized: it skips its own preparation)
        import datasets

        ids = [torch.randint(0, LLAMA["vocab_size"], (seq,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(rows)]
        return datasets.Dataset.from_dict({"input_ids": ids, "position_ids": [list(range(seq))] * rows})

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return rows

        def __getitem__(self, i):
            ids = torch.randint(0, LLAMA["vocab_size"], (seq,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(seq)}

    return Rows()


def measure(row: tuple, out: str) -> None:
    """One rank of the row: train STEPS steps with MemFitTrainer under SP; write the peak and the plan's figures."""
    import torch
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback

    name, trainer_kind, seq, stage, precision, checkpointing, budget = row
    if os.environ["MEMFIT_BACKEND"] == "fake":
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=int(os.environ["RANK"]), world_size=WORLD)
    hidden = LLAMA["hidden_size"]
    zero = {"stage": stage, "reduce_bucket_size": hidden * hidden, "allgather_bucket_size": hidden * hidden}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=int(0.9 * hidden * hidden), stage3_param_persistence_threshold=10 * hidden)
    deepspeed = {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
                 "sequence_parallel_size": SP}
    parallelism = ParallelismConfig(sp_size=SP, sp_backend="deepspeed",
                                    sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"))
    common = dict(output_dir=os.path.join(out, "run"), per_device_train_batch_size=1, max_steps=STEPS, report_to=[],
                  ddp_backend="gloo", deepspeed=deepspeed, parallelism_config=parallelism, logging_steps=1,
                  save_strategy="no", optim="adamw_torch", gradient_checkpointing=checkpointing,
                  memory_budget=budget, keep_optimizer=True, dataloader_num_workers=0)
    records = {}

    class Marker(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            marker = torch.empty(MARKER_BYTES, dtype=torch.uint8)  # the steps start here
            del marker

        def on_log(self, args, state, control, logs=None, **kwargs):
            records.update({k: v for k, v in (logs or {}).items() if k.startswith("memfit/")})

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    prof.__enter__()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**LLAMA), attn_implementation="sdpa")
    if trainer_kind == "sft":
        from hf_memfit.integrations.trl import MemFitSFTConfig, MemFitSFTTrainer

        args = MemFitSFTConfig(**common, max_length=seq, packing=False, bf16=False, learning_rate=1e-4,
                               dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False)
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}  # a local tokenizer: the rows are already token ids
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                            pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
        trainer = MemFitSFTTrainer(model=model, args=args, train_dataset=_dataset(seq, arrow=True),
                                   processing_class=tokenizer, callbacks=[Marker()])
    else:
        from hf_memfit.integrations.trainer import MemFitArguments, MemFitTrainer

        trainer = MemFitTrainer(model=model, args=MemFitArguments(**common), train_dataset=_dataset(seq),
                                callbacks=[Marker()])
    trainer.train()
    prof.__exit__(None, None, None)
    estimate = trainer.memfit_result.estimate
    s = estimate.settings
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as handle:
        json.dump({"peak": peak_after_marker(prof), "predicted": estimate.device_total_bytes + estimate.cpu_bytes,
                   "settings": s.to_dict(), "trainer_measured": records.get("memfit/measured_peak_bytes"),
                   "trainer_predicted": records.get("memfit/predicted_peak_bytes")}, handle)


def predict(row: tuple, settings: dict, mode: str) -> int:
    """The estimate of the settings the trainer planned, in `mode`."""
    from hf_memfit.estimator.assemble import estimate_settings
    from hf_memfit.models.spec import ModelSpec
    from hf_memfit.settings import TrainSettings

    settings = dict(settings, mode=mode)
    for key in ("lora_target_modules", "optim_target_modules"):
        settings[key] = tuple(settings[key]) if settings[key] else None
    est = estimate_settings(ModelSpec.from_config("llama-small", dict(LLAMA)), TrainSettings(**settings))
    return est.device_total_bytes + est.cpu_bytes


# Qwen/Qwen3-4B's config.json (the catalogue has Qwen3-0.6B, -8B, -14B, -32B): the sizes that matter here.
QWEN3_4B = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 2560,
            "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 40960,
            "rope_theta": 1000000, "rms_norm_eps": 1e-6, "hidden_act": "silu", "torch_dtype": "bfloat16"}
# "Ulysses Sequence Parallelism: Training with Million-Token Contexts", huggingface.co/blog/ulysses-sp (March 2026),
# its benchmark table as relayed by nebelwolfi.xyz/blog/2026-03-10-million-token-training-without-the-memory-wall-a-look-
# at-ulysses-sequence-parall (the primary page was not readable here): Qwen3-4B, 4 x H100 80GB, DeepSpeed ZeRO-3,
# flash_attention_2, SP=4 unless noted; peak memory in GB. Batch 1, gradient checkpointing on and the model's own
# loss are assumptions (the figures' slope, ~1.9 MB per local token, is the fp32 logits' and not TRL's fused head).
HF_BLOG = [  # (seq_len, sp_size, published GB or None for "OOM")
    (8192, 1, 22.4), (8192, 4, 22.8), (65536, 4, 50.5), (98304, 4, 66.0), (131072, 4, None),
]
# ALST's recipes for Llama-3.1-8B-Instruct on one 8 x H100 node (ArcticTraining projects/sequence-parallelism,
# commit 2771b4b): micro-batch 1, DeepSpeed ZeRO-3 with the optimizer offloaded to the CPU (cpu_adam), Liger
# ("type: liger"), flash_attention_2, bf16, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, no tiled MLP and
# no checkpoint offload; `max_length` is the sequence each recipe trains (its maximum, by the recipe's name).
ALST = [  # (recipe, sp_size, max_length)
    ("run-h100-sp8-llama-8b-no-ulysses-yes-liger-no-extras.yml", 1, 160_000),
    ("run-h100-sp8-llama-8b-no-mlp-no-act-offload.yml", 8, 1_100_000),
]


def published(mode_list=("fast", "exact")) -> list[dict]:
    """The estimate beside each published figure (HF blog: memory at a length; ALST: the longest length that fits)."""
    from hf_memfit.errors import MemFitError
    from hf_memfit.estimator.assemble import estimate
    from hf_memfit.hardware import find_gpu
    from hf_memfit.models.spec import ModelSpec, resolve_model

    rows = []
    qwen = ModelSpec.from_config("Qwen/Qwen3-4B", dict(QWEN3_4B))
    capacity = find_gpu("h100").memory_bytes
    for seq, sp, gb in HF_BLOG:
        row = {"source": "HF blog ulysses-sp", "model": "Qwen/Qwen3-4B", "seq_len": seq, "sp_size": sp,
               "published_gb": gb}
        for mode in mode_list:
            est = estimate(qwen, batch_size=1, seq_len=seq, precision="bf16-mixed", optim="adamw_torch_fused",
                           gradient_checkpointing=True, attn_implementation="sdpa", gpu="h100", num_gpus=4,
                           zero_stage=3, sp_size=sp, task="causal-lm", mode=mode)
            row[f"{mode}_allocated_gb"] = est.peak_allocated_bytes / 1e9
            row[f"{mode}_device_total_gb"] = est.device_total_bytes / 1e9
            row[f"{mode}_fits"] = est.device_total_bytes <= capacity
            if gb:
                row[f"{mode}_error"] = est.peak_allocated_bytes / 1e9 / gb - 1
        rows.append(row)
    llama = resolve_model("meta-llama/Llama-3.1-8B")

    def alst(seq, sp, mode):
        return estimate(llama, batch_size=1, seq_len=seq, precision="bf16-mixed", optim="adamw_torch_fused",
                        gradient_checkpointing=True, use_liger_kernel=True, attn_implementation="flash_attention_2",
                        gpu="h100", num_gpus=8, zero_stage=3, offload_optimizer="cpu", sp_size=sp,
                        expandable_segments=True, task="causal-lm", mode=mode)

    for recipe, sp, length in ALST:
        row = {"source": f"ArcticTraining {recipe}", "model": "meta-llama/Llama-3.1-8B", "sp_size": sp,
               "published_max_length": length}
        step = 1024 * sp
        low, high = step, step
        while alst(high, sp, "fast").device_total_bytes <= capacity:  # fast mode: bisect the longest that fits
            low, high = high, 2 * high
        while high - low > step:
            mid = (low + high) // 2 // step * step
            low, high = (mid, high) if alst(mid, sp, "fast").device_total_bytes <= capacity else (low, mid)
        row["fast_max_length"] = low
        row["fast_ratio"] = low / length
        at = length // sp * sp
        for mode in mode_list:
            try:
                est = alst(at, sp, mode)
            except MemFitError as error:
                row[f"{mode}_error_text"] = str(error)
                continue
            row[f"{mode}_device_total_gb_at_published"] = est.device_total_bytes / 1e9
            row[f"{mode}_fits_at_published"] = est.device_total_bytes <= capacity
        rows.append(row)
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_row(index: int, backend: str, timeout: int = 900) -> list[dict]:
    """Launch WORLD ranks of ROWS[index] over `backend`; return each rank's record."""
    port = str(_free_port())
    with tempfile.TemporaryDirectory() as out:
        procs = []
        for rank in range(WORLD):
            env = os.environ | {"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
                                "LOCAL_WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "MEMFIT_BACKEND": backend,
                                "DS_ACCELERATOR": "cpu"}
            procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--job", str(index), "--out", out],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
        records = []
        for rank in range(WORLD):
            path = os.path.join(out, f"rank{rank}.json")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} failed: {logs[rank][-1500:]}")
            with open(path) as handle:
                records.append(json.load(handle))
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--backends", default="fake,gloo", help="process groups to run each row over (fake is scored)")
    parser.add_argument("--rows", help="comma-separated row indices (default: all)")
    parser.add_argument("--published", action="store_true", help="compare with published GPU figures (no runs)")
    parser.add_argument("--job", type=int, help=argparse.SUPPRESS)  # child process: one rank of a row
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job is not None:
        measure(ROWS[args.job], args.out)
        return 0
    if args.published:
        rows = published()
        for row in rows:
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"published": rows}, handle, indent=2)
        return 0
    import deepspeed
    import torch
    import transformers

    print(f"# Ulysses SP vs real DeepSpeed {deepspeed.__version__} on the CPU ({WORLD} ranks, sp {SP}); torch "
          f"{torch.__version__}, transformers {transformers.__version__}; each rank's peak over {STEPS} steps")
    backends = args.backends.split(",")
    print("| row | plan | " + " | ".join(f"{b} MiB, rank 0 / rank 1" for b in backends)
          + " | trainer's own measure MiB | fast MiB | fast err | exact MiB | exact err |")
    print("|---|---|" + "---:|" * (len(backends) + 5))
    indices = [int(i) for i in args.rows.split(",")] if args.rows else range(len(ROWS))
    results = []
    for index in indices:
        row = ROWS[index]
        started = time.perf_counter()
        result = {"row": row[0]}
        records = {}
        for backend in backends:
            try:
                records[backend] = run_row(index, backend)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                result[f"{backend}_error"] = str(error)[-2000:]
        if not records:
            print(f"| {row[0]} | failed: {str(result)[-300:]!r} |")
            results.append(result)
            continue
        first = next(iter(records.values()))
        settings = first[0]["settings"]
        for backend in records:
            result[f"{backend}_bytes_per_rank"] = [r["peak"] for r in records[backend]]
        trainer_measured = [r["trainer_measured"] for r in records[list(records)[-1]]]
        if "fake" in records:
            measured, measured_with = max(result["fake_bytes_per_rank"]), "fake"
        else:
            # ZeRO-3 does not run on the fake process group (its parameter gathers compare lengths across ranks):
            # the trainer's own tracker, which agrees with the fake run's profiler within 0.1% on the other rows
            measured, measured_with = max(trainer_measured), "trainer's tracker (gloo)"
        fast, exact = predict(row, settings, "fast"), predict(row, settings, "exact")
        result.update({"measured_bytes": measured, "measured_with": measured_with, "plan_bytes": first[0]["predicted"],
                       "fast_bytes": fast, "exact_bytes": exact, "fast_error": fast / measured - 1,
                       "exact_error": exact / measured - 1, "trainer_measured_bytes": trainer_measured,
                       "trainer_predicted_bytes": first[0]["trainer_predicted"], "settings": settings,
                       "seconds": round(time.perf_counter() - started, 1)})
        results.append(result)
        plan = (f"micro {settings['batch_size']}, {'ckpt' if settings['gradient_checkpointing'] else 'no ckpt'}, "
                f"ZeRO-{settings['zero_stage']}, sp {settings['sp_size']}")
        cells = [" / ".join(f"{v / 2**20:.2f}" for v in result[f"{b}_bytes_per_rank"]) if b in records else "fails"
                 for b in backends]
        own = " / ".join(f"{v / 2**20:.2f}" if v else "-" for v in trainer_measured)
        print(f"| {row[0]} | {plan} | " + " | ".join(cells) + f" | {own} | {fast / 2**20:.2f} | "
              f"{100 * result['fast_error']:+.2f}% | {exact / 2**20:.2f} | {100 * result['exact_error']:+.2f}% |",
              flush=True)
    for mode in ("fast", "exact"):
        errors = [abs(r[f"{mode}_error"]) for r in results if f"{mode}_error" in r]
        if errors:
            print(f"{mode} mode: median |err| {100 * sorted(errors)[len(errors) // 2]:.2f}%, "
                  f"max {100 * max(errors):.2f}% over {len(errors)} rows")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rows": results, "torch": torch.__version__, "deepspeed": deepspeed.__version__}, handle,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

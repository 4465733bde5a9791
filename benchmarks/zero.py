"""ZeRO layouts against real DeepSpeed: predicted vs measured peak of a training step, on the CPU.

DeepSpeed 0.19 trains in one process on the CPU with the same ZeRO code it runs on
GPUs (its CPU accelerator), so the buffers `hf_memfit.estimator.sharding` models (the model in
the compute dtype, the fp32 master partition, optimizer states, gradient partitions,
reduce buckets, offload copies) are real allocations here. Each row builds a small
model, wraps it with `deepspeed.initialize` using the config `hf_memfit.planner.deepspeed`
writes for that layout (its "auto" values filled as the HF Trainer would), runs three
training steps under the PyTorch profiler, and takes the allocator's peak over the
steps (model creation and DeepSpeed's initialisation excluded: a marker allocation
separates them). On the CPU, "device" and "host" are one memory, so the prediction
compared is `device_total_bytes + cpu_bytes`.

    python benchmarks/zero.py [--json results.json] [--repeats 3]

Each row runs in its own process (DeepSpeed keeps process-wide state).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/common.py
from common import MARKER_BYTES, peak_after_marker  # noqa: E402

ROWS = [
    # (name, catalogue-family config overrides, precision, zero_stage, offload_optimizer, offload_param)
    ("gpt2-L4 fp32 ZeRO-1", "gpt2", "fp32", 1, "none", "none"),
    ("gpt2-L4 fp32 ZeRO-2", "gpt2", "fp32", 2, "none", "none"),
    ("gpt2-L4 fp32 ZeRO-3", "gpt2", "fp32", 3, "none", "none"),
    ("gpt2-L4 fp32 ZeRO-2 + optimizer offload", "gpt2", "fp32", 2, "cpu", "none"),
    ("gpt2-L4 fp32 ZeRO-3 + optimizer & param offload", "gpt2", "fp32", 3, "cpu", "cpu"),
    ("llama-gqa-L4 bf16 ZeRO-2", "llama", "bf16-mixed", 2, "none", "none"),
    ("llama-gqa-L4 bf16 ZeRO-3", "llama", "bf16-mixed", 3, "none", "none"),
    ("llama-gqa-L4 bf16 ZeRO-3 + optimizer offload", "llama", "bf16-mixed", 3, "cpu", "none"),
]
CONFIGS = {
    "gpt2": dict(model_type="gpt2", n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=256,
                 bos_token_id=0, eos_token_id=0),
    "llama": dict(model_type="llama", num_hidden_layers=4, hidden_size=256, intermediate_size=688,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=8192, max_position_embeddings=512),
}
BATCH, SEQ, STEPS = 2, 128, 3


def measure(row: tuple) -> int:
    """Run the row's three DeepSpeed steps; return the allocator's peak over them (in this process)."""
    import deepspeed
    import torch
    from hf_memfit.estimator.measure import profiled_allocations
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_memfit.planner.deepspeed import deepspeed_config

    name, family, precision, stage, offload_optimizer, offload_param = row
    config = dict(CONFIGS[family])
    hidden = config.get("n_embd") or config["hidden_size"]
    bf16 = precision.startswith("bf16")
    ds = deepspeed_config(stage, offload_optimizer, offload_param, precision=precision)
    # The "auto" values, as transformers' HfTrainerDeepSpeedConfig fills them.
    zero = ds["zero_optimization"]
    zero["reduce_bucket_size"] = hidden * hidden
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = int(0.9 * hidden * hidden)
        zero["stage3_param_persistence_threshold"] = 10 * hidden
    ds.update(train_micro_batch_size_per_gpu=BATCH, gradient_accumulation_steps=1, train_batch_size=BATCH,
              gradient_clipping=1.0, bf16={"enabled": bf16}, fp16={"enabled": False})
    if "optimizer" in ds:  # DeepSpeedCPUAdam for offload
        ds["optimizer"]["params"] = dict(lr=1e-4, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0)
    torch.manual_seed(0)
    with profiled_allocations() as prof:
        hf_config = AutoConfig.for_model(**config)
        if stage == 3:  # the Trainer builds ZeRO-3 models under zero.Init, partitioned from the start
            with deepspeed.zero.Init(config_dict_or_path=ds):
                model = AutoModelForCausalLM.from_config(hf_config)
        else:
            model = AutoModelForCausalLM.from_config(hf_config)
        params = list(model.parameters())
        # Without an optimizer section the HF Trainer builds its torch AdamW and DeepSpeed wraps it.
        optimizer = None if "optimizer" in ds else torch.optim.AdamW(params, lr=1e-4)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds, model_parameters=params)
        marker = torch.empty(MARKER_BYTES, dtype=torch.uint8)  # allocated and freed: the steps start here
        del marker
        for _ in range(STEPS):
            ids = torch.randint(0, config["vocab_size"], (BATCH, SEQ))
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
    return peak_after_marker(prof)


def predict(row: tuple, mode: str) -> int:
    from hf_memfit.estimator.assemble import estimate
    from hf_memfit.models.spec import ModelSpec

    name, family, precision, stage, offload_optimizer, offload_param = row
    spec = ModelSpec.from_config(f"{family}-small", CONFIGS[family])
    est = estimate(spec, batch_size=BATCH, seq_len=SEQ, precision=precision, optim="adamw_torch", device="cpu",
                   zero_stage=stage, offload_optimizer=offload_optimizer, offload_param=offload_param, mode=mode)
    return est.device_total_bytes + est.cpu_bytes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--repeats", type=int, default=3, help="real runs per row (the median is compared)")
    parser.add_argument("--row", type=int, help=argparse.SUPPRESS)  # child process: measure one row
    args = parser.parse_args(argv)
    if args.row is not None:
        print("MEASURED", measure(ROWS[args.row]), flush=True)
        return 0
    import deepspeed
    import torch
    import transformers

    print(f"# ZeRO layouts vs real DeepSpeed {deepspeed.__version__} on the CPU; torch {torch.__version__}, "
          f"transformers {transformers.__version__}; batch {BATCH} x seq {SEQ}, peak over {STEPS} steps, "
          f"median of {args.repeats} runs")
    print("| layout | measured MiB (range) | fast MiB | fast err | exact MiB | exact err |")
    print("|---|---:|---:|---:|---:|---:|")
    results = []
    for index, row in enumerate(ROWS):
        env = os.environ | {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "PYTHONWARNINGS": "ignore"}
        started = time.perf_counter()
        runs = []
        for _ in range(args.repeats):  # ZeRO-3's prefetch and release timing varies from run to run
            env["MASTER_PORT"] = str(_free_port())
            proc = subprocess.run([sys.executable, __file__, "--row", str(index)], env=env, capture_output=True,
                                  text=True, timeout=1200)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("MEASURED ")]
            if proc.returncode or not lines:
                print(f"{row[0]}: failed (rc={proc.returncode}): {(proc.stdout + proc.stderr)[-400:]}")
                break
            runs.append(int(lines[0].split()[1]))
        if len(runs) < args.repeats:
            results.append({"row": row[0], "error": "a run failed"})
            continue
        measured = sorted(runs)[len(runs) // 2]
        fast, exact = predict(row, "fast"), predict(row, "exact")
        result = {"row": row[0], "measured_bytes": measured, "measured_runs": runs, "fast_bytes": fast,
                  "exact_bytes": exact, "fast_error": fast / measured - 1, "exact_error": exact / measured - 1,
                  "seconds": round(time.perf_counter() - started, 1)}
        results.append(result)
        spread = f"{min(runs) / 2**20:.1f}-{max(runs) / 2**20:.1f}"
        print(f"| {row[0]} | {measured / 2**20:.2f} ({spread}) | {fast / 2**20:.2f} | {100 * result['fast_error']:+.2f}% "
              f"| {exact / 2**20:.2f} | {100 * result['exact_error']:+.2f}% |")
    for mode in ("fast", "exact"):
        errors = [abs(r[f"{mode}_error"]) for r in results if f"{mode}_error" in r]
        if errors:
            print(f"{mode} mode: median |err| {100 * sorted(errors)[len(errors) // 2]:.2f}%, "
                  f"max {100 * max(errors):.2f}% over {len(errors)} rows")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rows": results, "deepspeed": deepspeed.__version__, "torch": torch.__version__}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

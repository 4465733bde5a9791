"""LLM.int8() + LoRA on the CPU: a real bitsandbytes 0.50 int8 model's step against both modes.

bitsandbytes runs int8 training on the CPU through `MatMul8bitFp` (dequantise, then matmul), not the CUDA
`MatMul8bitLt`; the estimate is asked for `--device cpu`, which models that path (estimator/int8.py).
Usage: PYTHONPATH=. python benchmarks/int8_cpu.py
"""

import sys

import torch

sys.path.insert(0, "tests")
from conftest import TINY_LLAMA  # noqa: E402

from hf_memfit.estimator import step as training  # noqa: E402
from hf_memfit.estimator.assemble import step_memory  # noqa: E402
from hf_memfit.estimator.measure import allocator_peak, bitsandbytes_build, profiled_allocations  # noqa: E402
from hf_memfit.models.spec import ModelSpec  # noqa: E402
from hf_memfit.settings import TrainSettings  # noqa: E402


def real_int8_model(config: dict, settings: TrainSettings):
    """bitsandbytes' own Linear8bitLt layers, loaded as `from_pretrained` quantises a checkpoint (the path
    `hf-memfit check --load-in-8bit` measures: estimator/measure.bitsandbytes_build), with peft's preparation,
    checkpointing and the LoRA adapters added by `build_model`."""
    with bitsandbytes_build(settings, "cpu"):
        return training.build_model(config, settings)


def resident_bytes(model) -> int:
    """Parameters and buffers, once per storage, plus each Linear8bitLt's SCB (module state, not a parameter)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    for module in model.modules():
        scb = getattr(getattr(module, "state", None), "SCB", None)
        if scb is None:
            scb = getattr(getattr(module, "weight", None), "SCB", None)
        if scb is not None and scb.untyped_storage().data_ptr() not in seen:
            seen.add(scb.untyped_storage().data_ptr())
            total += scb.untyped_storage().nbytes()
    return total


def measure(config: dict, settings: TrainSettings) -> tuple[int, int, dict]:
    torch.manual_seed(0)
    model = real_int8_model(config, settings)
    resident = resident_bytes(model)
    dtypes = {}
    for name, p in model.named_parameters():
        dtypes.setdefault(str(p.dtype), 0)
        dtypes[str(p.dtype)] += p.numel()
    with profiled_allocations() as prof:
        optimizer = training.make_optimizer(model, settings)
        for _ in range(2):
            batch = training.make_batch(settings, config)
            training.forward_backward(model, batch, settings, device_type="cpu")
            del batch
            training.optimizer_step(model, optimizer)
        del optimizer
    return resident + allocator_peak(prof), resident, dtypes


def main():
    config = dict(TINY_LLAMA, max_position_embeddings=2048)
    spec = ModelSpec.from_config("tiny-llama", config)
    print("| prepared | checkpointing | measured | exact | fast | exact err | fast err |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for prepared in (True, False):
        for gc in (True, False):
            s = TrainSettings(device="cpu", batch_size=2, seq_len=256, precision="bf16", load_in_8bit=True, lora_r=8,
                              gradient_checkpointing=gc, prepare_model_for_kbit_training=prepared).validate(spec)
            measured, resident, dtypes = measure(config, s)
            exact = step_memory(spec, s.replace(mode="exact"))
            fast = step_memory(spec, s)
            from hf_memfit.estimator.sharding import shard
            e = shard(exact, s, config["hidden_size"]).candidates
            f = shard(fast, s, config["hidden_size"]).candidates
            ep, fp = max(sum(b.values()) for b in e.values()), max(sum(b.values()) for b in f.values())
            ew = max(b["weights"] for b in e.values())
            print(f"| {prepared} | {gc} | {measured:,} | {ep:,} | {fp:,} | {(ep - measured) / measured:+.1%} | "
                  f"{(fp - measured) / measured:+.1%} |  resident {resident:,} vs estimated weights {ew:,}; {dtypes}")


if __name__ == "__main__":
    main()

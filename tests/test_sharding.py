"""Model states under DeepSpeed ZeRO, as DeepSpeed 0.19 lays them out (runtime/zero/stage_1_and_2.py, stage3.py)."""

import pytest

from hf_memfit.estimator.assemble import estimate, traced_settings
from hf_memfit.settings import TrainSettings
from hf_memfit.estimator.sharding import SUB_GROUP_SIZE

MODEL = "gpt2-xl"
STEP = dict(batch_size=1, seq_len=256, precision="bf16-mixed", gradient_checkpointing=True)


def zero(**changes):
    return estimate(MODEL, **STEP, **changes)


def optimizer_region(est) -> bool:
    return est.peak_region.endswith("|opt")


def test_zero_traces_the_step_in_the_compute_dtype():
    # DeepSpeed casts the model to bf16 and runs it without autocast: no fp32 weights,
    # no autocast weight cache, so a ZeRO step is traced as a pure-bf16 step.
    settings = TrainSettings(**STEP, zero_stage=2)
    assert traced_settings(settings).precision == "bf16"
    assert traced_settings(settings.replace(zero_stage=0)).precision == "bf16-mixed"
    assert traced_settings(settings.replace(precision="fp32")).precision == "fp32"


def test_zero_model_states_per_stage():
    plain = zero(num_gpus=4)
    params = plain.total_params
    stage1, stage2, stage3 = (zero(num_gpus=4, zero_stage=s) for s in (1, 2, 3))
    # fp32 master + AdamW's two fp32 states on a flat partition: 12 B per param / 4 ranks
    for est in (stage1, stage2, stage3):
        assert est.breakdown["optimizer"] == pytest.approx(12 * params / 4, rel=1e-3)
    # in the backward (ZeRO-1/2 free the low-precision partition once the step's fp32 copy exists)
    assert backward(stage1)["gradients"] == 2 * params  # whole bf16 grads until the boundary
    assert backward(stage2)["gradients"] == pytest.approx(2 * params / 4, rel=1e-3)  # grads_in_partition
    assert backward(stage3)["gradients"] == pytest.approx(2 * params / 4, rel=1e-3)  # grad_partitions_flat_buffer
    assert step(stage2)["gradients"] == 0 and step(stage3)["gradients"] == backward(stage3)["gradients"]
    assert stage2.breakdown["weights"] == 2 * params  # bf16 model, whole
    assert 2 * params / 4 < backward(stage3)["weights"] < backward(stage2)["weights"]  # partition + gathered layers
    assert step(stage3)["weights"] == 2 * params // 4  # nothing is gathered for the optimizer step


def test_fp32_master_copy_is_counted_for_fp32_models_too():
    # stage_1_and_2.py clones the partition with .float() whatever the model dtype.
    est = estimate(MODEL, batch_size=1, seq_len=256, precision="fp32", num_gpus=2, zero_stage=2)
    assert est.breakdown["optimizer"] == pytest.approx(12 * est.trainable_params / 2, rel=1e-3)


def test_optimizer_offload_keeps_gradients_on_the_host():
    on_device = zero(zero_stage=2)
    offloaded = zero(zero_stage=2, offload_optimizer="cpu")
    # ZeRO-2 + offload: reduced grads go to pinned host buffers through one staging
    # buffer the size of the largest parameter (temp_grad_buffer_for_gpu_offload).
    assert offloaded.breakdown["optimizer"] == 0
    assert backward(offloaded)["gradients"] == 2 * 50257 * 1600  # the largest tensor (wte) in bf16
    assert backward(on_device)["gradients"] == 2 * on_device.trainable_params  # one rank: the whole partition
    # Host: fp32 master + CPU-Adam states + fp32 grads + the bf16 accumulation buffer = 18 B/param.
    assert offloaded.cpu_bytes == pytest.approx(18 * offloaded.trainable_params, rel=1e-3)
    # ZeRO-3 + offload: self.device is the CPU, so the flat gradient buffer lives there.
    zero3 = zero(zero_stage=3, offload_optimizer="cpu")
    assert zero3.breakdown["gradients"] == 0 and zero3.breakdown["optimizer"] == 0


def test_parameter_offload_moves_the_partition_to_the_host():
    kept = zero(zero_stage=3, offload_optimizer="cpu")
    moved = zero(zero_stage=3, offload_optimizer="cpu", offload_param="cpu")
    partition = 2 * kept.total_params
    assert kept.breakdown["weights"] - moved.breakdown["weights"] == partition
    assert moved.cpu_bytes - kept.cpu_bytes == partition
    nvme = zero(zero_stage=3, offload_optimizer="nvme", offload_param="nvme")
    assert nvme.nvme_bytes == pytest.approx((12 + 2) * nvme.trainable_params, rel=1e-3)  # master + states + params


def test_zero3_step_converts_one_sub_group_at_a_time():
    # _prepare_fp32_grad_for_sub_group: the fp32 copy of one sub_group_size group, not the whole partition;
    # fused AdamW adds no temporaries, foreach AdamW (torch's CUDA default) one state-sized _foreach_sqrt.
    request = dict(batch_size=1, seq_len=512, precision="bf16-mixed", num_gpus=2, zero_stage=3,
                   gradient_checkpointing=True, gpu="h100")
    for optim, temporaries in (("adamw_torch_fused", 0), ("adamw_torch", 4 * SUB_GROUP_SIZE)):
        est = estimate("meta-llama/Llama-2-70b-hf", optim=optim, **request)
        opt = [c for r, c in _candidates(est).items() if r.endswith("|opt")][0]
        assert opt["temporary"] == 4 * SUB_GROUP_SIZE + temporaries, optim


def backward(est) -> dict:
    """Bytes by category in the backward of the first layer, once gradient partitions exist."""
    return next(c for r, c in _candidates(est).items() if r.endswith("|bwd|s0.first"))


def step(est) -> dict:
    return next(c for r, c in _candidates(est).items() if r.endswith("|opt"))


def _candidates(est):
    from hf_memfit.estimator.assemble import step_memory
    from hf_memfit.estimator.sharding import shard
    from hf_memfit.models.spec import resolve_model

    spec = resolve_model(est.model)
    return shard(step_memory(spec, est.settings), est.settings, spec.hidden_size).candidates


def test_reduce_buckets_double_buffered_only_for_zero_1_and_2():
    h = 1600  # gpt2-xl; reduce_bucket_size "auto" = h^2 bf16 elements
    # The sharded candidates carry the buckets as overhead; the CUDA context and allocator come later.
    stage2 = _candidates(zero(num_gpus=2, zero_stage=2))
    stage3 = _candidates(zero(num_gpus=2, zero_stage=3))
    assert max(c["overhead"] for c in stage2.values()) == 2 * h * h * 2  # setup_buckets: buf_0 + buf_1
    assert max(c["overhead"] for c in stage3.values()) == 1 * h * h * 2  # one ipg buffer per dtype


def test_paged_optimizer_states_leave_the_device_only_on_cuda():
    # bitsandbytes falls back to non-paged states on the CPU ("Paged optimizers are not supported on CPU").
    cuda = estimate(MODEL, batch_size=1, seq_len=256, optim="paged_adamw_8bit")
    cpu = estimate(MODEL, batch_size=1, seq_len=256, optim="paged_adamw_8bit", device="cpu")
    plain = estimate(MODEL, batch_size=1, seq_len=256, optim="adamw_bnb_8bit", device="cpu")
    assert cuda.cpu_bytes > 0 and cuda.breakdown["optimizer"] == 0
    assert cpu.cpu_bytes == 0 and cpu.device_total_bytes == plain.device_total_bytes

"""Exact mode against the CPU allocator's real peak, on tiny models built from configs."""

import pytest

from hf_memfit.measure import measure_cpu_peak
from hf_memfit.settings import TrainSettings
from hf_memfit.trace import exact_candidates, trace_step

CASES = [
    ("gpt2", {}),
    ("gpt2", {"precision": "bf16-mixed"}),
    ("gpt2", {"lora_r": 4}),
    ("gpt2", {"gradient_accumulation_steps": 3, "optim": "adamw_torch_fused"}),
    ("llama", {"precision": "bf16", "gradient_checkpointing": True}),
    ("llama", {"optim": "adafactor"}),
    ("llama", {"optim": "sgd", "attn_implementation": "eager"}),
    ("t5", {}),
    ("bert", {"task": "seq-cls"}),
]


@pytest.mark.parametrize("model,changes", CASES, ids=[f"{m}-{'-'.join(f'{k}={v}' for k, v in c.items()) or 'default'}"
                                                      for m, c in CASES])
def test_exact_matches_the_cpu_allocator(tiny_specs, model, changes):
    spec = tiny_specs[model]
    settings = TrainSettings(batch_size=2, seq_len=32, device="cpu", mode="exact", **changes).validate(spec)
    predicted = exact_candidates(spec, settings).peak_bytes  # 5 layers: traced at 2 and 3, extrapolated
    measured = measure_cpu_peak(spec.config, settings)
    assert abs(predicted - measured) / measured < 0.01, (predicted, measured)


def test_layer_extrapolation_equals_a_full_trace(tiny_specs):
    spec = tiny_specs["llama"]
    settings = TrainSettings(batch_size=2, seq_len=32, device="cuda", precision="bf16-mixed").validate(spec)
    extrapolated = exact_candidates(spec, settings).peak_bytes
    full = exact_candidates(spec, settings, extrapolate=False).peak_bytes
    assert abs(extrapolated - full) <= 0.001 * full


def test_cuda_attention_keeps_no_quadratic_scores(tiny_specs):
    """On CUDA, SDPA's flash kernel saves O(s) per head; eager attention keeps s x s probabilities."""
    spec = tiny_specs["llama"]
    base = dict(batch_size=1, device="cuda", precision="bf16-mixed", mode="exact")
    growth = {}
    for attn in ("sdpa", "eager"):
        short = exact_candidates(spec, TrainSettings(seq_len=128, attn_implementation=attn, **base).validate(spec))
        long = exact_candidates(spec, TrainSettings(seq_len=512, attn_implementation=attn, **base).validate(spec))
        growth[attn] = long.peak_bytes - short.peak_bytes
    assert growth["eager"] > 2 * growth["sdpa"]


def test_breakdown_names_model_states(tiny_specs):
    spec = tiny_specs["gpt2"]
    settings = TrainSettings(batch_size=1, seq_len=16, device="cpu", mode="exact").validate(spec)
    step = exact_candidates(spec, settings)
    opt = step.candidates["1.0|opt"]
    params = step.total_params
    assert opt["weights"] >= 4 * params
    assert opt["gradients"] == pytest.approx(4 * params, rel=0.01)
    assert opt["optimizer"] == pytest.approx(8 * params, rel=0.01)  # AdamW: exp_avg + exp_avg_sq, fp32

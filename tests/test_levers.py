"""Levers beyond the optimizer: Liger's fused linear cross-entropy, activation offloading."""

import pytest

from hf_memfit.errors import MemFitError
from hf_memfit.formulas import fast_step_memory
from hf_memfit.measure import measure_cpu_peak
from hf_memfit.planner import plan
from hf_memfit.settings import TrainSettings
from hf_memfit.spec import ModelSpec
from hf_memfit.trace import exact_candidates

from conftest import TINY_LLAMA

# A vocabulary large against the hidden size, as in real LMs (128k / 4k): the logits dominate the head.
BIG_VOCAB_LLAMA = dict(TINY_LLAMA, vocab_size=4096)


@pytest.fixture
def llama_big_vocab():
    return ModelSpec.from_config("tiny-llama-4k-vocab", BIG_VOCAB_LLAMA)


@pytest.mark.parametrize("device,precision,extra", [
    ("cpu", "fp32", {}),
    ("cuda", "bf16-mixed", {}),
    ("cuda", "bf16-mixed", {"gradient_checkpointing": True}),
])
def test_liger_fast_and_exact_agree_and_drop_the_logits(llama_big_vocab, device, precision, extra):
    spec = llama_big_vocab
    peaks = {}
    for liger in (False, True):
        settings = TrainSettings(batch_size=4, seq_len=64, device=device, precision=precision, use_liger_kernel=liger,
                                 **extra).validate(spec)
        fast, exact = fast_step_memory(spec, settings).peak_bytes, exact_candidates(spec, settings).peak_bytes
        assert abs(fast - exact) <= 0.02 * exact, (liger, fast, exact)
        peaks[liger] = exact
    # 256 tokens x 4096 vocab: the fp32 logits, their log_softmax and gradients (~4 MiB each) are gone
    assert peaks[False] - peaks[True] > 4 * 256 * 4096 * 1.5


def test_liger_emulation_on_the_cpu_allocator(llama_big_vocab):
    spec = llama_big_vocab
    settings = TrainSettings(batch_size=4, seq_len=64, device="cpu", use_liger_kernel=True, mode="exact").validate(spec)
    predicted = exact_candidates(spec, settings).peak_bytes
    measured = measure_cpu_peak(spec.config, settings)
    assert abs(predicted - measured) <= 0.01 * measured


def test_liger_only_where_liger_patches(tiny_specs):
    with pytest.raises(MemFitError, match="does nothing for gpt2"):
        TrainSettings(use_liger_kernel=True).validate(tiny_specs["gpt2"])


def test_planner_uses_liger_when_it_is_what_fits():
    common = dict(gpu="a10g", seq_len=2048, global_batch_size=32, load_in_4bit=True, lora_r=16)
    with_liger = plan("meta-llama/Llama-3.1-8B", use_liger_kernel=True, **common)
    without = plan("meta-llama/Llama-3.1-8B", use_liger_kernel=False, **common)
    assert with_liger.plan.use_liger_kernel and with_liger.plan.training_arguments()["use_liger_kernel"]
    assert with_liger.plan.predicted_step_seconds < without.plan.predicted_step_seconds
    assert any("Liger" in r and "without it the peak would be" in r for r in with_liger.plan.reasons)
    assert not without.plan.use_liger_kernel

"""Levers beyond the optimizer: Liger's fused linear cross-entropy, activation offloading."""

import pytest

from hf_memfit.errors import MemFitError
from hf_memfit.estimator.fast import fast_step_memory
from hf_memfit.estimator.measure import measure_cpu_peak
from hf_memfit.planner.search import plan
from hf_memfit.settings import TrainSettings
from hf_memfit.models.spec import ModelSpec
from hf_memfit.estimator.exact import exact_candidates

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


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
def test_offloaded_checkpoints_leave_the_gpu_in_both_modes(tiny_specs, precision):
    spec = tiny_specs["llama"]
    base = TrainSettings(batch_size=4, seq_len=64, device="cuda", precision=precision, gradient_checkpointing=True)
    plain, offloaded = base.validate(spec), base.replace(offload_activations=True).validate(spec)
    fast, exact = fast_step_memory(spec, offloaded), exact_candidates(spec, offloaded)
    assert abs(fast.peak_bytes - exact.peak_bytes) <= 0.02 * exact.peak_bytes
    # one hidden state per layer (4 x 64 x 64, fp32: autocast leaves the residual stream in the weights'
    # dtype) on the host, each a power of two already
    hidden = 4 * 64 * 64 * 4
    assert fast.host_bytes == exact.host_bytes == spec.num_layers * hidden
    assert exact.peak_bytes <= exact_candidates(spec, plain).peak_bytes


def test_offload_needs_checkpointing_and_a_gpu(tiny_specs):
    with pytest.raises(MemFitError, match="add `--gradient-checkpointing`"):
        TrainSettings(offload_activations=True).validate(tiny_specs["llama"])
    with pytest.raises(MemFitError, match="needs `--device cuda`"):
        TrainSettings(offload_activations=True, gradient_checkpointing=True, device="cpu").validate(tiny_specs["llama"])


def test_planner_offloads_activations_only_when_it_pays():
    common = dict(gpu="a10g", global_batch_size=4, load_in_4bit=True, lora_r=16, use_liger_kernel=True)
    long = plan("meta-llama/Llama-3.1-8B", seq_len=32768, **common).plan
    assert long.offload_activations and long.training_arguments()["gradient_checkpointing_kwargs"]["offload"]
    assert any(r.startswith("activation checkpoints offloaded") and "without it the peak would be" in r
               for r in long.reasons)
    # (peft's QLoRA recipe, the default: an fp32 residual stream, so twice the checkpoints of a bf16 one)
    short = plan("meta-llama/Llama-3.1-8B", seq_len=12288, **common).plan
    assert short.gradient_checkpointing and not short.offload_activations
    assert any(r.startswith("activation checkpoints stay on the GPU") for r in short.reasons)
    never = plan("meta-llama/Llama-3.1-8B", seq_len=12288, allow_offload="none", **common)
    assert not never.plan.offload_activations


# --- TRL's activation_offloading (SFTConfig / DPOConfig) ---------------------------------------------

@pytest.mark.parametrize("trainer,precision,checkpointing,layers", [
    ("sft", "bf16-mixed", True, 12),
    ("sft", "fp32", False, 8),
    ("dpo", "bf16-mixed", True, 8),
])
def test_trl_activation_offloading_in_both_modes(trainer, precision, checkpointing, layers):
    spec = ModelSpec.from_config("tiny-llama", dict(TINY_LLAMA, num_hidden_layers=layers))
    base = TrainSettings(batch_size=4, seq_len=256, device="cuda", precision=precision, trainer=trainer,
                         gradient_checkpointing=checkpointing)
    plain, offloaded = base.validate(spec), base.replace(activation_offloading=True).validate(spec)
    fast, exact = fast_step_memory(spec, offloaded), exact_candidates(spec, offloaded)
    assert abs(fast.peak_bytes - exact.peak_bytes) <= 0.05 * exact.peak_bytes
    assert exact.host_bytes > 0 and abs(fast.host_bytes - exact.host_bytes) <= 0.1 * exact.host_bytes
    # the saved activations leave the GPU: with checkpointing at least the layers' inputs (rows x 256 x 64 fp32
    # each; DPO runs chosen and rejected rows together)
    inputs = layers * offloaded.rows * 256 * 64 * 4
    freed = exact_candidates(spec, plain).peak_bytes - exact.peak_bytes
    assert freed >= (inputs if checkpointing else 1)
    if checkpointing:  # then the host holds the layer inputs and a few tensors outside the layers
        assert inputs <= exact.host_bytes <= 2 * inputs


def test_trl_activation_offloading_is_trls_and_needs_a_gpu(tiny_specs):
    spec = tiny_specs["llama"]
    with pytest.raises(MemFitError, match=r"`--activation-offloading` is TRL's .* `--trainer sft`"):
        TrainSettings(activation_offloading=True).validate(spec)
    with pytest.raises(MemFitError, match=r"`--activation-offloading` copies activations from a GPU .* "
                                          r"`--device cuda`"):
        TrainSettings(activation_offloading=True, trainer="sft", device="cpu").validate(spec)
    with pytest.raises(MemFitError, match="drop `--offload-activations`"):
        TrainSettings(activation_offloading=True, trainer="sft", gradient_checkpointing=True,
                      offload_activations=True).validate(spec)


def test_planner_keeps_trl_activation_offloading_and_says_what_it_does():
    common = dict(gpu="a10g", trainer="sft", seq_len=16384, global_batch_size=4, load_in_4bit=True, lora_r=16)
    offloaded = plan("meta-llama/Llama-3.1-8B", activation_offloading=True, **common)
    plain = plan("meta-llama/Llama-3.1-8B", **common)
    assert offloaded.plan.settings.activation_offloading and not offloaded.plan.offload_activations
    assert offloaded.estimate.cpu_bytes > 0
    # it lets a bigger micro-batch fit than the on-device plan
    assert offloaded.plan.per_device_train_batch_size > plain.plan.per_device_train_batch_size
    reason = next(r for r in offloaded.plan.reasons if r.startswith("TRL activation_offloading (as set)"))
    assert "pinned host memory" in reason and "frees" in reason and "PCIe" in reason
    # the estimate command the plan prints reproduces its figure
    import contextlib
    import io
    import json
    import re
    import shlex

    from hf_memfit.cli.main import main
    from hf_memfit.report.text import format_plan

    command = re.search(r"hf-memfit estimate .*", format_plan(offloaded)).group(0)
    assert "--activation-offloading" in command
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(shlex.split(command)[1:] + ["--json"]) == 0
    assert json.loads(out.getvalue())["device_total_bytes"] == offloaded.estimate.device_total_bytes


def test_trl_activation_offloading_on_a_cpu_only_torch(tmp_path, caplog):
    """What TRL 1.16 really does here: its OffloadActivations needs an accelerator and fails to build; the plan,
    made before that, is made without it and says so."""
    import logging

    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_memfit import MemFitSFTConfig, MemFitSFTTrainer
    from test_trl import sentences, tokenizer

    if torch.accelerator.current_accelerator() is not None:
        pytest.skip("a machine with an accelerator builds TRL's offloading")
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=123, pad_token_id=0,
                                  eos_token_id=1, bos_token_id=1)
    args = MemFitSFTConfig(output_dir=str(tmp_path), memory_budget="1GiB", use_cpu=True, max_steps=1, report_to=[],
                           save_strategy="no", max_length=32, activation_offloading=True)
    with caplog.at_level(logging.WARNING, logger="hf_memfit"), pytest.raises(AttributeError):
        MemFitSFTTrainer(model=AutoModelForCausalLM.from_config(config), args=args,
                         train_dataset=Dataset.from_dict({"text": sentences(8, 40, 60, seed=3)}),
                         processing_class=tokenizer())
    assert any("activation_offloading moves only tensors on an accelerator" in r.getMessage()
               for r in caplog.records)

"""The model hf-memfit traces and measures is built as `from_pretrained` builds a fine-tune's model
(`build.instantiate`)."""

import torch
from test_modalities import WHISPER

from hf_memfit.estimator import estimate
from hf_memfit.estimator.measure import measure_cpu_peak
from hf_memfit.models.build import instantiate
from hf_memfit.models.spec import ModelSpec

# T5 with a vocabulary large beside the rest: `from_config` made `shared` and both stacks' `embed_tokens` (then tied
# them) and the `lm_head`, so the model's creation held 3.6 times its weights, more than a LoRA step then needs.
T5_BIG_VOCAB = dict(model_type="t5", vocab_size=64000, d_model=256, d_ff=512, num_layers=2, num_heads=4, d_kv=64,
                    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


def test_no_transient_of_untied_copies_while_the_model_is_made():
    """Measured, exact and fast agree on a LoRA step of that T5; each mode's peak is the step, not the creation.
    With `from_config` the measurement and exact mode peaked while the model was made and fast mode, which has no
    such candidate, was 32% under them."""
    spec = ModelSpec.from_config("t5-big-vocab", T5_BIG_VOCAB)
    settings = dict(task="seq2seq", batch_size=2, seq_len=64, device="cpu", lora_r=8)
    exact = estimate(spec, mode="exact", **settings)
    fast = estimate(spec, mode="fast", **settings)
    measured = measure_cpu_peak(T5_BIG_VOCAB, exact.settings)
    assert exact.peak_region != "build"
    assert abs(exact.peak_allocated_bytes / measured - 1) < 1e-3
    assert abs(fast.peak_allocated_bytes / exact.peak_allocated_bytes - 1) < 0.01


def test_what_is_trainable_is_what_from_pretrained_leaves_trainable(tmp_path):
    """transformers 5 loads every parameter of a checkpoint as a new `nn.Parameter` that requires a gradient, so
    Whisper's sinusoidal encoder positions, which its `__init__` freezes, train after `from_pretrained`. The model
    hf-memfit builds has the same trainable parameters as one loaded from a checkpoint of itself."""
    from transformers import AutoModelForSpeechSeq2Seq

    ours = instantiate(WHISPER, "speech-seq2seq", 2, dtype=torch.float32, attn_implementation=None)
    ours.save_pretrained(tmp_path)
    loaded = AutoModelForSpeechSeq2Seq.from_pretrained(tmp_path)
    trainable = lambda model: {name for name, p in model.named_parameters() if p.requires_grad}  # noqa: E731
    assert trainable(ours) == trainable(loaded)
    assert "model.encoder.embed_positions.weight" in trainable(ours)
    assert ours.training  # as `from_config` left it; the Trainer sets the mode itself

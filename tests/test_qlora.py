"""QLoRA as peft's recipe runs it: `prepare_model_for_kbit_training` upcasts what bitsandbytes left unpacked."""

import pytest
import torch

from conftest import TINY_LLAMA
from hf_memfit.cli.main import main
from hf_memfit.errors import MemFitError
from hf_memfit.estimator.assemble import step_memory
from hf_memfit.estimator.measure import measure_cpu_peak
from hf_memfit.models.spec import ModelSpec
from hf_memfit.settings import TrainSettings

QLORA = dict(device="cpu", batch_size=2, seq_len=256, precision="bf16-mixed", load_in_4bit=True, lora_r=8,
             gradient_checkpointing=True)


@pytest.fixture(scope="module")
def llama():
    return ModelSpec.from_config("tiny-llama", dict(TINY_LLAMA, max_position_embeddings=2048))


def test_prepared_qlora_step_matches_the_cpu_allocator_in_both_modes(llama):
    """The real step with the fp32 embedding, head and norms, in both modes (fast: the formulas' forward)."""
    prepared = TrainSettings(**QLORA, prepare_model_for_kbit_training=True).validate(llama)
    measured = measure_cpu_peak(llama.config, prepared)
    exact = step_memory(llama, prepared.replace(mode="exact")).peak_bytes
    fast = step_memory(llama, prepared).peak_bytes
    assert abs(exact - measured) / measured < 0.01, (exact, measured)
    assert abs(fast - exact) / exact < 0.02, (fast, exact)
    # the fp32 residual stream: every checkpointed layer input at 4 bytes an element instead of 2
    plain = step_memory(llama, prepared.replace(prepare_model_for_kbit_training=False, mode="exact")).peak_bytes
    layers, hidden = TINY_LLAMA["num_hidden_layers"], TINY_LLAMA["hidden_size"]
    assert exact - plain >= 2 * layers * hidden * QLORA["batch_size"] * QLORA["seq_len"]


def test_the_preparation_casts_what_peft_casts():
    """hf-memfit's stand-in leaves the model's parameters in the dtypes peft's own function gives them."""
    from peft import prepare_model_for_kbit_training

    from hf_memfit.estimator.step import prepare_like_peft_kbit_training, quantizable_linears
    from hf_memfit.integrations.introspect import model_is_kbit_prepared
    from hf_memfit.models.build import instantiate

    settings = TrainSettings(**QLORA)
    ours = instantiate(TINY_LLAMA, "causal-lm", 2, dtype=torch.bfloat16, attn_implementation="sdpa")
    peft_model = instantiate(TINY_LLAMA, "causal-lm", 2, dtype=torch.bfloat16, attn_implementation="sdpa")
    assert not model_is_kbit_prepared(peft_model)
    packed = {name + ".weight" for name, module in ours.named_modules() if module in quantizable_linears(ours)}
    prepare_like_peft_kbit_training(ours, settings)
    prepare_model_for_kbit_training(peft_model, use_gradient_checkpointing=False)
    assert model_is_kbit_prepared(peft_model) and model_is_kbit_prepared(ours)
    peft_dtypes = dict((n, p.dtype) for n, p in peft_model.named_parameters())
    for name, param in ours.named_parameters():
        # peft upcasts bitsandbytes' packed weights too when they are not `Params4bit`, as in this bf16 model
        assert param.dtype == (torch.bfloat16 if name in packed else peft_dtypes[name]), name
        assert not param.requires_grad
    assert packed and any(p.dtype == torch.float32 for p in ours.parameters())


def test_the_default_follows_each_stack(llama):
    base = TrainSettings(**QLORA)
    assert base.kbit_prepared  # the plain Trainer on one device: peft's recipe
    assert not base.replace(trainer="sft").kbit_prepared  # TRL 1.16 no longer calls it
    assert not base.replace(device="cuda", zero_stage=2).kbit_prepared  # the engine casts the model to bf16
    assert not base.replace(prepare_model_for_kbit_training=False).kbit_prepared
    assert not base.replace(load_in_4bit=False).kbit_prepared
    with pytest.raises(MemFitError, match="--prepare-model-for-kbit-training no"):
        base.replace(device="cuda", zero_stage=3, prepare_model_for_kbit_training=True).validate(llama)
    with pytest.raises(MemFitError, match="add `--load-in-4bit`"):
        base.replace(load_in_4bit=False, prepare_model_for_kbit_training=True).validate(llama)


def test_cli_names_the_recipe_and_refuses_it_under_sharding(capsys):
    common = ["estimate", "meta-llama/Llama-3.2-1B", "--batch-size", "1", "--seq-len", "512", "--load-in-4bit",
              "--lora-r", "8", "--precision", "bf16-mixed", "--gpu", "a10g"]
    assert main(common + ["--prepare-model-for-kbit-training", "no"]) == 0
    assert "prepare_model_for_kbit_training" not in capsys.readouterr().out
    code = main(common + ["--prepare-model-for-kbit-training", "yes", "--zero-stage", "3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--prepare-model-for-kbit-training no" in err[0], err

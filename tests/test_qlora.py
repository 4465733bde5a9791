"""QLoRA as peft's recipe runs it: `prepare_model_for_kbit_training` upcasts what bitsandbytes left unpacked."""

import pytest
import torch

from conftest import TINY_GPT2, TINY_LLAMA, TINY_QWEN3_MOE, TINY_T5
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


# One of each thing transformers' 4-bit quantizer decides by structure: fused 3-D MoE experts (nn.Parameters,
# not modules; Jamba's beside Mamba mixers), GPT-2's Conv1D body, T5's `_keep_in_fp32_modules` (`wo`).
_TINY_JAMBA_MOE = dict(model_type="jamba", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=256, mamba_d_state=8, mamba_d_conv=4,
                       mamba_expand=2, mamba_dt_rank=8, attn_layer_period=2, attn_layer_offset=1,
                       expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
                       use_mamba_kernels=False)


@pytest.mark.parametrize("config, task, targets, weigh", [
    (TINY_GPT2, "causal-lm", ("c_attn",), False), (TINY_T5, "seq2seq", ("q", "v"), False),
    (TINY_QWEN3_MOE, "causal-lm", ("q_proj", "v_proj"), False),
    (_TINY_JAMBA_MOE, "causal-lm", ("in_proj", "x_proj"), True)],  # one trace: the suite's time is short
    ids=["gpt2", "t5", "qwen3_moe", "jamba"])
def test_what_is_packed_to_4_bits_is_what_bitsandbytes_packs(tmp_path, config, task, targets, weigh):
    """The estimator packs the weights transformers + bitsandbytes pack, and leaves the rest (fused experts) unpacked.

    The real model: saved from the config, loaded with `BitsAndBytesConfig(load_in_4bit=True)` on the CPU, then
    peft's `prepare_model_for_kbit_training`. Both modes read one rule: exact mode `step.quantizable_linears`
    (through `build_model`, adapters and all), the spec's linear modules (`LinearModule.packed`) for fast mode and
    FSDP's units.
    """
    pytest.importorskip("bitsandbytes")
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    from hf_memfit.estimator.fast_params import quantizable
    from hf_memfit.estimator.sharding import packed_4bit_bytes_per_param, shard
    from hf_memfit.estimator.step import build_model, prepare_like_peft_kbit_training, quantizable_linears
    from hf_memfit.estimator.trace import _quantizable_linear_params
    from hf_memfit.models.build import auto_model_class, instantiate

    spec = ModelSpec.from_config(f"tiny-{config['model_type']}", config)
    settings = TrainSettings(**dict(QLORA, task=task, lora_target_modules=targets)).validate(spec)
    instantiate(config, task, 2, dtype=torch.bfloat16, attn_implementation="eager").save_pretrained(tmp_path)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)
    real = auto_model_class(task).from_pretrained(tmp_path, quantization_config=quant, device_map="cpu")
    real_packed = {n: p.quant_state.shape.numel() for n, p in real.named_parameters() if type(p).__name__ == "Params4bit"}
    assert real_packed

    ours = instantiate(config, task, 2, dtype=torch.bfloat16, attn_implementation="eager")
    packed = {id(m) for m in quantizable_linears(ours)}
    assert {n + ".weight" for n, m in ours.named_modules() if id(m) in packed} == set(real_packed)
    prepare_model_for_kbit_training(real, use_gradient_checkpointing=False)
    prepare_like_peft_kbit_training(ours, settings)
    # a packed layer's bias: peft upcasts it, and `Linear4bit.forward` casts it back to the compute dtype on the
    # first step (bitsandbytes nn/modules.py), as the stand-in keeps it
    layers = {n.removesuffix(".weight") for n in real_packed}
    real_dtypes = {n: p.dtype for n, p in real.named_parameters() if n.rpartition(".")[0] not in layers}
    assert {n: p.dtype for n, p in ours.named_parameters() if n.rpartition(".")[0] not in layers} == real_dtypes

    # what the trace counts (the model with its adapters) and what the formulas count
    built = build_model(config, settings)
    assert _quantizable_linear_params(built)[0] == sum(real_packed.values())
    assert quantizable(spec, settings)[0] == sum(real_packed.values())  # the spec's linears say it too (FSDP units)
    if spec.moe:  # the fused experts: 3-D, unpacked, fp32 once prepared
        experts = [n for n, p in real.named_parameters() if p.dim() == 3]
        assert experts and all(real_dtypes[n] == torch.float32 for n in experts)
    if weigh:  # the estimate's weights: the real model's unpacked bytes, adapters, and the packed ones by formula
        step = step_memory(spec, settings.replace(mode="exact", batch_size=1, seq_len=8, gradient_checkpointing=False))
        weights = min(b["weights"] for b in shard(step, settings, spec.hidden_size).candidates.values())
        unpacked = sum(p.numel() * p.element_size() for n, p in real.named_parameters() if n not in real_packed)
        biases = sum(p.numel() for n, p in real.named_parameters() if n.rpartition(".")[0] in layers
                     and n not in real_packed)  # fp32 here, bf16 again after the first forward
        adapters = sum(p.numel() * p.element_size() for n, p in built.named_parameters() if "lora_" in n)
        packed_bytes = sum(real_packed.values()) * packed_4bit_bytes_per_param(settings)
        expected = unpacked - 2 * biases + adapters + packed_bytes
        assert abs(weights - expected) < 1024, (weights, expected)  # tensors' 512-byte rounding aside


def test_linear_subclasses_bitsandbytes_leaves_unpacked_are_unpacked_in_every_count():
    """Falcon's layers are `FalconLinear` (an nn.Linear subclass), which transformers' 4-bit quantizer does not
    replace: nothing of the model packs, in fast mode's count and in FSDP's per-layer units alike."""
    from hf_memfit.estimator.breakdown import StepMemory
    from hf_memfit.estimator.fast_params import quantizable
    from hf_memfit.estimator.sharding import wrap_units

    falcon = ModelSpec.from_config("tiny-falcon", dict(model_type="falcon", hidden_size=64, num_hidden_layers=2,
                                                       num_attention_heads=4, vocab_size=256))
    settings = TrainSettings(**dict(QLORA, task="causal-lm", lora_target_modules=("query_key_value",),
                                    device="cuda", fsdp="full_shard", num_gpus=2)).validate(falcon)
    layer_linears = [m for m in falcon.linear_modules() if m.scope == "layer"]
    assert layer_linears and not any(m.packed for m in layer_linears)
    assert quantizable(falcon, settings) == (0, 0)
    step = StepMemory({}, 0, falcon.parameter_count("causal-lm")["total"], 0)
    assert wrap_units(falcon, settings, step).layer_quantizable == 0

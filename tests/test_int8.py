"""LLM.int8() + LoRA (`load_in_8bit`): settings, both modes, and the bitsandbytes step it stands in for."""

import pytest

from conftest import TINY_LLAMA
from hf_memfit.cli.main import main
from hf_memfit.errors import MemFitError
from hf_memfit.estimator.assemble import step_memory
from hf_memfit.models.spec import ModelSpec
from hf_memfit.settings import TrainSettings

INT8 = dict(batch_size=2, seq_len=256, precision="bf16-mixed", load_in_8bit=True, lora_r=8)


@pytest.fixture(scope="module")
def llama():
    return ModelSpec.from_config("tiny-llama", dict(TINY_LLAMA, max_position_embeddings=2048))


@pytest.mark.parametrize("fields, flag", [(dict(lora_r=None), "--lora-r"), (dict(load_in_4bit=True), "--load-in-4bit"),
                                          (dict(zero_stage=3, num_gpus=2), "ZeRO-3")])
def test_refusals_name_the_flag_and_the_fix(llama, fields, flag):
    with pytest.raises(MemFitError, match="--load-in-8bit") as info:
        TrainSettings(**dict(INT8, **fields)).validate(llama)
    assert flag in str(info.value)


@pytest.mark.parametrize("device, prepared, checkpointing", [("cuda", True, False), ("cuda", False, False),
                                                               ("cpu", True, False), ("cpu", True, True)])
def test_fast_and_exact_agree(llama, device, prepared, checkpointing):
    """benchmarks/int8_cpu.py holds the real bitsandbytes CPU step against these (exact within 0.3%). Under
    checkpointing fast mode fits traces of the step (the int8 matmul's kept inputs): the same figure."""
    s = TrainSettings(**INT8, device=device, prepare_model_for_kbit_training=prepared,
                      gradient_checkpointing=checkpointing).validate(llama)
    exact = step_memory(llama, s.replace(mode="exact")).peak_bytes
    fast = step_memory(llama, s)
    assert abs(fast.peak_bytes - exact) / exact < (0.001 if checkpointing else 0.02), (fast.peak_bytes, exact)
    assert any("LLM.int8() layers under checkpointing" in note for note in fast.notes) == checkpointing


def test_int8_weights_are_a_byte_a_param_and_cli_takes_the_flag(capsys):
    """gpt2 (catalogue): 124M params, 85M of them in the body's Conv1D layers, at 1 B instead of 2."""
    import json

    args = ["estimate", "gpt2", "--seq-len", "128", "--batch-size", "1", "--lora-r", "8",
            "--precision", "bf16", "--device", "cuda", "--mode", "fast",
            "--prepare-model-for-kbit-training", "no"]
    assert main(args + ["--load-in-8bit", "--json"]) == 0
    int8 = json.loads(capsys.readouterr().out)
    assert main(args + ["--json"]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    saved = bf16["breakdown"]["weights"] - int8["breakdown"]["weights"]
    assert 0.9 * 85e6 < saved < 85e6, saved  # 1 B/param less, less the fp32 row scales


def test_the_trainer_plans_a_model_loaded_in_8bit_as_int8(tmp_path):
    """A script that loads its model with `BitsAndBytesConfig(load_in_8bit=True)` (bitsandbytes' CPU int8 here) and
    adds LoRA: MemFitTrainer plans LLM.int8() weights, not a bf16 model."""
    pytest.importorskip("bitsandbytes")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from hf_memfit.integrations.args import MemFitArguments
    from hf_memfit.integrations.trainer import MemFitTrainer
    from hf_memfit.models.build import instantiate

    instantiate(dict(TINY_LLAMA), "causal-lm", 2, dtype=torch.bfloat16, attn_implementation="sdpa").save_pretrained(
        tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map="cpu",
                                                 quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, 512, (8, 64), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": row, "labels": row} for row in ids]
    args = MemFitArguments(output_dir=str(tmp_path / "out"), memory_budget="2GiB", per_device_train_batch_size=2,
                           max_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = MemFitTrainer(model=model, args=args, train_dataset=rows)
    settings = trainer.memfit_result.estimate.settings
    assert settings.load_in_8bit and not settings.load_in_4bit and settings.lora_r == 8


def test_check_measures_real_bitsandbytes_int8_layers_on_the_cpu(tmp_path, capsys):
    """`hf-memfit check --load-in-8bit` runs bitsandbytes' own Linear8bitLt (its CPU `MatMul8bitFp`), not the
    stand-in exact mode traces, so the comparison is against the real layer. Held to `check`'s targets
    (tests/test_check.py): exact within 1%, fast within 5% (measured +0.4% / +1.8%)."""
    pytest.importorskip("bitsandbytes")
    import json

    from hf_memfit.estimator import step
    from hf_memfit.estimator.measure import bitsandbytes_build

    settings = TrainSettings(**INT8, device="cpu", task="causal-lm")
    with bitsandbytes_build(settings, "cpu"):
        model = step.build_model(TINY_LLAMA, settings)
    kinds = {type(module).__name__ for module in model.modules()}
    assert "Linear8bitLt" in kinds, kinds
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    assert main(["check", str(path), "--batch-size", "2", "--seq-len", "256", "--precision", "bf16-mixed",
                 "--lora-r", "8", "--load-in-8bit", "--device", "cpu", "--no-terms", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    for mode, tolerance in (("exact", 1.0), ("fast", 5.0)):
        assert abs(row["error_percent"][mode]["peak_allocated"]) <= tolerance, row["error_percent"]

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


@pytest.mark.parametrize("device, prepared", [("cuda", True), ("cuda", False), ("cpu", True)])
def test_fast_and_exact_agree(llama, device, prepared):
    """benchmarks/int8_cpu.py holds the real bitsandbytes CPU step against these (exact within 0.3%)."""
    s = TrainSettings(**INT8, device=device, prepare_model_for_kbit_training=prepared).validate(llama)
    exact = step_memory(llama, s.replace(mode="exact")).peak_bytes
    fast = step_memory(llama, s).peak_bytes
    assert abs(fast - exact) / exact < 0.02, (fast, exact)


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

"""Families without hand-written code: the generic spec, exact mode, parametric fast mode, bad input."""

import json
import subprocess
import sys
import time

import pytest
from conftest import TINY_GEMMA3, TINY_GENERIC, TINY_MODERNBERT, TINY_QWEN3, TINY_QWEN3_MOE

from hf_memfit.errors import MemFitError
from hf_memfit.estimator.assemble import estimate
from hf_memfit.settings import TrainSettings
from hf_memfit.models.spec import ModelSpec


def _spec(name):
    return ModelSpec.from_config(f"tiny-{name}", TINY_GENERIC[name])


@pytest.mark.parametrize("name", sorted(TINY_GENERIC))
def test_generic_counts_match_the_real_model(name):
    """Parameter counts and linear modules come from a meta build; check them against a real CPU build."""
    import torch

    from hf_memfit.models.build import instantiate

    spec = _spec(name)
    assert not spec.hand_written
    task = spec.default_task
    model = instantiate(spec.config, task, 2, dtype=torch.float32, attn_implementation=None)
    assert spec.parameter_count(task)["total"] == sum(p.numel() for p in model.parameters())
    linears = sum(m.count for m in spec.linear_modules(task))
    assert linears == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    counts = spec.parameter_count(task)
    # per_layer is the stack's average layer (ModernBERT's first layer has no attention norm)
    assert abs(counts["layers"] - counts["per_layer"] * spec.num_layers) < spec.num_layers


def test_generic_fields():
    gemma = _spec("gemma3_text")
    assert gemma.layer_period == 3  # sliding_window_pattern 3: two sliding layers, then a global one
    assert gemma.default_task == "causal-lm" and "seq-cls" in gemma.supported_tasks
    moe = _spec("qwen3_moe")
    assert moe.moe == {"experts": 8, "top_k": 2}
    bert = _spec("modernbert")
    assert bert.default_task == "seq-cls" and "token-cls" in bert.supported_tasks
    assert _spec("qwen3").tie_word_embeddings and _spec("qwen3").layer_period == 1
    # peft has defaults for qwen3 but none for olmo2: like peft, ask for targets then.
    assert _spec("qwen3").default_lora_target_modules() == ["q_proj", "v_proj"]
    with pytest.raises(MemFitError, match="all-linear"):
        _spec("olmo2").default_lora_target_modules()


@pytest.mark.parametrize("name, changes", [
    ("qwen3", {}),
    ("qwen3", {"precision": "bf16-mixed", "gradient_checkpointing": True}),
    ("gemma3_text", {}),
    ("olmo2", {"lora_r": 8, "lora_target_modules": ("all-linear",)}),
    ("qwen3_moe", {}),
    ("qwen3_moe", {"precision": "bf16-mixed"}),
    ("modernbert", {}),
    ("modernbert", {"task": "token-cls", "num_labels": 5}),
    # the global layers' bidirectional mask, which the real step skips for a batch without padding (+5.6% when it was traced)
    ("modernbert", {"task": "multiple-choice", "seq_len": 256}),
])
def test_generic_exact_matches_the_cpu_allocator(name, changes):
    from hf_memfit.estimator.measure import measure_cpu_peak

    spec = _spec(name)
    settings = TrainSettings(**{"batch_size": 2, "seq_len": 64, "device": "cpu", "mode": "exact", **changes}).validate(spec)
    predicted = estimate(spec, **{k: v for k, v in settings.to_dict().items()}).peak_allocated_bytes
    measured = measure_cpu_peak(spec.config, settings)
    assert abs(predicted - measured) / measured < 0.01, (predicted, measured)


def test_image_text_to_text_trains_on_text():
    """Gemma-3 with its vision tower: the text stack is the one extrapolated; the batch is text only."""
    from hf_memfit.estimator.measure import measure_cpu_peak

    config = dict(model_type="gemma3", mm_tokens_per_image=4,
                  text_config=dict(TINY_GEMMA3, model_type="gemma3_text", num_hidden_layers=10),
                  vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     image_size=28, patch_size=14))
    spec = ModelSpec.from_config("gemma3-vl", config)
    assert spec.num_layers == 10 and spec.layer_count_keys == ("text_config.num_hidden_layers",)
    assert spec.with_layers(4)["text_config"]["num_hidden_layers"] == 4
    settings = TrainSettings(batch_size=2, seq_len=32, device="cpu", mode="exact", images_per_sample=0,
                             task="image-text-to-text").validate(spec)
    predicted = estimate(spec, **settings.to_dict()).peak_allocated_bytes
    measured = measure_cpu_peak(spec.config, settings)
    assert abs(predicted - measured) / measured < 0.01, (predicted, measured)


def test_depth_extrapolation_finds_the_hybrid_pattern():
    """Gemma-3's sliding/global pattern (period 3 here) extrapolates to the same peak as a full-depth trace."""
    from hf_memfit.estimator.exact import exact_candidates

    config = dict(TINY_GEMMA3, num_hidden_layers=11)  # not a whole number of periods beyond 2p
    spec = ModelSpec.from_config("gemma-11", config)
    settings = TrainSettings(batch_size=2, seq_len=64, device="cpu", mode="exact").validate(spec)
    extrapolated = exact_candidates(spec, settings)
    full = exact_candidates(spec, settings, extrapolate=False)
    assert abs(extrapolated.peak_bytes - full.peak_bytes) / full.peak_bytes < 0.005
    assert extrapolated.total_params == full.total_params


def test_moe_output_states_the_routing():
    est = estimate(ModelSpec.from_config("moe", TINY_QWEN3_MOE), batch_size=2, seq_len=32, mode="exact")
    note = next(n for n in est.notes if "experts" in n)
    assert "routing" in note and "worst case" in note and "128 rows" in note  # 2 x 32 tokens x top-2


def test_parametric_fast_mode(tmp_path, monkeypatch):
    """Fast mode for a generic family: one fit serves every batch, close to exact mode, cached and quick after."""
    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path))
    spec = ModelSpec.from_config("qwen3", TINY_QWEN3)
    common = dict(seq_len=64, device="cpu")
    first = estimate(spec, batch_size=1, **common)
    assert any("paid" in n for n in first.notes)
    assert len(list((tmp_path / "parametric").glob("*.json"))) == 1
    for batch in (1, 3, 4, 6):
        fast = estimate(spec, batch_size=batch, **common)
        exact = estimate(spec, batch_size=batch, mode="exact", **common)
        assert not any("paid" in n for n in fast.notes)
        err = abs(fast.peak_allocated_bytes - exact.peak_allocated_bytes) / exact.peak_allocated_bytes
        assert err < 0.01, (batch, fast.peak_allocated_bytes, exact.peak_allocated_bytes)


def test_cached_fast_call_imports_no_torch(tmp_path):
    """Once calibrated, a fast estimate of a generic family reads the cache and never imports torch.

    (Its speed is measured in benchmarks/generic_speed.py, not asserted here.)
    """
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_QWEN3))
    env_code = f"import os; os.environ['HF_MEMFIT_CACHE'] = {str(tmp_path / 'cache')!r}\n"
    warm = env_code + f"from hf_memfit import estimate; estimate({str(config)!r}, batch_size=2, seq_len=64)"
    subprocess.run([sys.executable, "-c", warm], check=True, capture_output=True)
    probe = env_code + (
        "import sys\n"
        f"from hf_memfit import estimate; e = estimate({str(config)!r}, batch_size=8, seq_len=64)\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules, any('parametric fit from' in n for n in e.notes))")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout.split()
    assert out == ["False", "False", "True"]


def test_cli_unknown_model_type_is_one_line_exit_2(tmp_path):
    import transformers

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "my_remote_arch", "auto_map": {"AutoConfig": "x.Y"}}))
    proc = subprocess.run([sys.executable, "-m", "hf_memfit.cli", "estimate", str(config), "--batch-size", "1", "--seq-len", "8"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "my_remote_arch" in lines[0] and transformers.__version__ in lines[0]
    assert "remote code" in lines[0] and "Traceback" not in proc.stderr


def test_a_config_transformers_cannot_build_is_one_line(tmp_path):
    import transformers

    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(TINY_QWEN3, hidden_act="no_such_activation")))
    proc = subprocess.run([sys.executable, "-m", "hf_memfit.cli", "estimate", str(config), "--batch-size", "1",
                           "--seq-len", "8"], capture_output=True, text=True)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "qwen3" in lines[0] and transformers.__version__ in lines[0]


def test_cli_estimates_a_generic_family(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_MODERNBERT))
    proc = subprocess.run([sys.executable, "-m", "hf_memfit.cli", "estimate", str(config), "--batch-size", "2",
                           "--seq-len", "64", "--mode", "exact", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["total_params"] == ModelSpec.from_config("m", TINY_MODERNBERT).parameter_count()[
        "total"]


def test_cached_fast_call_traces_nothing(monkeypatch):
    """Once fitted, other batch sizes are read from the cache: no exact trace runs."""
    import hf_memfit.estimator.parametric as parametric

    spec = ModelSpec.from_config("qwen3", TINY_QWEN3)
    estimate(spec, batch_size=2, seq_len=32, device="cpu")

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(parametric, "calibrate_many", no_calibration)
    for batch in (1, 5, 64):
        assert estimate(spec, batch_size=batch, seq_len=32, device="cpu").peak_allocated_bytes > 0


def test_memfit_trainer_plans_for_a_generic_family(tmp_path):
    """MemFitTrainer plans for any model object; it never refuses by model_type."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_memfit.integrations.args import MemFitArguments
    from hf_memfit.integrations.trainer import MemFitTrainer

    torch.manual_seed(0)
    config = AutoConfig.for_model(**dict(TINY_QWEN3, num_hidden_layers=2, vocab_size=128))
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 128, (16, 32), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = MemFitArguments(output_dir=str(tmp_path / "out"), memory_budget="2GiB", per_device_train_batch_size=4,
                           max_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = MemFitTrainer(model=model, args=args, train_dataset=dataset)
    assert trainer.memfit_plan.per_device_train_batch_size >= 1
    trainer.train()


def test_data_dependent_experts_are_refused_in_one_line():
    """transformers' eager experts loop has data-dependent shapes: exact mode says so instead of a traceback."""
    config = dict(TINY_QWEN3_MOE, num_hidden_layers=2, experts_implementation="eager")
    spec = ModelSpec.from_config("moe-eager", config)
    with pytest.raises(MemFitError, match="depend on the data"):
        estimate(spec, mode="exact", batch_size=1, seq_len=16, device="cpu")

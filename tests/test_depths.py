"""Depth axes (`models/depths.py`): a VLM's vision tower is traced at a few layers and extrapolated, per kind
of layer where an index list names two kinds (Qwen2.5-VL's full-attention blocks among windowed ones); a main
stack whose per-layer config lists set two kinds with a longer period (Gemma-3's 5 sliding : 1 global) per kind."""

import copy

import pytest
from transformers import AutoConfig

from hf_memfit.estimator.assemble import estimate_settings
from hf_memfit.estimator.measure import measure_cpu_peak
from hf_memfit.estimator.exact import exact_candidates
from hf_memfit.models.depths import _kinds_at, _main_order, config_with_depths, depth_plan, region_period, towers
from hf_memfit.models.spec import ModelSpec, resolve_model
from hf_memfit.settings import TrainSettings
from tests.conftest import TINY_GEMMA3
from tests.test_ssm import TINY_JAMBA
from tests.test_vlm import LLAVA, QWEN25VL


def test_kinds_keep_the_real_first_and_last_layer_and_grow_one_kind_at_a_time():
    qwen = [7, 15, 23, 31]  # Qwen2.5-VL-7B: full attention closes each group of eight blocks
    assert _kinds_at(32, qwen, 2, 2) == [False, True, False, True]
    assert _kinds_at(32, qwen, 3, 2) == [False, False, True, False, True]
    assert _kinds_at(32, qwen, 2, 3) == [False, True, True, False, True]
    assert _kinds_at(10, [0, 4, 9], 2, 2) == [True, False, False, True]  # starts and ends on a special layer


def test_catalogue_vlms_get_a_tower_axis_and_text_models_none():
    qwen = resolve_model("Qwen/Qwen2.5-VL-7B-Instruct")
    (tower,) = towers(qwen)
    assert (tower["key"], tower["index_key"], tower["special"]) == ("vision_config.depth", "fullatt_block_indexes",
                                                                   [7, 15, 23, 31])
    plan = depth_plan(qwen)
    assert plan.real == (28, 28, 4)  # language layers, windowed blocks, full-attention blocks
    # the language layers and the windowed blocks grow by 26 periods each: one trace grows both (`depth_plan`)
    assert plan.depth_sets == [(2, 2, 2), (3, 3, 2), (2, 2, 3)] and plan.steps == [26, 2]
    grown_windowed = config_with_depths(qwen, plan.depth_sets[1])["vision_config"]
    assert (grown_windowed["depth"], grown_windowed["fullatt_block_indexes"]) == (5, [2, 4])
    assert config_with_depths(qwen, plan.real)["vision_config"] == qwen.config["vision_config"]

    llava = resolve_model("llava-hf/llava-1.5-7b-hf")
    assert [t["key"] for t in towers(llava)] == ["vision_config.num_hidden_layers"]
    assert depth_plan(llava).depth_sets == [(2, 2), (3, 2), (2, 3)]
    whisper = resolve_model("openai/whisper-small")
    assert towers(whisper) == []  # encoder and decoder are its main stacks, 12 layers each: grown in one trace
    assert depth_plan(whisper).depth_sets == [(2, 2), (3, 3)] and depth_plan(whisper).steps == [10]


def test_a_main_stack_by_kinds_keeps_one_of_each_kind_at_both_ends():
    s, g = ("sliding_attention",), ("full_attention",)
    gemma3_4b = [s] * 5 + [g] + [s] * 5 + [g] + [s] * 5 + [g] + [s] * 5 + [g] + [s] * 5 + [g] + [s] * 4
    assert _main_order(gemma3_4b, {s: 2, g: 2}) == [s, g, g, s]
    assert _main_order(gemma3_4b, {s: 3, g: 2}) == [s, g, s, g, s]  # the grown layer in the middle
    assert _main_order(gemma3_4b, {s: 2, g: 3}) == [s, g, g, g, s]
    assert _main_order(gemma3_4b[:12], {s: 2, g: 2}) == [s, g, s, g]  # 12 layers end on a global one

    gemma3 = resolve_model("google/gemma-3-4b-it")
    plan = depth_plan(gemma3)
    assert plan.real == (29, 5, 27) and plan.steps == [27, 3, 25]  # sliding, global, vision layers
    assert max(sum(d[:2]) for d in plan.depth_sets) == 5  # two periods of six and three were 12 and 18 layers
    assert region_period(gemma3) == 2 and gemma3.layer_period == 6
    text = config_with_depths(gemma3, plan.depth_sets[1])["text_config"]
    assert text["num_hidden_layers"] == 5 and text["layer_types"] == [s[0], g[0], s[0], g[0], s[0]]
    assert "layer_types" not in config_with_depths(gemma3, plan.real)["text_config"]  # the real stack as configured
    assert region_period(resolve_model("google/gemma-2-9b")) == 2  # a period of 2: by periods, as short


def test_a_config_that_derives_its_layer_lists_is_traced_by_periods(monkeypatch):
    from types import SimpleNamespace

    from hf_memfit.models import generic

    lists = {"layer_types": ["sliding", "sliding", "full"] * 3}
    config = {"model_type": "gemma3_text", "num_hidden_layers": 9}
    # a config class that makes its own pattern whatever it is given: a copy by kinds would not be what it asks
    monkeypatch.setattr(generic, "hf_config", lambda trial: SimpleNamespace(layer_types=["sliding"] * 4))
    assert generic._settable(config, "num_hidden_layers", lists) is None
    monkeypatch.setattr(generic, "hf_config", lambda trial: SimpleNamespace(layer_types=trial["layer_types"]))
    assert generic._settable(config, "num_hidden_layers", lists) == lists


def test_a_main_stack_extrapolated_by_kinds_equals_a_full_trace():
    spec = ModelSpec.from_config("tiny-gemma3", TINY_GEMMA3)  # 8 layers of 2 sliding : 1 global
    assert depth_plan(spec).depth_sets == [(2, 2), (3, 2)]  # 6 sliding and 2 global layers
    for changes in ({}, {"gradient_checkpointing": True, "precision": "bf16-mixed", "device": "cuda"}):
        settings = TrainSettings(batch_size=2, seq_len=64, **changes).validate(spec)
        extrapolated = exact_candidates(spec, settings).peak_bytes
        assert extrapolated == exact_candidates(spec, settings, extrapolate=False).peak_bytes


# Jamba-v0.1's pattern (attention every 8th layer from 4, experts every 2nd from 1) on 16 tiny layers
JAMBA_PATTERN = dict(TINY_JAMBA, num_hidden_layers=16, attn_layer_period=8, attn_layer_offset=4, num_experts=4,
                     num_experts_per_tok=2)


def test_a_stack_whose_config_derives_its_kinds_is_traced_by_kinds():
    """Jamba's config derives `layers_block_type` and `layers_num_experts` from periods and offsets (properties no
    config dict sets), so its stack was traced by periods: 16 and 24 of Jamba-v0.1's 32 layers. `build.hf_config`
    now takes such lists as given where a traced copy writes them, and the stack is traced by kinds: two layers of
    each of its three (Mamba, Mamba with experts, attention), the same peak as the full stack."""
    from hf_memfit.models.build import hf_config

    spec = ModelSpec.from_config("tiny-jamba", JAMBA_PATTERN)
    plan = depth_plan(spec)
    assert plan.real == (6, 8, 2) and plan.depth_sets == [(2, 2, 2), (3, 2, 2), (2, 3, 2)]
    built = hf_config(config_with_depths(spec, plan.depth_sets[1]))
    assert built.layers_block_type == ["mamba", "mamba", "attention", "mamba", "attention", "mamba", "mamba"]
    assert built.layers_num_experts == [1, 4, 1, 1, 1, 1, 4]
    assert type(built).__name__ == "JambaConfig" and "layers_block_type" not in built.to_dict()
    assert hf_config(config_with_depths(spec, plan.real)).layers_block_type == hf_config(spec.config).layers_block_type
    for changes in ({}, {"gradient_checkpointing": True, "precision": "bf16-mixed", "device": "cuda", "gpu": "h100"}):
        settings = TrainSettings(batch_size=2, seq_len=64, **changes).validate(spec)
        assert exact_candidates(spec, settings).peak_bytes == exact_candidates(spec, settings,
                                                                               extrapolate=False).peak_bytes


def test_recurrent_gemma_by_kinds_equals_a_full_trace():
    """RecurrentGemma derives `layers_block_type` (recurrent, recurrent, attention, ...) from `block_types` too. By
    periods, 14 layers (four periods and two) were extrapolated from 6 and 9 by a fractional period: -2.2%."""
    config = dict(model_type="recurrent_gemma", num_hidden_layers=14, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=256, lru_width=64,
                  attention_window_size=32, conv1d_width=4)
    spec = ModelSpec.from_config("tiny-recurrent-gemma", config)
    assert depth_plan(spec).depth_sets == [(2, 2), (3, 2), (2, 3)]  # 10 recurrent and 4 attention layers
    settings = TrainSettings(batch_size=2, seq_len=64).validate(spec)
    assert exact_candidates(spec, settings).peak_bytes == exact_candidates(spec, settings, extrapolate=False).peak_bytes


def deeper(config: dict, **tower) -> ModelSpec:
    config = copy.deepcopy(config)
    config["vision_config"].update(tower)
    return ModelSpec.from_config(f"tiny-{config['model_type']}", AutoConfig.for_model(**config).to_dict())


def test_an_extrapolated_tower_equals_a_full_trace():
    spec = deeper(LLAVA, num_hidden_layers=5)
    plan = depth_plan(spec)
    assert plan.reduced and max(sum(d[1:]) for d in plan.depth_sets) < sum(plan.real[1:])  # fewer tower layers
    settings = TrainSettings(batch_size=2, seq_len=16, task="image-text-to-text", device="cuda",
                             precision="bf16-mixed").validate(spec)
    extrapolated = exact_candidates(spec, settings).peak_bytes
    assert extrapolated == pytest.approx(exact_candidates(spec, settings, extrapolate=False).peak_bytes, rel=0.001)


@pytest.mark.slow  # an exact estimate, a fast one and a profiled step: about 30 s
def test_a_windowed_tower_by_kinds_matches_the_measured_step():
    spec = deeper(QWEN25VL, depth=8, fullatt_block_indexes=[3, 5, 7])  # 5 windowed and 3 full-attention blocks
    settings = TrainSettings(batch_size=2, seq_len=16, task="image-text-to-text", device="cpu", mode="exact",
                             image_size=112)
    exact = estimate_settings(spec, settings)
    assert exact.peak_allocated_bytes == pytest.approx(measure_cpu_peak(spec.config, exact.settings), rel=0.005)
    fast = estimate_settings(spec, settings.replace(mode="fast"))
    assert fast.peak_allocated_bytes == pytest.approx(exact.peak_allocated_bytes, rel=0.005)

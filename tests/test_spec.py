"""Tests for hf_memfit.models.spec: the catalogue, name resolution and closed-form counts.

The closed-form numbers are checked against transformers' own models, built on
the meta device (no memory, no weights, no network).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
import re
import subprocess
import sys
import time
import warnings

import pytest

from hf_memfit.errors import MemFitError
from hf_memfit.tasks import TASK_TABLE
from hf_memfit.models.spec import (
    CATALOGUE_DIR,
    SUPPORTED_MODEL_TYPES,
    ModelSpec,
    _DEFAULTS,
    _PEFT_LORA_TARGETS,
    catalogue_names,
    load_model_config,
    resolve_model,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

ALL_MODELS = catalogue_names()
_LAYER_INDEX = re.compile(r"^(.*?)\.(\d+)\.")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    # These tests must never reach for the network.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def build_meta(config: dict, task: str, num_labels: int = 2):
    """Build the transformers model for `task` on the meta device."""
    hf_config = transformers.AutoConfig.for_model(**copy.deepcopy(config), num_labels=num_labels)
    auto = getattr(transformers, TASK_TABLE[task].auto_class)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return auto.from_config(hf_config)


def numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def real_linears(model) -> collections.Counter:
    """(name, in, out, bias, scope) -> count, scoped like `LinearModule.scope`.

    "head" is what lives outside the base model (`base_model_prefix`): a bare
    `lm_head`/`classifier`, but also a nested one such as ModernBERT's
    `head.dense` prediction head; without a base model, a top-level module.
    """
    prefix = getattr(model, "base_model_prefix", "") or ""
    has_base = bool(prefix) and hasattr(model, prefix) and getattr(model, prefix) is not model
    found: collections.Counter = collections.Counter()
    for path, module in model.named_modules():
        if isinstance(module, Conv1D):
            fan_in, fan_out = module.weight.shape  # Conv1D stores (in, out)
        elif isinstance(module, torch.nn.Linear):
            fan_in, fan_out = module.in_features, module.out_features
        else:
            continue
        outside_body = not path.startswith(prefix + ".") if has_base else "." not in path
        scope = "layer" if _in_stack(model, path + ".") else ("head" if outside_body else "other")
        found[(path.rsplit(".", 1)[-1], fan_in, fan_out, module.bias is not None, scope)] += 1
    return found


def spec_linears(spec: ModelSpec, task: str, num_labels: int = 2) -> collections.Counter:
    return collections.Counter({
        (m.name, m.in_features, m.out_features, m.bias, m.scope): m.count
        for m in spec.linear_modules(task, num_labels)
    })


def _in_stack(model, path: str):
    """The layer-index match of `path` where its numbered parent is a ModuleList of layers (not an nn.Sequential
    such as Qwen2.5-VL's merger MLP, nor a weight-norm parametrization), else None."""
    match = _LAYER_INDEX.match(path)
    if match is None:
        return None
    parent = model.get_submodule(match.group(1))
    is_stack = isinstance(parent, torch.nn.ModuleList) and \
        not isinstance(parent, torch.nn.utils.parametrize.ParametrizationList)
    return match if is_stack else None


def layer_params(model) -> dict[tuple[str, int], int]:
    """Parameters per (stack path, layer index)."""
    sizes: dict[tuple[str, int], int] = collections.defaultdict(int)
    for path, param in model.named_parameters():
        match = _in_stack(model, path)
        if match:
            sizes[(match.group(1), int(match.group(2)))] += param.numel()
    return sizes


def check_against_meta(spec: ModelSpec, task: str, num_labels: int = 2) -> None:
    model = build_meta(spec.config, task, num_labels)
    counts = spec.parameter_count(task, num_labels)
    assert counts["total"] == numel(model), (spec.name, task, counts)
    assert counts["total"] == counts["embedding"] + counts["layers"] + counts["final"] + counts["head"]
    assert spec_linears(spec, task, num_labels) == real_linears(model), (spec.name, task)
    # Per-layer sizes: layer 1 of each stack (layer 0 of T5 also holds the
    # relative-position table, which the spec counts with the embeddings).
    sizes = layer_params(model)
    stacks = sorted({stack for stack, _ in sizes})
    if spec.is_encoder_decoder:
        by_stack = {stack.split(".")[-2]: sizes[(stack, 1)] for stack in stacks}  # (model.)encoder.layers
        # (Whisper's causal-LM and audio classifier build one of its two stacks)
        assert by_stack and by_stack == {side: counts[f"per_{side}_layer"] for side in by_stack}
    else:
        # Every repeated stack (an image-text model also has its vision tower's) is in "layers";
        # "per_layer" is the mean over the stack that `num_hidden_layers` sets (ModernBERT's
        # layer 0 has no attention norm, so its layers are not all one size).
        assert counts["layers"] == sum(sizes.values())
        depth = [stack for stack in stacks if sum(s == stack for s, _ in sizes) == spec.num_layers]
        assert depth, (stacks, spec.num_layers)
        depth_sizes = [size for (stack, _), size in sizes.items() if stack == depth[0]]
        assert sum(depth_sizes) // spec.num_layers == counts["per_layer"]
        if spec.model_type in SUPPORTED_MODEL_TYPES:  # the hand-written families claim equal layers
            assert stacks == [depth[0]] and set(depth_sizes) == {counts["per_layer"]}
    if task in ("causal-lm", "seq2seq") and not spec.tie_word_embeddings:
        assert counts["head"] == model.get_output_embeddings().weight.numel()


# ---- the catalogue -----------------------------------------------------------


def test_catalogue_has_the_required_models():
    required = {
        "openai-community/gpt2", "openai-community/gpt2-medium", "openai-community/gpt2-large",
        "openai-community/gpt2-xl", "google-bert/bert-base-uncased", "google-bert/bert-large-uncased",
        "google-t5/t5-small", "google-t5/t5-base", "google-t5/t5-large", "google-t5/t5-3b",
        "facebook/opt-125m", "facebook/opt-350m", "facebook/opt-1.3b", "facebook/opt-2.7b",
        "facebook/opt-6.7b", "meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-13b-hf",
        "meta-llama/Llama-2-70b-hf", "meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-3B",
        "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B", "mistralai/Mistral-7B-v0.1",
        "Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-3B", "Qwen/Qwen2.5-7B",
        "Qwen/Qwen2.5-14B", "Qwen/Qwen2.5-32B", "Qwen/Qwen2.5-72B", "google/gemma-2-2b",
        "google/gemma-2-9b", "microsoft/Phi-3-mini-4k-instruct", "EleutherAI/pythia-160m",
        "EleutherAI/pythia-1b",
        # issue 9: the 2025 models people fine-tune, each copied from its published config.json
        "Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B-Base", "Qwen/Qwen3-14B", "Qwen/Qwen3-32B", "Qwen/Qwen3-30B-A3B",
        "google/gemma-3-4b-it", "google/gemma-3-12b-pt", "google/gemma-3-27b-it",
        "meta-llama/Llama-3.3-70B-Instruct", "microsoft/phi-4", "HuggingFaceTB/SmolLM3-3B",
        "openai/gpt-oss-20b", "allenai/OLMo-2-1124-7B", "allenai/OLMo-2-1124-13B",
        "answerdotai/ModernBERT-base", "answerdotai/ModernBERT-large",
    }
    assert required <= set(ALL_MODELS)
    for path in CATALOGUE_DIR.glob("*.json"):
        config = json.loads(path.read_text())
        assert config.get("model_type"), path.name
        if config["model_type"] not in SUPPORTED_MODEL_TYPES:  # added with issue 9: each names its source
            assert "huggingface.co/" in config.get("_source", ""), path.name
        assert isinstance(config.get("architectures"), list), path.name


@pytest.mark.parametrize("name", ALL_MODELS)
def test_catalogue_model_matches_transformers(name):
    spec = resolve_model(name)
    assert spec.name == name
    for task in spec.supported_tasks:
        check_against_meta(spec, task)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("gpt2", 124_439_808),
        ("gpt2-xl", 1_557_611_200),
        ("bert-base-uncased", 109_483_778),  # 109.48M body + a 2-label classifier
        ("t5-small", 60_506_624),
        ("t5-3b", 2_851_598_336),
        ("opt-350m", 331_196_416),
        ("Llama-2-7b-hf", 6_738_415_616),
        ("Llama-3.1-8B", 8_030_261_248),
        ("Llama-3.2-1B", 1_235_814_400),
        ("Mistral-7B-v0.1", 7_241_732_096),
        ("Qwen2.5-0.5B", 494_032_768),
        ("Qwen2.5-7B", 7_615_616_512),
        ("gemma-2-2b", 2_614_341_888),
        ("Phi-3-mini-4k-instruct", 3_821_079_552),
        ("pythia-160m", 162_322_944),
        # issue 9 catalogue; the published totals (safetensors, GGUF general.parameter_count or KerasHub preset)
        ("Qwen3-0.6B", 596_049_920),  # KerasHub qwen3_0.6b_en; the checkpoint also stores the tied lm_head
        ("Qwen3-14B", 14_768_307_200),
        ("Qwen3-32B", 32_762_123_264),
        ("Qwen3-30B-A3B", 30_532_122_624),  # all 128 experts; 3.3B active per token
        ("gemma-3-4b-it", 4_300_079_472),  # with the SigLIP vision tower
        ("gemma-3-12b-pt", 12_187_325_040),
        ("gemma-3-27b-it", 27_432_406_640),
        ("Llama-3.3-70B-Instruct", 70_553_706_496),
        ("phi-4", 14_659_507_200),
        ("OLMo-2-1124-7B", 7_298_617_344),
        ("OLMo-2-1124-13B", 13_716_198_400),
        # ModernBERT plans sequence classification: the published masked-LM checkpoints (149,655,232 and
        # 395,881,664) less the MLM decoder bias (50,368) plus a 2-label classifier
        ("ModernBERT-base", 149_655_232 - 50_368 + (768 * 2 + 2)),
        ("ModernBERT-large", 395_881_664 - 50_368 + (1024 * 2 + 2)),
    ],
)
def test_famous_parameter_counts(name, expected):
    # The published sizes of these checkpoints (their safetensors totals).
    assert resolve_model(name).parameter_count()["total"] == expected


def test_famous_counts_roughly():
    assert resolve_model("gpt2-xl").parameter_count()["total"] == pytest.approx(1.56e9, rel=0.01)
    assert resolve_model("Llama-3.1-8B").parameter_count()["total"] == pytest.approx(8.03e9, rel=0.01)
    assert resolve_model("Llama-3.1-70B").parameter_count()["total"] == pytest.approx(70.6e9, rel=0.01)


# ---- variants the catalogue does not cover ----------------------------------


def _variant(name: str, **overrides) -> ModelSpec:
    config = resolve_model(name).config
    for key, value in overrides.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    # Overrides first, then shrink: with_layers must also cut `layer_types`.
    return ModelSpec.from_config(name + "-variant", ModelSpec.from_config(name, config).with_layers(2))


VARIANTS = [
    ("Llama-3.2-1B", {"attention_bias": True, "mlp_bias": True, "head_dim": 96}),
    ("Llama-3.1-8B", {"tie_word_embeddings": True, "num_key_value_heads": None}),
    ("Mistral-7B-v0.1", {"head_dim": 64, "sliding_window": None}),
    ("Qwen2.5-0.5B", {"use_sliding_window": True, "max_window_layers": 1, "tie_word_embeddings": False}),
    ("Qwen2.5-0.5B", {"layer_types": ["full_attention"] * 24}),
    ("gemma-2-2b", {"attention_bias": True, "tie_word_embeddings": False,
                    "layer_types": ["sliding_attention", "full_attention"] * 13}),
    ("Phi-3-mini-4k-instruct", {"num_key_value_heads": 8, "tie_word_embeddings": True}),
    ("pythia-160m", {"attention_bias": False, "tie_word_embeddings": True}),
    ("gpt2", {"n_inner": 1000, "tie_word_embeddings": False}),
    ("opt-350m", {"enable_bias": False, "layer_norm_elementwise_affine": False,
                  "tie_word_embeddings": False}),
    ("opt-125m", {"do_layer_norm_before": False, "word_embed_proj_dim": 256}),
    ("opt-125m", {"_remove_final_layer_norm": True}),
    ("t5-small", {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
                  "num_decoder_layers": 3}),
    ("bert-base-uncased", {"type_vocab_size": 4}),
]


@pytest.mark.parametrize(("name", "overrides"), VARIANTS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(VARIANTS)])
def test_config_variants_match_transformers(name, overrides):
    spec = _variant(name, **overrides)
    for task in spec.supported_tasks:
        check_against_meta(spec, task, num_labels=3)


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_transformers_defaults_are_used_for_missing_keys(model_type):
    # A config holding only `model_type` must be read with transformers'
    # defaults, or a terse Hub config.json would be counted wrongly.
    spec = ModelSpec.from_config("bare", {"model_type": model_type})
    small = ModelSpec.from_config("bare-2", spec.with_layers(2))
    check_against_meta(small, small.default_task)


def test_defaults_table_matches_transformers_config_classes():
    for model_type, defaults in _DEFAULTS.items():
        fields = {f.name: f for f in dataclasses.fields(transformers.CONFIG_MAPPING[model_type])}
        for key, value in defaults.items():
            if key in fields:
                assert fields[key].default == value, (model_type, key)


def test_seq_cls_counts_depend_on_num_labels():
    spec = resolve_model("bert-base-uncased")
    five = spec.parameter_count("seq-cls", num_labels=5)
    two = spec.parameter_count("seq-cls", num_labels=2)
    assert five["total"] - two["total"] == 3 * (768 + 1)
    check_against_meta(resolve_model("Qwen2.5-0.5B"), "seq-cls", num_labels=7)


# ---- with_layers ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2-xl", "bert-base-uncased", "t5-base", "opt-350m", "Llama-3.1-8B",
                                  "gemma-2-9b", "Qwen2.5-7B", "Phi-3-mini-4k-instruct", "pythia-1b"])
def test_with_layers_builds_a_two_layer_model(name):
    spec = resolve_model(name)
    config = spec.with_layers(2)
    assert config is not spec.config
    small = ModelSpec.from_config(spec.name, config)
    assert small.num_layers == 2
    assert small.num_decoder_layers == (2 if spec.is_encoder_decoder else 0)
    model = build_meta(config, spec.default_task)
    stacks = collections.Counter(stack for stack, _ in layer_params(model))
    assert set(collections.Counter(idx for _, idx in layer_params(model))) == {0, 1}
    assert len(stacks) == (2 if spec.is_encoder_decoder else 1)
    assert numel(model) == small.parameter_count()["total"]
    # The original spec is untouched.
    assert spec.config == resolve_model(name).config


def test_with_layers_fixes_per_layer_lists():
    config = resolve_model("gemma-2-2b").config
    config["layer_types"] = ["sliding_attention", "full_attention"] * 13
    spec = ModelSpec.from_config("g", config)
    assert spec.layer_period == 2
    assert spec.with_layers(3)["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    build_meta(spec.with_layers(3), "causal-lm")


def test_layer_count_keys():
    assert resolve_model("gpt2").layer_count_keys == ("n_layer",)
    assert resolve_model("t5-small").layer_count_keys == ("num_layers", "num_decoder_layers")
    assert resolve_model("Llama-3.1-8B").layer_count_keys == ("num_hidden_layers",)
    with pytest.raises(MemFitError):
        resolve_model("gpt2").with_layers(0)


# ---- spec fields -----------------------------------------------------------------


def test_normalised_fields():
    gpt2 = resolve_model("gpt2-xl")
    assert (gpt2.hidden_size, gpt2.num_layers, gpt2.num_attention_heads, gpt2.intermediate_size) == (
        1600, 48, 25, 6400)
    assert gpt2.max_position_embeddings == 1024 and gpt2.tie_word_embeddings and not gpt2.gated_mlp

    t5 = resolve_model("t5-3b")
    assert (t5.num_layers, t5.num_decoder_layers, t5.head_dim, t5.intermediate_size) == (24, 24, 128, 16384)
    assert t5.max_position_embeddings is None and t5.is_encoder_decoder and t5.default_task == "seq2seq"

    opt = resolve_model("opt-350m")
    assert (opt.hidden_size, opt.embedding_dim, opt.intermediate_size) == (1024, 512, 4096)

    llama = resolve_model("llama-3.1-8b")
    assert (llama.num_key_value_heads, llama.head_dim, llama.vocab_size) == (8, 128, 128256)
    assert llama.gated_mlp and llama.norm_type == "rmsnorm" and not llama.tie_word_embeddings
    assert llama.dtype == "bfloat16"

    gemma = resolve_model("gemma-2-9b")
    assert gemma.layer_period == 2 and gemma.sliding_window == 4096 and gemma.head_dim == 256
    assert gemma.hidden_act == "gelu_pytorch_tanh" and gemma.norms_per_layer == 4

    assert resolve_model("Qwen2.5-7B").sliding_window is None  # use_sliding_window is false
    assert resolve_model("Qwen2.5-7B").qkv_bias and not resolve_model("Qwen2.5-7B").attn_out_bias
    assert resolve_model("bert-base-uncased").default_task == "seq-cls"
    assert resolve_model("gpt2").attention_dropout == 0.1
    assert resolve_model("Phi-3-mini-4k-instruct").fused_qkv


def test_unsupported_task_and_model_type():
    with pytest.raises(MemFitError, match="`task`"):
        resolve_model("gpt2").parameter_count("seq2seq")
    import transformers

    with pytest.raises(MemFitError, match=f"model_type `no_such_arch`.*transformers {transformers.__version__}"):
        ModelSpec.from_config("x", {"model_type": "no_such_arch"})
    with pytest.raises(MemFitError, match="no `model_type`"):
        ModelSpec.from_config("x", {"hidden_size": 8})


# ---- LoRA targets ------------------------------------------------------------------


def test_default_lora_targets_mirror_peft():
    peft_constants = pytest.importorskip("peft.utils.constants")
    mapping = peft_constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    for model_type in SUPPORTED_MODEL_TYPES:
        assert _PEFT_LORA_TARGETS.get(model_type) == mapping.get(model_type), model_type
    for name in ALL_MODELS:
        spec = resolve_model(name)
        if spec.model_type not in mapping:
            with pytest.raises(MemFitError, match="--lora-target-modules"):
                spec.default_lora_target_modules()
            continue
        layer_names = {m.name for m in spec.linear_modules() if m.scope == "layer"}
        assert set(spec.default_lora_target_modules()) <= layer_names, name


# ---- resolving names ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("typed", "canonical"),
    [
        ("gpt2-xl", "openai-community/gpt2-xl"),
        ("gpt2", "openai-community/gpt2"),
        ("openai-community/gpt2-xl", "openai-community/gpt2-xl"),
        ("OPENAI-COMMUNITY/GPT2-XL", "openai-community/gpt2-xl"),
        ("bert-base-uncased", "google-bert/bert-base-uncased"),
        ("t5-small", "google-t5/t5-small"),
        ("Llama-3.1-8B", "meta-llama/Llama-3.1-8B"),
        ("llama-3.1-8b", "meta-llama/Llama-3.1-8B"),
        ("meta-llama--Llama-3.1-8B", "meta-llama/Llama-3.1-8B"),
        ("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B"),
        ("  gemma-2-2b ", "google/gemma-2-2b"),
    ],
)
def test_short_names_resolve(typed, canonical):
    name, config = load_model_config(typed)
    assert name == canonical
    assert config == json.loads((CATALOGUE_DIR / (canonical.replace("/", "--") + ".json")).read_text())


def test_local_directory_and_config_path_resolve(tmp_path):
    config = resolve_model("gpt2").config
    config["n_layer"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    name, loaded = load_model_config(str(tmp_path))
    assert name == str(tmp_path) and loaded["n_layer"] == 3
    name, loaded = load_model_config(str(tmp_path / "config.json"))
    assert loaded["n_layer"] == 3
    assert resolve_model(str(tmp_path)).num_layers == 3
    # A local directory wins over a catalogue name of the same spelling.
    local = tmp_path / "gpt2-xl"
    local.mkdir()
    (local / "config.json").write_text(json.dumps(config))
    assert load_model_config(str(local))[1]["n_layer"] == 3


def test_bad_local_paths_raise(tmp_path):
    with pytest.raises(MemFitError, match="has no config.json"):
        load_model_config(str(tmp_path))
    with pytest.raises(MemFitError, match="does not exist"):
        load_model_config(str(tmp_path / "missing" / "config.json"))
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(MemFitError, match="not valid JSON"):
        load_model_config(str(bad))
    with pytest.raises(MemFitError, match="`model` is empty"):
        load_model_config("  ")


def test_unknown_name_lists_close_matches():
    started = time.perf_counter()
    with pytest.raises(MemFitError) as info:
        load_model_config("llama-3-8b")
    message = str(info.value)
    assert time.perf_counter() - started < 2  # offline must fail fast
    assert "\n" not in message
    assert message.startswith("unknown model `llama-3-8b`")
    assert "HF_HUB_OFFLINE" in message
    close = message.split("close matches: ")[1]
    assert "meta-llama/Llama-3.1-8B" in close
    assert "local directory / config.json path" in message


@pytest.mark.parametrize(("typed", "expected"), [
    ("gpt2-xxl", "openai-community/gpt2-xl"),
    ("Qwen/Qwen2.5-8B", "Qwen/Qwen2.5-7B"),
    ("mistral-7b", "mistralai/Mistral-7B-v0.1"),
    ("t5-smal", "google-t5/t5-small"),
])
def test_close_matches_use_full_ids_and_short_names(typed, expected):
    with pytest.raises(MemFitError, match=re.escape(expected)):
        load_model_config(typed)


def test_no_close_match_still_one_line():
    with pytest.raises(MemFitError) as info:
        load_model_config("zzzzqqqq")
    assert "no close catalogue matches" in str(info.value) and "\n" not in str(info.value)


# ---- fast path -----------------------------------------------------------------------


def test_spec_module_imports_neither_torch_nor_transformers():
    code = (
        "import sys, hf_memfit.models.spec as s; s.resolve_model('gpt2-xl').parameter_count(); "
        "s.resolve_model('t5-small').linear_modules(); "
        "bad = [m for m in ('torch', 'transformers', 'peft', 'huggingface_hub') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_family_knowledge_lives_in_the_family_modules():
    """One place per family: no shared module branches on model_type; each type has exactly one module."""
    import re
    from pathlib import Path

    from hf_memfit import models

    root = Path(models.__file__).parent.parent
    for shared in ("models/spec.py", "models/forward.py", "models/generic.py", "models/build.py", "estimator/fast.py",
                   "estimator/fast_params.py", "estimator/fast_heads.py", "estimator/trace.py", "estimator/parametric.py"):
        text = (root / shared).read_text()
        assert not re.search(r"model_type\s*(==|!=|in\s*[(\[{])", text), shared
    owners = {}
    for module in models.family_modules():
        for model_type in module.MODEL_TYPES:
            assert model_type not in owners, (model_type, owners.get(model_type), module.__name__)
            owners[model_type] = module.__name__
            assert set(module.DEFAULTS) == set(module.MODEL_TYPES)
        assert callable(module.fields) and callable(module.linears) and callable(module.counts)
        assert hasattr(module, "Forward")
    assert set(owners) == set(models.hand_written_types())


def test_only_a_learned_position_table_limits_the_sequence(tmp_path, monkeypatch):
    """GPT-2/BERT/OPT (and any generic model with a table of `max_position_embeddings` rows) refuse a longer
    sequence; rotary models plan it, with a note that quality past the trained context needs RoPE scaling."""
    import json

    from hf_memfit.estimator import estimate

    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path / "cache"))
    assert resolve_model("gpt2").learned_positions and resolve_model("bert-base-uncased").learned_positions
    assert resolve_model("facebook/opt-125m").learned_positions
    llama = resolve_model("meta-llama/Llama-3.1-8B")
    assert not llama.learned_positions
    with pytest.raises(MemFitError, match="maximum of 1024 positions"):
        estimate("gpt2", batch_size=1, seq_len=1025)
    est = estimate(llama, batch_size=1, seq_len=2 * llama.max_position_embeddings, gradient_checkpointing=True)
    assert est.device_total_bytes > 0
    assert any("beyond" in n and "rope_scaling" in n for n in est.notes)
    assert not any("beyond" in n for n in estimate(llama, batch_size=1, seq_len=4096).notes)
    # the generic path finds the table itself: BioGPT's embed_positions (max + 2 rows) vs Qwen3's rotary positions
    tiny = dict(model_type="biogpt", num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                vocab_size=100, max_position_embeddings=64)
    (tmp_path / "biogpt.json").write_text(json.dumps(tiny))
    biogpt = resolve_model(str(tmp_path / "biogpt.json"))
    assert not biogpt.hand_written and biogpt.learned_positions
    qwen = ModelSpec.from_config("tiny-qwen3", dict(model_type="qwen3", num_hidden_layers=2, hidden_size=32,
                                                    intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                                                    head_dim=16, vocab_size=100, max_position_embeddings=64))
    assert not qwen.hand_written and not qwen.learned_positions


def test_peft_default_targets_read_from_source_are_peft_s_own():
    """Generic families take peft's default LoRA targets from the installed peft's source (a dict literal), not by
    importing peft (3.4 s of a cold plan): the two must be the same mapping."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as imported

    from hf_memfit.models.generic import _peft_lora_mapping_from_source

    read = _peft_lora_mapping_from_source()
    assert read is not None and read == dict(imported)


def test_a_described_spec_keys_its_caches_as_the_same_spec_read_back(tmp_path, monkeypatch):
    """transformers' config classes write into the nested dicts they are given (Qwen2.5-VL's `rope_scaling` gains
    `rope_theta` and `rope_type`). A spec's config keys every cached fit and trace, so a spec described in one
    process must hash as the same spec read back from the cache in the next: otherwise a second plan traces every
    fit again (a cold Qwen2.5-VL plan: 16 traces twice)."""
    from hf_memfit.cache import config_key
    from hf_memfit.models import spec as spec_module

    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path))

    def fresh_process_resolve():  # as a new process would: nothing memoised in this one
        for value in vars(spec_module).values():
            if hasattr(value, "cache_clear"):
                value.cache_clear()
        return resolve_model("Qwen/Qwen2.5-VL-7B-Instruct")

    described = fresh_process_resolve()
    assert any(tmp_path.rglob("*.json"))  # the description was cached
    read_back = fresh_process_resolve()
    assert read_back is not described
    assert config_key(described.config) == config_key(read_back.config)

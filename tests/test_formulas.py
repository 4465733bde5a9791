"""Fast mode (`hf_memfit.estimator.fast`): model-state arithmetic, LoRA counts, and agreement with exact mode.

The closed-form estimate is checked against exact mode (the real training step
traced on fake tensors) on small versions of catalogue models, so each exact
trace takes a second or two. Everything runs offline on the CPU.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest

from hf_memfit.estimator.breakdown import CATEGORIES, is_optimizer_region
from hf_memfit.errors import MemFitError
from hf_memfit.estimator.fast import fast_step_memory
from hf_memfit.settings import TrainSettings
from hf_memfit.models.spec import ModelSpec, resolve_model
from hf_memfit.tasks import TASK_TABLE


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def small(name: str, **overrides) -> ModelSpec:
    """A catalogue model with its sizes cut down, so exact mode traces it in a second or two."""
    spec = resolve_model(name)
    config = copy.deepcopy(spec.config)
    config.update(overrides)
    return ModelSpec.from_config(name + "-small", config)


SMALL = {
    "gpt2": lambda: small("gpt2", n_embd=128, n_head=4, n_layer=2, vocab_size=2000),
    "llama": lambda: small("meta-llama/Llama-3.2-1B", hidden_size=128, intermediate_size=384, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, num_hidden_layers=2, vocab_size=2000),
    "bert": lambda: small("google-bert/bert-base-uncased", hidden_size=128, intermediate_size=512,
                          num_attention_heads=4, num_hidden_layers=2, vocab_size=2000),
    "t5": lambda: small("google-t5/t5-small", d_model=128, d_kv=32, d_ff=256, num_heads=4, num_layers=2,
                        num_decoder_layers=2, vocab_size=2000),
    "opt": lambda: small("facebook/opt-125m", hidden_size=128, ffn_dim=512, num_attention_heads=4,
                         num_hidden_layers=2, vocab_size=2000, word_embed_proj_dim=128),
    "pythia": lambda: small("EleutherAI/pythia-160m", hidden_size=128, intermediate_size=512, num_attention_heads=4,
                            num_hidden_layers=2, vocab_size=2000),
    "gemma2": lambda: small("google/gemma-2-2b", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, num_hidden_layers=2, vocab_size=2000),
}


def peak(step) -> int:
    return max(sum(b.values()) for b in step.candidates.values())


# ---- no torch on the fast path ---------------------------------------------------


def test_fast_mode_never_imports_torch():
    code = (
        "import sys\n"
        "from hf_memfit.estimator.fast import fast_step_memory\n"
        "from hf_memfit.settings import TrainSettings\n"
        "from hf_memfit.models.spec import resolve_model\n"
        "for name, kw in [('gpt2', {}), ('meta-llama/Llama-3.2-1B', {'precision': 'bf16-mixed', 'lora_r': 8,"
        " 'gradient_checkpointing': True, 'gradient_accumulation_steps': 2}),"
        " ('google-t5/t5-small', {'device': 'cpu', 'attn_implementation': 'eager', 'gpu': None})]:\n"
        "    spec = resolve_model(name)\n"
        "    fast_step_memory(spec, TrainSettings(**kw).validate(spec))\n"
        "heavy = [m for m in ('torch', 'transformers', 'peft', 'accelerate', 'bitsandbytes') if m in sys.modules]\n"
        "print(heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# ---- the result's shape -------------------------------------------------------------


def test_regions_and_categories():
    spec = resolve_model("gpt2")
    step = fast_step_memory(spec, TrainSettings(batch_size=2, seq_len=256).validate(spec))
    assert {"1.0|fwd|s0.post", "1.0|bwd|pre", "1.0|bwd|s0.first", "1.0|bwd|s0.last", "1.0|opt"} <= set(step.candidates)
    assert [r for r in step.candidates if is_optimizer_region(r)] == ["1.0|opt"]
    for breakdown in step.candidates.values():
        assert set(breakdown) == set(CATEGORIES)
        assert all(isinstance(v, int) and v >= 0 for v in breakdown.values())


def test_gradient_accumulation_adds_later_micro_batch_regions():
    spec = resolve_model("gpt2")
    one = fast_step_memory(spec, TrainSettings(batch_size=2, seq_len=256).validate(spec))
    two = fast_step_memory(spec, TrainSettings(batch_size=2, seq_len=256, gradient_accumulation_steps=2).validate(spec))
    assert not any(r.startswith("1.1|") for r in one.candidates)
    assert {"1.1|fwd|s0.post", "1.1|bwd|pre", "1.1|opt"} <= set(two.candidates)
    grads = sum(b["gradients"] for r, b in two.candidates.items() if r == "1.1|opt")
    # the later micro-batch runs its forward with every gradient already allocated
    assert two.candidates["1.1|fwd|s0.post"]["gradients"] == grads > 0
    assert two.candidates["1.0|fwd|s0.post"]["gradients"] == 0
    assert peak(two) > peak(one)


def test_task_is_resolved_when_missing():
    spec = resolve_model("google-bert/bert-base-uncased")
    step = fast_step_memory(spec, TrainSettings(batch_size=2, seq_len=128))
    assert step.total_params == spec.parameter_count("seq-cls")["total"]


# ---- model states are exact arithmetic ------------------------------------------------


def _states(step):
    opt = step.candidates[next(r for r in step.candidates if is_optimizer_region(r))]
    return opt["weights"], opt["gradients"], opt["optimizer"]


@pytest.mark.parametrize("name", ["gpt2", "meta-llama/Llama-3.2-1B", "google-t5/t5-small", "facebook/opt-350m"])
def test_fp32_adamw_states(name):
    spec = resolve_model(name)
    settings = TrainSettings(batch_size=1, seq_len=128, device="cpu").validate(spec)
    step = fast_step_memory(spec, settings)
    weights, grads, optimizer = _states(step)
    n = step.total_params
    assert step.trainable_params == n == spec.parameter_count(settings.task)["total"]
    assert weights == grads == 4 * n
    # exp_avg and exp_avg_sq in fp32, plus one 4-byte `step` scalar per parameter tensor
    assert 8 * n < optimizer < 8 * n + 4 * 2000


def test_half_precision_and_optimizer_layouts():
    spec = resolve_model("gpt2")
    n = spec.parameter_count("causal-lm")["total"]
    base = dict(batch_size=1, seq_len=128, device="cpu")
    w, g, o = _states(fast_step_memory(spec, TrainSettings(precision="bf16", **base).validate(spec)))
    assert w == g == 2 * n and 4 * n < o < 4 * n + 4 * 2000  # torch AdamW states follow the param dtype
    w, g, o = _states(fast_step_memory(spec, TrainSettings(precision="bf16-mixed", **base).validate(spec)))
    assert w == g == 4 * n  # fp32 master weights under autocast
    assert _states(fast_step_memory(spec, TrainSettings(optim="sgd", **base).validate(spec)))[2] == 0
    # bitsandbytes 8-bit: two uint8 states and an fp32 absmax per 256 elements for big tensors, except
    # the embedding tables (GPT-2's wte, tied to the head, and wpe), which the Trainer keeps in 32 bits
    o8 = _states(fast_step_memory(spec, TrainSettings(optim="adamw_bnb_8bit", **base).validate(spec)))[2]
    embeddings = (spec.vocab_size + spec.max_position_embeddings) * spec.hidden_size
    rest = n - embeddings
    assert 8 * embeddings + 2 * rest < o8 < 8 * embeddings + 2 * rest * (1 + 4 / 256) + 8 * 100_000
    # Adafactor: factored row and column fp32 states for matrices, so far less than one state per param
    oaf = _states(fast_step_memory(spec, TrainSettings(optim="adafactor", **base).validate(spec)))[2]
    h, v, p = spec.hidden_size, spec.vocab_size, spec.max_position_embeddings
    assert 4 * (v + h + p + h) < oaf < 0.01 * 4 * n


def test_cuda_rounds_every_tensor_to_512_bytes():
    spec = resolve_model("gpt2")
    cpu = _states(fast_step_memory(spec, TrainSettings(device="cpu").validate(spec)))
    cuda = _states(fast_step_memory(spec, TrainSettings(device="cuda").validate(spec)))
    assert all(c >= p for c, p in zip(cuda, cpu))
    assert all(c % 512 == 0 for c in cuda)


def test_lora_states_and_4bit_facts():
    spec = resolve_model("meta-llama/Llama-3.2-1B")
    settings = TrainSettings(precision="bf16-mixed", lora_r=16, load_in_4bit=True).validate(spec)
    step = fast_step_memory(spec, settings)
    h, layers = spec.hidden_size, spec.num_layers
    kv = spec.num_key_value_heads * spec.head_dim
    # q_proj and v_proj adapters: r * (in + out) each, in every layer
    assert step.trainable_params == layers * 16 * ((h + h) + (h + kv))
    w, g, o = _states(step)
    assert g == 4 * step.trainable_params + 0  # adapters stay fp32 (peft autocasts their dtype)
    assert 8 * step.trainable_params <= o <= 8 * step.trainable_params + 512 * 1000
    linears = [m for m in spec.linear_modules() if m.scope != "head"]
    assert step.quantizable_linear_params == sum(m.weight_numel * m.count for m in linears)
    assert step.largest_linear_numel == max(m.weight_numel for m in linears)
    plain = fast_step_memory(spec, TrainSettings(precision="bf16-mixed", lora_r=16).validate(spec))
    assert plain.quantizable_linear_params == 0


def test_lora_without_default_targets_raises():
    spec = resolve_model("microsoft/Phi-3-mini-4k-instruct")
    with pytest.raises(MemFitError, match="lora-target-modules"):
        fast_step_memory(spec, TrainSettings(lora_r=8).validate(spec))


# ---- the activation model's direction ---------------------------------------------------


def test_activation_knobs_move_the_peak_the_right_way():
    spec = resolve_model("meta-llama/Llama-3.2-1B")

    def act(**kw):
        step = fast_step_memory(spec, TrainSettings(precision="bf16-mixed", **kw).validate(spec))
        return max(b["activations"] + b["temporary"] for b in step.candidates.values())

    assert act(batch_size=4, seq_len=1024) > act(batch_size=2, seq_len=1024) > act(batch_size=2, seq_len=512)
    assert act(batch_size=4, seq_len=1024, gradient_checkpointing=True) < act(batch_size=4, seq_len=1024)
    assert act(batch_size=2, seq_len=1024, attn_implementation="eager") > act(batch_size=2, seq_len=1024)


# ---- LoRA parameter counts agree with peft ------------------------------------------------


@pytest.mark.parametrize("name, task, r, targets", [
    ("openai-community/gpt2", "causal-lm", 8, None),
    ("openai-community/gpt2", "seq-cls", 4, None),
    ("meta-llama/Llama-3.2-1B", "causal-lm", 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj")),
    ("google-bert/bert-base-uncased", "seq-cls", 8, ("query", "value", "dense")),
    ("google-t5/t5-small", "seq2seq", 8, None),
    ("facebook/opt-350m", "causal-lm", 8, ("q_proj", "project_in", "fc1")),
    ("microsoft/Phi-3-mini-4k-instruct", "causal-lm", 8, ("qkv_proj", "gate_up_proj")),
    ("EleutherAI/pythia-160m", "seq-cls", 8, None),
])
def test_lora_counts_match_peft(name, task, r, targets):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    spec = resolve_model(name)
    config = transformers.AutoConfig.for_model(**copy.deepcopy(spec.config), num_labels=2)
    if task == "seq-cls" and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0
    task_type = {"causal-lm": "CAUSAL_LM", "seq-cls": "SEQ_CLS", "seq2seq": "SEQ_2_SEQ_LM"}[task]
    kwargs = {"r": r, "task_type": task_type}
    if targets:
        kwargs["target_modules"] = list(targets)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = getattr(transformers, TASK_TABLE[task].auto_class).from_config(config)
        model = peft.get_peft_model(model, peft.LoraConfig(**kwargs))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    step = fast_step_memory(spec, TrainSettings(task=task, lora_r=r, lora_target_modules=targets).validate(spec))
    assert (step.trainable_params, step.total_params) == (trainable, total)
    assert step.largest_param_numel == max(p.numel() for p in model.parameters())


# ---- agreement with exact mode -----------------------------------------------------------


EXACT_CASES = [
    ("gpt2", dict(batch_size=2, seq_len=128, device="cuda", precision="bf16-mixed")),
    ("gpt2", dict(batch_size=2, seq_len=128, device="cpu", attn_implementation="eager",
                  gradient_accumulation_steps=2, optim="sgd")),
    ("llama", dict(batch_size=2, seq_len=128, device="cuda", precision="bf16-mixed", lora_r=8,
                   gradient_checkpointing=True)),
    ("llama", dict(batch_size=2, seq_len=256, device="cuda", precision="bf16", optim="adamw_bnb_8bit")),
    ("bert", dict(batch_size=4, seq_len=128, device="cuda", precision="fp32", optim="adamw_torch_fused")),
    ("t5", dict(batch_size=2, seq_len=128, device="cpu", precision="bf16-mixed", optim="adafactor")),
    # CUDA autocast's cross_entropy of T5's bf16 logits: half log_softmax, nll_loss's fp32 copy (fast_heads)
    ("t5", dict(batch_size=2, seq_len=128, device="cuda", precision="bf16-mixed")),
    ("opt", dict(batch_size=2, seq_len=128, device="cuda", precision="bf16-mixed", attn_implementation="eager")),
    ("pythia", dict(batch_size=2, seq_len=128, device="cuda", precision="fp16-mixed", gradient_checkpointing=True)),
    ("gemma2", dict(batch_size=2, seq_len=128, device="cuda", precision="bf16-mixed", attn_implementation="eager")),
]


@pytest.mark.parametrize("family, kwargs", EXACT_CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(EXACT_CASES)])
def test_fast_mode_agrees_with_exact_mode(family, kwargs):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_memfit.estimator.exact import exact_candidates

    spec = SMALL[family]()
    settings = TrainSettings(**kwargs).validate(spec)
    fast = fast_step_memory(spec, settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = exact_candidates(spec, settings)
    assert abs(peak(fast) / peak(exact) - 1) <= 0.10, (peak(fast), peak(exact))
    assert (fast.trainable_params, fast.total_params) == (exact.trainable_params, exact.total_params)
    assert fast.largest_param_numel == exact.largest_param_numel
    # model states at the optimizer step are exact arithmetic
    region = next(r for r in fast.candidates if is_optimizer_region(r))
    for category in ("gradients", "optimizer"):
        assert fast.candidates[region][category] == exact.candidates[region][category], category
    # every region both modes report agrees too (normalised by the peak)
    for region in set(fast.candidates) & set(exact.candidates):
        gap = abs(sum(fast.candidates[region].values()) - sum(exact.candidates[region].values()))
        assert gap <= 0.10 * peak(exact), region

"""Exact mode against the CPU allocator's real peak, on tiny models built from configs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_memfit.estimator.measure import measure_cpu_peak
from hf_memfit.settings import TrainSettings
from hf_memfit.estimator.exact import exact_candidates, trace_step

CASES = [
    ("gpt2", {}),
    ("gpt2", {"precision": "bf16-mixed"}),
    ("gpt2", {"lora_r": 4}),
    ("gpt2", {"gradient_accumulation_steps": 3, "optim": "adamw_torch_fused"}),
    ("llama", {"precision": "bf16", "gradient_checkpointing": True}),
    ("llama", {"optim": "adafactor"}),
    ("llama", {"optim": "sgd", "attn_implementation": "eager"}),
    ("t5", {}),
    ("bert", {"task": "seq-cls"}),
    # peft wraps the classification head in a ModulesToSaveWrapper, a deep copy of the head
    ("bert", {"task": "seq-cls", "lora_r": 8}),
    ("gpt2", {"task": "seq-cls", "lora_r": 4}),
]


@pytest.mark.parametrize("model,changes", CASES, ids=[f"{m}-{'-'.join(f'{k}={v}' for k, v in c.items()) or 'default'}"
                                                      for m, c in CASES])
def test_exact_matches_the_cpu_allocator(tiny_specs, model, changes):
    spec = tiny_specs[model]
    settings = TrainSettings(batch_size=2, seq_len=32, device="cpu", mode="exact", **changes).validate(spec)
    predicted = exact_candidates(spec, settings).peak_bytes  # 5 layers: traced at 2 and 3, extrapolated
    measured = measure_cpu_peak(spec.config, settings)
    assert abs(predicted - measured) / measured < 0.01, (predicted, measured)


def test_layer_extrapolation_equals_a_full_trace(tiny_specs):
    spec = tiny_specs["llama"]
    settings = TrainSettings(batch_size=2, seq_len=32, device="cuda", precision="bf16-mixed").validate(spec)
    extrapolated = exact_candidates(spec, settings).peak_bytes
    full = exact_candidates(spec, settings, extrapolate=False).peak_bytes
    assert abs(extrapolated - full) <= 0.001 * full


def test_region_classes_name_the_same_layer_at_both_traced_depths():
    """A stack of period p is traced at 2p and 3p layers; each layer of its first and last period is a class
    (not only its first and last layer: the peak of a hybrid stack can be in any layer of the pattern), named
    in the order the phase runs the layers; at the real depth every layer is a class (estimator/regions.py)."""
    from hf_memfit.estimator.regions import region_class

    def classes(phase, depth, period):
        return {layer: region_class(f"1.0|{phase}|s0.L{layer}", depth, period) for layer in range(depth)}

    assert classes("fwd", 4, 2) == {0: ["1.0|fwd|s0.first"], 1: ["1.0|fwd|s0.first+1"],
                                    2: ["1.0|fwd|s0.last-1"], 3: ["1.0|fwd|s0.last"]}
    grown = classes("bwd", 6, 2)  # backward runs layer 5 first; the middle period stands for no class
    assert grown == {5: ["1.0|bwd|s0.first"], 4: ["1.0|bwd|s0.first+1"], 3: [], 2: [],
                     1: ["1.0|bwd|s0.last-1"], 0: ["1.0|bwd|s0.last"]}
    for phase in ("fwd", "bwd"):  # the same layer of the pattern under one name at 2p and 3p layers
        base, grown = classes(phase, 4, 2), classes(phase, 6, 2)
        for layer, named in base.items():
            same = [other for other, name in grown.items() if name == named]
            assert same and all(other % 2 == layer % 2 for other in same), (phase, layer)
    assert all(classes("bwd", 5, None).values())  # full depth: no layer dropped
    assert classes("fwd", 3, 1) == {0: ["1.0|fwd|s0.first"], 1: [], 2: ["1.0|fwd|s0.last"]}  # period 1 as before
    assert region_class("1.0|bwd|s0.post", 4, 2) == ["1.0|bwd|s0.post"]


def test_cuda_attention_keeps_no_quadratic_scores(tiny_specs):
    """On CUDA, SDPA's flash kernel saves O(s) per head; eager attention keeps s x s probabilities."""
    spec = tiny_specs["llama"]
    base = dict(batch_size=1, device="cuda", precision="bf16-mixed", mode="exact")
    growth = {}
    for attn in ("sdpa", "eager"):
        short = exact_candidates(spec, TrainSettings(seq_len=128, attn_implementation=attn, **base).validate(spec))
        long = exact_candidates(spec, TrainSettings(seq_len=512, attn_implementation=attn, **base).validate(spec))
        growth[attn] = long.peak_bytes - short.peak_bytes
    assert growth["eager"] > 2 * growth["sdpa"]


def test_breakdown_names_model_states(tiny_specs):
    spec = tiny_specs["gpt2"]
    settings = TrainSettings(batch_size=1, seq_len=16, device="cpu", mode="exact").validate(spec)
    step = exact_candidates(spec, settings)
    opt = step.candidates["1.0|opt"]
    params = step.total_params
    assert opt["weights"] >= 4 * params
    assert opt["gradients"] == pytest.approx(4 * params, rel=0.01)
    assert opt["optimizer"] == pytest.approx(8 * params, rel=0.01)  # AdamW: exp_avg + exp_avg_sq, fp32


def test_deepcopy_of_a_fake_module_allocates_and_keeps_its_fake_mode():
    """Deep-copying under exact mode must not copy the FakeTensorMode (its StorageWeakRefs are raw pointers)."""
    import copy

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hf_memfit.estimator.fake_patches import deepcopy_fake_tensors_as_real_ones
    from hf_memfit.estimator.trace import StorageTracker

    fake_mode, tracker = FakeTensorMode(allow_non_fake_inputs=True), StorageTracker()
    with fake_mode, tracker, deepcopy_fake_tensors_as_real_ones():
        torch.tensor(3.0)  # a constant: the converter keeps a StorageWeakRef to its real storage
        module = torch.nn.Linear(8, 4)
        module.register_buffer("table", torch.zeros(10, 3)[2:5])  # a view: the whole storage is copied
        before = tracker.live_bytes
        clone = copy.deepcopy(module)
        assert tracker.live_bytes - before == (8 * 4 + 4 + 10 * 3) * 4
    assert isinstance(clone.weight, torch.nn.Parameter) and clone.weight.requires_grad
    assert clone.weight.untyped_storage()._cdata != module.weight.untyped_storage()._cdata
    for tensor in (clone.weight, clone.bias, clone.table):
        assert tensor.fake_mode is fake_mode
    assert clone.table.shape == (3, 3) and clone.table.storage_offset() == 6


_REPEATED_LORA_SEQ_CLS = """
import json, sys
from hf_memfit.settings import TrainSettings
from hf_memfit.models.spec import ModelSpec
from hf_memfit.estimator.exact import exact_candidates
specs = {name: ModelSpec.from_config(f"tiny-{name}", cfg) for name, cfg in json.loads(sys.argv[1]).items()}
peaks = {name: [] for name in specs}
for _ in range(3):
    for name, spec in specs.items():
        settings = TrainSettings(batch_size=2, seq_len=32, device="cpu", mode="exact", task="seq-cls",
                                 lora_r=8).validate(spec)
        peaks[name].append(exact_candidates(spec, settings).peak_bytes)
print("PEAKS " + json.dumps(peaks), flush=True)
"""


def test_repeated_lora_seq_cls_estimates_in_one_process(tiny_specs):
    """Regression: LoRA on seq-cls corrupted the heap (a later trace segfaulted); run it apart from pytest."""
    configs = {name: tiny_specs[name].config for name in ("bert", "gpt2")}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _REPEATED_LORA_SEQ_CLS, json.dumps(configs)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert "Accessing the data pointer of FakeTensor" not in proc.stderr  # torch's deepcopy of a FakeTensor
    peaks = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("PEAKS "))[6:])
    for name, predicted in peaks.items():
        spec = tiny_specs[name]
        settings = TrainSettings(batch_size=2, seq_len=32, device="cpu", task="seq-cls", lora_r=8).validate(spec)
        measured = measure_cpu_peak(spec.config, settings)
        assert len(predicted) == 3
        for peak in predicted:
            assert abs(peak - measured) / measured < 0.01, (name, predicted, measured)


@pytest.mark.parametrize("optim", ["adamw_bnb_8bit", "paged_adamw_32bit"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bitsandbytes_cpu_step_temporaries(optim, precision):
    """bitsandbytes' CPU kernels keep fp32 temporaries of the tensor being updated (20-24 B/element for
    8-bit, 12-16 for 32-bit); with a wide vocabulary the embedding's update is the peak of the step."""
    from conftest import TINY_BERT
    from hf_memfit.estimator.fast import fast_step_memory
    from hf_memfit.models.spec import ModelSpec

    spec = ModelSpec.from_config("tiny-bert-wide-vocab", dict(TINY_BERT, vocab_size=4000))
    settings = TrainSettings(batch_size=2, seq_len=32, device="cpu", task="seq-cls", optim=optim,
                             precision=precision).validate(spec)
    exact = exact_candidates(spec, settings.replace(mode="exact"))
    fast = fast_step_memory(spec, settings)
    measured = measure_cpu_peak(spec.config, settings)
    assert exact.peak_region.endswith("|opt") and fast.peak_region.endswith("|opt")  # the case under test
    for predicted in (exact.peak_bytes, fast.peak_bytes):
        assert abs(predicted - measured) / measured < 0.01, (predicted, measured)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_cuda_fp16_eager_checkpointing_recomputes_under_cuda_autocast(tiny_specs, checkpointing):
    """Issue 12 item 3: BERT, eager attention, fp16-mixed, checkpointing, device cuda crashed in exact mode.

    CUDA autocast's fp32 softmax must hold in the recompute inside backward too, or checkpoint refuses
    the recomputed fp16 probabilities (saved fp32). Exact mode must run and agree with the closed-form model.
    """
    from hf_memfit.estimator.assemble import estimate_settings

    spec = tiny_specs["bert"]
    peaks = {}
    for mode in ("fast", "exact"):
        settings = TrainSettings(batch_size=2, seq_len=128, task="seq-cls", device="cuda", gpu="v100",
                                 precision="fp16-mixed", attn_implementation="eager",
                                 gradient_checkpointing=checkpointing, mode=mode)
        peaks[mode] = estimate_settings(spec, settings).peak_allocated_bytes
    assert abs(peaks["exact"] - peaks["fast"]) / peaks["fast"] < 0.02, peaks


def test_a_lora_trace_shows_no_library_deprecation_warnings():
    """peft reads transformers' deprecated `is_gradient_checkpointing` when it wraps a model: inside hf-memfit's own
    trace that is noise in a plan's output (the user's own code still gets its warnings outside the trace)."""
    import warnings

    from conftest import TINY_LLAMA

    from hf_memfit.models.spec import ModelSpec

    import peft  # noqa: F401 - its import-time warnings are not the trace's

    spec = ModelSpec.from_config("llama", TINY_LLAMA)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FutureWarning)  # what Python shows a user by default, every time
        exact_candidates(spec, TrainSettings(batch_size=1, seq_len=32, lora_r=4, device="cpu").validate(spec))
        warnings.warn("the user's own", FutureWarning)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == ["the user's own"]


def test_an_extrapolated_region_keeps_its_linear_total_when_its_peak_moves():
    """Whisper-large-v3 at batch 8 (bf16-mixed, checkpointing, H200): the region after the decoder peaks on the
    loss's activations at depth 2+2 and on the autocast copies of the weights at 3+2 and 2+3 (MiB, as traced).
    Category by category, 30 layers' steps give the activations -9.7 GiB; clamped alone they left the weights'
    +18 GiB, and the region outgrew the optimizer step (exact mode +3.4% on the H200, fast mode -1.6%)."""
    from hf_memfit.estimator.exact import non_negative_breakdown

    base = {"weights": 770.6, "optimizer": 1252.8, "activations": 1023.9}
    grown = [{"weights": 1058.3, "optimizer": 1402.9, "activations": 884.9},
             {"weights": 1095.8, "optimizer": 1453.0, "activations": 831.3}]
    extrapolated = {k: base[k] + sum(30 * (g[k] - base[k]) for g in grown) for k in base}
    assert extrapolated["activations"] < 0
    kept = non_negative_breakdown(extrapolated)
    assert min(kept.values()) == 0 and kept["activations"] == 0
    assert sum(kept.values()) == pytest.approx(sum(extrapolated.values()), abs=2)
    assert sum(kept.values()) < 0.75 * sum(max(0, v) for v in extrapolated.values())
    assert non_negative_breakdown({"weights": 5.0, "activations": 7.0}) == {"weights": 5, "activations": 7}


@pytest.mark.parametrize("model", ["llama", "llava"])
def test_a_warm_up_without_a_pass_leaves_the_measured_step_as_a_full_one_does(tiny_specs, model):
    """The warm-up is the optimizer step alone, on zero gradients: no forward or backward runs before the measured
    step, and that step's regions are byte for byte those after a warm-up step of full-size rows. LLaVA's last CLIP
    layer gets no gradient (its features are the second-to-last layer's), so it has no states in a real run: the
    first measured backward names it and the trace starts again without its states."""
    from transformers import AutoConfig

    from hf_memfit.models.depths import config_with_depths, real_depths
    from hf_memfit.models.spec import ModelSpec
    from test_vlm import LLAVA

    if model == "llava":
        spec = ModelSpec.from_config("tiny-llava", AutoConfig.for_model(**LLAVA).to_dict())
        settings = TrainSettings(batch_size=2, seq_len=32, task="image-text-to-text", device="cuda", gpu="A100",
                                 precision="bf16-mixed", gradient_accumulation_steps=2)
    else:
        spec = tiny_specs[model]
        settings = TrainSettings(batch_size=2, seq_len=64, task="causal-lm", gradient_checkpointing=True,
                                 optim="adamw_torch_fused", gradient_accumulation_steps=2)
    real = real_depths(spec)
    config = config_with_depths(spec, real)
    without_a_pass = trace_step(config, settings, real)
    with_a_pass = trace_step(config, settings, real, short_warm_up=False)
    forwards = [label for _, label in without_a_pass.tracker.markers if "forward" in label]
    assert forwards and all(label.startswith("step 2") for label in forwards)
    assert any(label.startswith("step 1 forward") for _, label in with_a_pass.tracker.markers)
    assert without_a_pass.region_peaks == with_a_pass.region_peaks
    assert without_a_pass.region_breakdowns == with_a_pass.region_breakdowns

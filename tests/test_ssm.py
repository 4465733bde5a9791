"""State-space models: which kernel path an estimate is for, the CUDA kernels' stand-ins, and refusals."""

import json
import math

import pytest
import torch

from hf_memfit.cli.main import main
from hf_memfit.errors import MemFitError
from hf_memfit.estimator import estimate_settings
from hf_memfit.estimator import ssm_kernels as kernels
from hf_memfit.estimator.measure import measure_cpu_peak
from hf_memfit.estimator.exact import exact_candidates
from hf_memfit.models.spec import ModelSpec
from hf_memfit.settings import TrainSettings

TINY_MAMBA = dict(model_type="mamba", hidden_size=64, intermediate_size=128, state_size=16, num_hidden_layers=4,
                  vocab_size=256, time_step_rank=8, conv_kernel=4)
TINY_MAMBA2 = dict(model_type="mamba2", hidden_size=64, expand=2, num_heads=8, head_dim=16, state_size=16, n_groups=1,
                   num_hidden_layers=4, vocab_size=256, chunk_size=32, conv_kernel=4)
TINY_JAMBA = dict(model_type="jamba", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
                  mamba_dt_rank=8, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=2, num_experts_per_tok=1)


def _spec(name, config):
    return ModelSpec.from_config(f"tiny-{name}", config)


def test_mixer_layouts_come_from_the_built_model():
    (mamba,) = _spec("mamba", TINY_MAMBA).ssm_mixers
    assert (mamba["scan"], mamba["d_state"], mamba["conv_kernel"], mamba["count"]) == ("selective_scan", 16, 4, 4)
    (mamba2,) = _spec("mamba2", TINY_MAMBA2).ssm_mixers
    assert (mamba2["scan"], mamba2["heads"], mamba2["head_dim"], mamba2["chunk_size"]) == ("ssd", 8, 16, 32)
    # in_proj makes z, x, B, C and dt: 2 * d_inner + 2 * groups * d_state + heads
    assert mamba2["in_proj"] == 2 * 128 + 2 * 16 + 8
    assert _spec("jamba", TINY_JAMBA).ssm_mixers[0]["count"] == 1  # one mamba layer, one attention layer
    assert ModelSpec.from_config("tiny-gpt2", dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4,
                                                   vocab_size=256)).ssm_mixers == []


def _saved_bytes(output) -> dict[str, int]:
    return {"saved": sum(t.numel() * t.element_size() for t in output.grad_fn.saved_tensors if t is not None)}


def test_mamba_inner_stand_in_saves_what_the_kernel_saves():
    """MambaInnerFn (checkpoint_lvl=1) under bf16 autocast: beyond xz and the fp32 A / D / biases it saves
    x_dbl, B and C, the selective scan's out and chunk states, and the bf16 copies of three weights."""
    b, d, length, rank, n, hidden = 2, 32, 4100, 4, 8, 16
    xz = torch.empty(b, 2 * d, length, dtype=torch.bfloat16, requires_grad=True)
    conv_w, conv_b = torch.empty(d, 1, 4, requires_grad=True), torch.empty(d, requires_grad=True)
    x_proj, dt_proj = torch.empty(rank + 2 * n, d, requires_grad=True), torch.empty(d, rank, requires_grad=True)
    out_proj = torch.empty(hidden, d, requires_grad=True)
    A, D, dt_bias = torch.empty(d, n), torch.empty(d), torch.empty(d)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = kernels.mamba_inner_fn(xz, conv_w, conv_b, x_proj, dt_proj, out_proj, None, A, None, None, D,
                                     delta_bias=dt_bias)
    assert out.shape == (b, length, hidden) and out.dtype == torch.bfloat16
    inputs = xz.numel() * 2 + (conv_w.numel() + conv_b.numel() + A.numel() + D.numel() + dt_bias.numel()) * 4
    derived = (b * length * (rank + 2 * n) * 2  # x_dbl, bf16
               + 2 * b * n * length * 2  # B and C, contiguous bf16 copies [b, 1, n, L]
               + b * d * length * 2  # the scan's out
               + b * d * math.ceil(length / 2048) * 2 * n * 4  # chunk states, fp32 [b, d, ceil(L/2048), 2n]
               + (x_proj.numel() + dt_proj.numel() + out_proj.numel()) * 2)  # autocast copies of the weights
    assert _saved_bytes(out)["saved"] == inputs + derived
    out.sum().backward()  # the backward returns a gradient of each input's shape
    assert xz.grad.shape == xz.shape and out_proj.grad.shape == out_proj.shape


def test_mamba2_combined_stand_in_saves_what_the_kernel_saves():
    """MambaSplitConv1dScanCombinedFn with rmsnorm and out_proj (fp32 weights, no autocast): it saves zxbcdt,
    out_x [b, s, h, p] and rstd fp32 [groups * b * s]; nothing of the chunked scan's fp32 working set."""
    b, s, heads, p, n, groups, hidden = 2, 100, 4, 8, 16, 2, 24
    dim, conv_dim = heads * p, heads * p + 2 * groups * n
    zxbcdt = torch.empty(b, s, 2 * dim + 2 * groups * n + heads, requires_grad=True)
    conv_w, conv_b = torch.empty(conv_dim, 4, requires_grad=True), torch.empty(conv_dim, requires_grad=True)
    params = [torch.empty(heads, requires_grad=True) for _ in range(3)]  # dt_bias, A, D
    norm_w, out_w = torch.empty(dim, requires_grad=True), torch.empty(hidden, dim, requires_grad=True)
    out = kernels.mamba2_split_conv1d_scan_combined(zxbcdt, conv_w, conv_b, params[0], params[1], params[2],
                                                    chunk_size=32, rmsnorm_weight=norm_w, outproj_weight=out_w,
                                                    headdim=p, ngroups=groups)
    inputs = sum(t.numel() * 4 for t in (zxbcdt, conv_w, conv_b, *params, norm_w, out_w))
    assert _saved_bytes(out)["saved"] == inputs + b * s * dim * 4 + groups * b * s * 4
    out.sum().backward()
    assert zxbcdt.grad.shape == zxbcdt.shape and norm_w.grad.shape == norm_w.shape


def test_the_path_follows_the_device_and_every_estimate_says_which():
    spec = _spec("mamba2", TINY_MAMBA2)
    assert TrainSettings().ssm_path == "cuda" and TrainSettings(device="cpu").ssm_path == "torch"
    kernel = estimate_settings(spec, TrainSettings(batch_size=2, seq_len=256, mode="exact", precision="bf16-mixed"))
    fallback = estimate_settings(spec, TrainSettings(batch_size=2, seq_len=256, mode="exact", precision="bf16-mixed",
                                                     ssm_kernels="torch"))
    assert "CUDA kernel path" in kernel.notes[0] and "torch fallback" in fallback.notes[0]
    # the kernels save their inputs and recompute; the fallback keeps its chunked SSD tensors for backward
    assert kernel.breakdown["activations"] < fallback.breakdown["activations"] / 2
    gpt2 = ModelSpec.from_config("tiny-gpt2", dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=256))
    assert not any("state-space" in n for n in estimate_settings(gpt2, TrainSettings(seq_len=32)).notes)


def test_fast_mode_follows_the_kernel_path():
    spec = _spec("mamba2", TINY_MAMBA2)
    for seq in (300, 2500):
        settings = dict(batch_size=2, seq_len=seq, precision="bf16-mixed")
        exact = estimate_settings(spec, TrainSettings(mode="exact", **settings)).peak_allocated_bytes
        fast = estimate_settings(spec, TrainSettings(mode="fast", **settings)).peak_allocated_bytes
        assert abs(fast - exact) / exact < 0.01, (seq, fast, exact)


def test_fits_are_traced_at_whole_chunks_of_the_scan(tmp_path, monkeypatch):
    """A scan's chunk states (ceil(s / chunk) of them) are a polynomial in s only at multiples of the chunk: a
    kernel-path fit of Mamba-1 traces multiples of selective_scan's 2048, Mamba-2 of its `chunk_size`, and Mamba-1's
    torch fallback (token by token, no chunks) the usual multiples of 128. Fast mode then agrees with exact mode
    on and between the chunk boundaries."""
    from hf_memfit.estimator import parametric

    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path))
    mamba, mamba2 = _spec("mamba", TINY_MAMBA), _spec("mamba2", dict(TINY_MAMBA2, chunk_size=384))

    def lengths(spec, **settings):
        return {p[1] for p in parametric._points(spec, TrainSettings(seq_len=4096, **settings).validate(spec))}

    assert all(n % 2048 == 0 for n in lengths(mamba, device="cuda")) and len(lengths(mamba, device="cuda")) == 4
    assert not all(n % 2048 == 0 for n in lengths(mamba, device="cpu"))
    assert all(n % 384 == 0 for n in lengths(mamba2, device="cuda")) and len(lengths(mamba2, device="cuda")) == 4
    for seq in (4096, 3000):
        settings = dict(batch_size=3, seq_len=seq, device="cuda", precision="bf16-mixed")
        exact = estimate_settings(mamba, TrainSettings(mode="exact", **settings)).peak_allocated_bytes
        fast = estimate_settings(mamba, TrainSettings(mode="fast", **settings)).peak_allocated_bytes
        assert abs(fast - exact) / exact < 0.01, (seq, fast, exact)


@pytest.mark.parametrize("name,config", [("mamba", TINY_MAMBA), ("mamba2", TINY_MAMBA2),
                                         ("jamba", dict(TINY_JAMBA, num_hidden_layers=4))])
def test_the_torch_fallback_matches_the_cpu_allocator(name, config):
    # Mamba-2's chunked fallback, and Mamba-1's per-token loop, whose scan reads one tensor a slice per token: its
    # gradient's pieces are summed in place as a real backward sums them (docs/benchmarks.md, section 18; the
    # trace held one more full-size buffer, +4.4%, before `StorageTracker._engine_sums_in_place`).
    # Jamba (mamba, attention, mamba, attention) peaks in the backward of layer 2, neither the first nor the last
    # layer: exact mode kept only those two layers' regions and read 13% low (estimator/regions.py).
    spec = _spec(name, config)
    settings = TrainSettings(batch_size=2, seq_len=32, device="cpu", mode="exact").validate(spec)
    predicted = exact_candidates(spec, settings).peak_bytes
    measured = measure_cpu_peak(spec.config, settings)
    assert abs(predicted - measured) / measured < 0.01, (predicted, measured)


def test_layouts_the_kernels_refuse():
    wide = _spec("mamba-conv5", dict(TINY_MAMBA, conv_kernel=5))
    with pytest.raises(MemFitError, match="conv width of 2 to 4"):
        TrainSettings(seq_len=32).validate(wide)
    TrainSettings(seq_len=32, ssm_kernels="torch").validate(wide)  # transformers' fallback runs any width
    with pytest.raises(MemFitError, match="--device cuda"):
        TrainSettings(seq_len=32, device="cpu", ssm_kernels="cuda").validate(_spec("mamba", TINY_MAMBA))
    odd = _spec("mamba2-odd", dict(TINY_MAMBA2, hidden_size=48, num_heads=6))  # in_proj 96*2 + 32 + 6 = 230
    with pytest.raises(MemFitError, match="multiple of 8"):
        TrainSettings(seq_len=32).validate(odd)
    with pytest.raises(MemFitError, match="peft refuses"):  # peft's own check: the fused kernel reads out_proj
        TrainSettings(seq_len=32, lora_r=8, lora_target_modules=("all-linear",)).validate(_spec("mamba", TINY_MAMBA))
    TrainSettings(seq_len=32, lora_r=8, lora_target_modules=("in_proj", "x_proj")).validate(_spec("mamba", TINY_MAMBA))
    with pytest.raises(MemFitError, match="scan the whole sequence"):
        TrainSettings(seq_len=64, num_gpus=2, sp_size=2, zero_stage=1).validate(_spec("jamba", TINY_JAMBA))


def test_cli_refuses_in_one_line_and_says_the_path(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(TINY_MAMBA, conv_kernel=5)))
    code = main(["estimate", str(path), "--batch-size", "1", "--seq-len", "32"])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "causal-conv1d" in err and "Traceback" not in err
    code = main(["estimate", str(path), "--batch-size", "1", "--seq-len", "32", "--device", "cpu",
                 "--ssm-kernels", "cuda"])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "--device cuda" in err
    code = main(["estimate", str(path), "--batch-size", "1", "--seq-len", "32", "--ssm-kernels", "torch",
                 "--mode", "exact", "--json"])
    out, _ = capsys.readouterr()
    assert code == 0 and "torch fallback" in json.loads(out)["notes"][0]


def test_the_plan_and_the_trainer_follow_the_installed_kernels(monkeypatch):
    from hf_memfit.integrations import introspect
    from hf_memfit.planner.search import plan

    spec = _spec("mamba", TINY_MAMBA)
    with pytest.raises(MemFitError, match="--device cuda"):  # the plan checks the path it is given (it ignored it)
        plan(spec, seq_len=64, global_batch_size=2, gpu_memory="8GiB", device="cpu", ssm_kernels="cuda")
    # MemFitTrainer on a GPU: the kernels only where both packages import (this machine has neither)
    notes = []
    assert introspect.ssm_kernel_path(spec, on_gpu=True, notes=notes) == "torch"
    assert "mamba_ssm and causal_conv1d not installed" in notes[0]
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    assert introspect.ssm_kernel_path(spec, on_gpu=True, notes=[]) == "cuda"
    assert introspect.ssm_kernel_path(spec, on_gpu=False, notes=[]) == "torch"
    assert introspect.ssm_kernel_path(_spec("gpt2", dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4,
                                                         vocab_size=256)), on_gpu=True, notes=[]) is None



def test_a_model_without_attention_is_planned_eager_as_transformers_builds_it():
    from hf_memfit.hardware import find_gpu
    from hf_memfit.planner.search import attention_choice

    mamba, jamba = _spec("mamba", TINY_MAMBA), _spec("jamba", TINY_JAMBA)
    assert not mamba.sdpa and jamba.sdpa  # Jamba's attention layers have SDPA; Mamba has no attention at all
    attention, reason = attention_choice(mamba, find_gpu("h100"), "cuda")
    assert attention == "eager" and "no attention" in reason
    assert attention_choice(jamba, find_gpu("h100"), "cuda")[0] != "eager"


def test_jamba_is_fitted_apart_at_batch_1_and_at_larger_batches(tmp_path, monkeypatch):
    """Jamba's mixer projects a transposed activation: `F.linear`'s reshape of it is a view at batch 1 and a copy
    from batch 2 on, so the step is one polynomial at batch 1 and another above (docs/benchmarks.md, section 18).
    The mixed fit misses its check point, and fast mode traced every shape in exact mode instead; now the two
    regimes are fitted apart, and a later micro-batch's clocks are matched to the first one's op by op (its
    gradients accumulate with ops of their own), so the fit serves every shape."""
    from hf_memfit.estimator import parametric

    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path))
    spec = _spec("jamba", dict(TINY_JAMBA, num_hidden_layers=8, hidden_size=128, intermediate_size=256))
    base = dict(device="cuda", precision="bf16-mixed", gpu="h100")
    for batch, seq, accumulation in ((1, 4096, 1), (2, 4096, 2), (3, 6144, 1)):
        settings = TrainSettings(batch_size=batch, seq_len=seq, gradient_accumulation_steps=accumulation, **base)
        fast = estimate_settings(spec, settings.replace(mode="fast"))
        exact = estimate_settings(spec, settings.replace(mode="exact")).peak_allocated_bytes
        assert abs(fast.peak_allocated_bytes - exact) / exact < 0.001, (batch, seq, fast.peak_allocated_bytes, exact)
        assert any("fitted apart" in n for n in fast.notes) and not any("instead" in n for n in fast.notes)
    (cached,) = [json.loads(p.read_text())["value"] for p in (tmp_path / "parametric").glob("*.json")]
    assert {p[0] for p in cached["points"]} == {2, 4} and {p[0] for p in cached["batch_1"]["points"]} == {1}
    assert cached["precisions"] == ["bf16-mixed", "fp16-mixed"] and parametric.CHECK_TOLERANCE > cached["check_miss"]


def test_a_fit_made_again_by_regime_reuses_the_shapes_it_traced(tmp_path, monkeypatch):
    """The split fit reads the mixed fit's batch-1 lengths, its batch-2 shapes and its check point (`traced_shapes.py`):
    fewer shapes traced, and the same fit as one whose every round traces afresh."""
    from hf_memfit.estimator import parametric, traced_shapes

    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_MEMFIT_NO_FORK", "1")  # the traces in this process, where they are counted
    spec = _spec("jamba", dict(TINY_JAMBA, num_hidden_layers=8, hidden_size=128, intermediate_size=256))
    settings = TrainSettings(batch_size=4, seq_len=4096, device="cuda", precision="bf16-mixed", gpu="h100",
                             mode="fast").validate(spec)
    traced = []
    original = parametric._trace_summary
    monkeypatch.setattr(parametric, "_trace_summary", lambda *job: traced.append(len(job[3])) or original(*job))
    kept = parametric.calibrate(spec, settings)

    class Forgetting(traced_shapes.TracedShapes):
        def jobs(self, spec, plans):
            self.shapes, self.run = {}, {}
            return super().jobs(spec, plans)

    kept_count, traced[:] = sum(traced), []
    monkeypatch.setattr(parametric, "TracedShapes", Forgetting)
    afresh = parametric.calibrate(spec, settings)
    assert "batch_1" in kept and json.dumps(kept, sort_keys=True) == json.dumps(afresh, sort_keys=True)
    # at each of its two depths (1, s), (1, m), (2, s) and (2, l) with two micro-batches again, and at the base depth,
    # the only one that traces it, the check point
    assert kept_count == sum(traced) - (5 + 4) == 20

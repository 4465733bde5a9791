"""Parametric fast mode (`parametric.py`) for families without hand-written formulas.

Tiny generic models: fake tensors cost the same at any size, so these check the fit at
shapes, accumulation and optimizers it never traced, against exact mode.
"""

import json

import pytest
from conftest import TINY_GEMMA3, TINY_OLMO2, TINY_QWEN3, TINY_QWEN3_MOE

from hf_memfit.estimator import parametric, parametric_fit
from hf_memfit.estimator.assemble import estimate
from hf_memfit.models.spec import ModelSpec


def _error(spec, **settings) -> float:
    fast = estimate(spec, **settings).peak_allocated_bytes
    exact = estimate(spec, mode="exact", **settings).peak_allocated_bytes
    return abs(fast - exact) / exact


@pytest.mark.parametrize("config, settings", [
    (TINY_QWEN3, dict(device="cpu")),
    (dict(TINY_OLMO2, num_hidden_layers=6), dict(device="cuda", precision="bf16-mixed", gpu="H100")),
    (dict(TINY_GEMMA3, num_hidden_layers=7), dict(device="cuda", precision="bf16", lora_r=8,
                                                   lora_target_modules=("all-linear",))),
])
def test_fast_matches_exact_at_an_untraced_shape(config, settings, tmp_path, monkeypatch):
    """One fit, then batches and lengths it never traced (not among `_points`), with and without accumulation."""
    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path))
    spec = ModelSpec.from_config(config["model_type"], config)
    traced = {tuple(p[:2]) for p in parametric._points(spec, parametric_settings(spec, seq_len=320, **settings))}
    for batch, seq, accumulation in ((3, 320, 1), (5, 448, 3)):
        assert (batch, seq) not in traced
        assert _error(spec, batch_size=batch, seq_len=seq, gradient_accumulation_steps=accumulation,
                      **settings) < 0.01
    assert len(list((tmp_path / "parametric").glob("*.json"))) == 1


def parametric_settings(spec, **settings):
    from hf_memfit.settings import TrainSettings

    return TrainSettings(**settings).validate(spec)


def test_one_fit_serves_every_length_and_optimizer(tmp_path, monkeypatch):
    """Sequence lengths, micro-batches, accumulation and (by formula) the optimizer share one cache entry."""
    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path))
    spec = ModelSpec.from_config("qwen3", TINY_QWEN3)
    estimate(spec, batch_size=1, seq_len=64, device="cuda")
    calls = []
    original = parametric.calibrate_many
    monkeypatch.setattr(parametric, "calibrate_many", lambda *a, **k: calls.append(a) or original(*a, **k))
    for seq, batch, optim in ((96, 2, "adamw_torch"), (512, 1, "adamw_torch_fused"), (200, 7, "adamw_bnb_8bit"),
                              (256, 3, "adafactor"), (384, 2, "sgd")):
        assert _error(spec, batch_size=batch, seq_len=seq, device="cuda", optim=optim) < 0.01, (seq, optim)
    assert not calls
    assert len(list((tmp_path / "parametric").glob("*.json"))) == 1


def test_a_corrupt_cache_file_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path))
    spec = ModelSpec.from_config("qwen3", TINY_QWEN3)
    before = estimate(spec, batch_size=2, seq_len=64, device="cpu").peak_allocated_bytes
    (entry,) = (tmp_path / "parametric").glob("*.json")
    for damage in ("{not json", json.dumps({"version": parametric.PARAMETRIC_VERSION, "points": []})):
        entry.write_text(damage)
        again = estimate(spec, batch_size=2, seq_len=64, device="cpu")
        assert any("paid" in n for n in again.notes)
        assert again.peak_allocated_bytes == before
        assert json.loads(entry.read_text())["value"]["candidates"]  # rebuilt, in the cache's checked envelope


def test_a_fit_that_misses_its_check_point_says_so(tmp_path, monkeypatch):
    """Eager attention keeps b*s^2 probabilities; a fit without the s^2 terms misses the held-out point, and the
    notes say by how much instead of hiding it. The full fit passes the same check (with SDPA, whose steps
    run the same ops at every shape)."""
    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path))
    spec = ModelSpec.from_config("qwen3", TINY_QWEN3)
    sound_settings = parametric_settings(spec, batch_size=3, seq_len=320, device="cpu")
    sound = parametric.calibrate(spec, sound_settings)
    assert sound["check_miss"] < parametric.CHECK_TOLERANCE / 10
    assert not any("missed" in n for n in parametric.evaluate(sound, sound_settings).notes)

    settings = sound_settings.replace(attn_implementation="eager")

    monkeypatch.setattr(parametric_fit, "TERMS", ((0, 0), (0, 1), (1, 1)))
    monkeypatch.setattr(parametric, "_batch_regimes_differ", lambda series, points: False)  # one regime: no s^2 terms
    monkeypatch.setattr(parametric, "_points",
                        lambda spec, settings, batches="": ((1, 128, 1), (2, 128, 1), (1, 256, 2), (4, 384, 2)))
    linear = parametric.calibrate(spec, settings)
    assert linear["check_miss"] > parametric.CHECK_TOLERANCE
    assert any(f"missed the trace by {100 * linear['check_miss']:.1f}%" in n
               for n in parametric.evaluate(linear, settings).notes)


def test_each_side_of_a_sliding_window_has_its_own_fit(tmp_path, monkeypatch):
    """Below the window transformers skips the sliding mask, above it builds one: two fits, each exact on its side."""
    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path))
    config = dict(model_type="starcoder2", num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024,
                  sliding_window=96)
    spec = ModelSpec.from_config("starcoder2", config)
    assert not spec.hand_written and spec.sliding_window == 96
    for seq in (80, 40, 300, 520):
        assert _error(spec, batch_size=3, seq_len=seq, device="cpu", attn_implementation="eager") < 0.01, seq
    assert len(list((tmp_path / "parametric").glob("*.json"))) == 2


def test_settings_whose_fit_misses_are_traced_instead(tmp_path, monkeypatch):
    """TRL's fused LM head works in fixed-size chunks of the tokens, not a polynomial in b and s: the fit misses
    its check point, so fast mode traces those settings (and says why) rather than use a fit known to be off."""
    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path))
    spec = ModelSpec.from_config("qwen3", dict(TINY_QWEN3, max_position_embeddings=4096))
    settings = dict(batch_size=8, seq_len=700, trainer="sft", device="cuda", precision="bf16-mixed")
    fast = estimate(spec, **settings)
    assert fast.peak_allocated_bytes == estimate(spec, mode="exact", **settings).peak_allocated_bytes
    assert any("missed its check point" in n and "traced in exact mode instead" in n for n in fast.notes)


def test_both_autocast_dtypes_share_a_fit_their_check_confirms(tmp_path, monkeypatch):
    """bf16-mixed and fp16-mixed build the same model and differ in the autocast dtype: a mixed calibration
    traces its check point at the other one, and serves both when the fit predicts it; GPUs that the step
    reads the same way (sm80+) share it too. 4-bit bases are built in the compute dtype: never shared."""
    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path))
    spec = ModelSpec.from_config("qwen3", TINY_QWEN3)
    calls = []
    original = parametric.calibrate_many
    monkeypatch.setattr(parametric, "calibrate_many", lambda *a, **k: calls.append(a) or original(*a, **k))
    first = dict(batch_size=3, seq_len=320, device="cuda", precision="bf16-mixed", gpu="A10G")
    assert _error(spec, **first) < 0.01
    assert len(calls) == 1
    for other in (dict(precision="fp16-mixed"), dict(gpu="H100"), dict(precision="fp16-mixed", gpu="A100-80GB")):
        assert _error(spec, **dict(first, **other)) < 0.01, other
    assert len(calls) == 1  # served by the first fit
    assert _error(spec, **dict(first, gpu="T4", precision="fp16-mixed")) < 0.01  # no flash on sm75: its own fit
    assert len(calls) == 2
    fits = [json.loads(p.read_text())["value"] for p in (tmp_path / "parametric").glob("*.json")]
    assert sorted(sorted(f["precisions"]) for f in fits) == [["bf16-mixed", "fp16-mixed"]] * 2
    settings = parametric_settings(spec, **dict(first, load_in_4bit=True, lora_r=8))
    assert parametric._sibling(settings) is None
    assert parametric._settings_key(spec, settings, False)["precision"] == "bf16-mixed"


def test_fsdp_layouts_read_the_fit_of_the_step_they_trace(tmp_path, monkeypatch):
    """FSDP runs the configured autocast step and only lays out its states (`sharding._fsdp`), so every FSDP layout
    reads the fit of the plain data-parallel step: one calibration, whose traces are byte for byte those an FSDP
    layout's settings make, and fast mode still agrees with exact mode under each layout."""
    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path))
    spec = ModelSpec.from_config("qwen3", TINY_QWEN3)
    calls = []
    original = parametric.calibrate_many
    monkeypatch.setattr(parametric, "calibrate_many", lambda *a, **k: calls.append(a) or original(*a, **k))
    base = dict(batch_size=3, seq_len=320, device="cuda", precision="bf16-mixed", gpu="H100", num_gpus=2)
    layouts = [{}, dict(fsdp="full_shard"), dict(fsdp="shard_grad_op"), dict(fsdp="full_shard", fsdp_offload=True),
               dict(fsdp="no_shard", fsdp_version=1)]
    for layout in layouts:
        assert _error(spec, **base, **layout) < 0.01, layout
    assert len(calls) == 1
    plain, sharded = (parametric.calibrate(spec, parametric_settings(spec, **base, **layout))
                      for layout in (layouts[0], layouts[3]))
    assert json.dumps(plain, sort_keys=True) == json.dumps(sharded, sort_keys=True)


def test_a_sibling_that_disagrees_is_calibrated_on_its_own(tmp_path, monkeypatch):
    """When the fit misses the check point traced at the other autocast dtype, it is made again with its own
    check and serves only its own precision; the other one then gets a fit of its own."""
    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path))
    spec = ModelSpec.from_config("qwen3", TINY_QWEN3)
    settings = parametric_settings(spec, batch_size=3, seq_len=320, device="cuda", precision="bf16-mixed")
    fit_as_made = parametric._fit

    def disagreeing(settings, plan, summaries):  # as if the other dtype's step differed at the check point
        fit = fit_as_made(settings, plan, summaries)
        return dict(fit, check_miss=0.5) if plan["sibling"] else fit

    monkeypatch.setattr(parametric, "_fit", disagreeing)
    plans = []
    plan = parametric._calibration_plan
    monkeypatch.setattr(parametric, "_calibration_plan", lambda *a, **k: plans.append(plan(*a, **k)) or plans[-1])
    (fit,) = parametric.calibrate_many(spec, [settings])
    # Tiny Qwen3's step also runs a few other ops at batch 1 (its fits agree anyway), so a miss is first fitted
    # again by batch regime, still checked at the sibling; then at its own precision.
    assert plans[0]["sibling"] == "fp16-mixed" and plans[-1]["sibling"] is None
    assert fit["precisions"] == ["bf16-mixed"] and fit["check_miss"] < parametric.CHECK_TOLERANCE


def test_forked_traces_give_the_fit_of_one_process(tmp_path, monkeypatch):
    """The calibration's traces run in forked children where there are CPUs for them; the fit is the same."""
    from hf_memfit.estimator import forked

    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path))
    monkeypatch.setattr(forked, "idle_cpus", lambda: 2.0)  # as on an idle machine, whatever the load here
    spec = ModelSpec.from_config("qwen3", TINY_QWEN3)
    settings = parametric_settings(spec, batch_size=3, seq_len=320, device="cuda", precision="bf16-mixed",
                                   gradient_checkpointing=True)
    children = parametric.calibrate_many(spec, [settings, settings.replace(gradient_checkpointing=False)])
    monkeypatch.setenv("HF_MEMFIT_NO_FORK", "1")
    here = parametric.calibrate_many(spec, [settings, settings.replace(gradient_checkpointing=False)])
    assert json.dumps(children, sort_keys=True) == json.dumps(here, sort_keys=True)
    assert children[0]["candidates"] != children[1]["candidates"]
    assert forked.run_jobs(divmod, [(7, 2), (9, 4), (1, 1)], workers=2) == [(3, 1), (2, 1), (1, 0)]


def test_a_first_call_with_a_cpu_for_each_job_runs_them_side_by_side(monkeypatch):
    """A process's first call runs its first job here (paying for first use once, for the children to inherit),
    but where every other job has a CPU of its own they start beside it: a fit of two depths on two CPUs."""
    import os

    from hf_memfit.estimator import forked

    monkeypatch.delenv("HF_MEMFIT_NO_FORK", raising=False)
    monkeypatch.setattr(forked, "idle_cpus", lambda: 2.0)
    order = []
    real_start = forked._start
    monkeypatch.setattr(forked, "_start", lambda f, job: order.append(("child", job)) or real_start(f, job))

    def job(a, b):
        if os.getpid() == parent:
            order.append(("here", (a, b)))
        return os.getpid() == parent, divmod(a, b)

    parent = os.getpid()
    where = []
    for ran_here in (False, True):
        monkeypatch.setattr(forked, "_ran_here", ran_here)
        order.clear()
        results = forked.run_jobs(job, [(7, 2), (9, 4)])
        assert [r[1] for r in results] == [(3, 1), (2, 1)]
        where.append(([r[0] for r in results], list(order)))
    # first call: the second job's child starts before the first job runs here; later calls: both in children
    assert where == [([True, False], [("child", (9, 4)), ("here", (7, 2))]),
                     ([False, False], [("child", (7, 2)), ("child", (9, 4))])]


def test_idle_cpus_are_what_the_kernel_counts_idle_now_beside_this_process(monkeypatch):
    """Idle CPUs come from a short sample of `/proc/stat`'s per-CPU idle ticks, less this process's own CPU (not
    the load average, whose minute-long memory counts processes that just ended), read again only after a while."""
    import os

    from hf_memfit.estimator import forked

    readings = iter([{0: (100, 1000), 1: (500, 1000)},   # CPU 0 busy, CPU 1 idle through the sample
                     {0: (100, 1010), 1: (510, 1010)},
                     {0: (200, 2000), 1: (600, 2000)},   # later: both idle
                     {0: (210, 2010), 1: (610, 2010)}])
    monkeypatch.setattr(forked, "_cpu_times", lambda: next(readings))
    monkeypatch.setattr(forked.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(forked, "_idle_sample", None)
    monkeypatch.setattr(forked, "_last_reading", None)  # no earlier reading: a sample over a sleep
    assert forked.idle_cpus() == 0.0 and forked.slots() == 1  # the other CPU is taken: nothing runs beside
    assert forked.idle_cpus() == 0.0  # the same sample, not read again at once
    monkeypatch.setattr(forked, "_idle_sample", (forked.time.monotonic() - 2 * forked.IDLE_SAMPLE_REUSE_S, 0.0))
    assert forked.idle_cpus() == 1.0 and forked.slots() == 2
    # one tick of something else on an idle machine (9 of 10 idle on CPU 0) is still a whole CPU beside this one
    readings = iter([{0: (300, 3000), 1: (700, 3000)}, {0: (309, 3010), 1: (710, 3010)}])
    monkeypatch.setattr(forked, "_idle_sample", None)
    monkeypatch.setattr(forked, "_last_reading", None)
    assert forked.idle_cpus() == 1.0 and forked.slots() == 2
    monkeypatch.undo()
    times = forked._cpu_times()  # this machine's, for the CPUs this process may run on
    assert set(times) == os.sched_getaffinity(0) and all(0 <= idle <= total for idle, total in times.values())


def test_idle_cpus_since_the_last_reading_count_this_process_s_own_work_as_idle(monkeypatch):
    """Where an earlier reading is a few seconds old, idle CPUs are read over the time since, without a sleep:
    what this process and its finished children ran then is theirs, free once they wait; anyone else's is not."""
    from hf_memfit.estimator import forked

    slept = []
    monkeypatch.setattr(forked.time, "sleep", slept.append)
    start = (100.0, {0: (1000, 5000), 1: (1000, 5000)}, 0.0)
    # 3 s later: CPU 0 ran 300 ticks of this process's traces, CPU 1 300 ticks of another process
    readings = iter([(103.0, {0: (1000, 5300), 1: (1000, 5300)}, 300.0),
                     # 3 s later again: both CPUs ran this process's traces
                     (106.0, {0: (1000, 5600), 1: (1000, 5600)}, 900.0)])
    monkeypatch.setattr(forked, "_reading", lambda: next(readings))
    monkeypatch.setattr(forked, "_last_reading", start)
    monkeypatch.setattr(forked, "_idle_sample", None)
    assert forked.idle_cpus() == 0.0  # the other process holds a CPU: nothing runs beside this one
    monkeypatch.setattr(forked, "_idle_sample", None)
    assert forked.idle_cpus() == 1.0 and not slept


def test_a_plan_makes_the_fits_it_needs_before_it_reads_them(tmp_path, monkeypatch):
    """The planner hands what it will estimate to `prepare` (fits made there, side by side), and estimates only
    what could change the plan (`planner/lazy_grid.py`): a roomy budget reads the fit of its fastest settings."""
    from hf_memfit.planner import plan

    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path))
    spec = ModelSpec.from_config("qwen3", TINY_QWEN3)
    made = []
    original = parametric.calibrate_many
    monkeypatch.setattr(parametric, "calibrate_many", lambda spec, many, *a: made.extend(many) or
                        original(spec, many, *a))
    # no host offload: a smaller grid, the same mechanism
    result = plan(spec, seq_len=256, global_batch_size=8, gpu="A10G", allow_offload="none")
    assert made and not result.plan.gradient_checkpointing
    # the plan and its runners-up (other optimizers) fit uncheckpointed: slower checkpointed steps are not fitted
    assert not any(s.gradient_checkpointing for s in made)
    assert result.candidates_tried < result.candidates_searched


def test_a_forked_trace_child_runs_parallel_ops_after_the_parent_did():
    """GNU OpenMP is not fork-safe: a child forked after the parent ran a parallel region (a real matmul; in
    hf-memfit, a VLM's image grid computed on real tensors during the first trace, which runs in the parent)
    waited forever in its own first parallel op (`benchmarks/published_media.py` hung on Qwen2-VL). Run in a
    subprocess with a time limit, so that a regression fails instead of hanging the suite."""
    import subprocess
    import sys

    script = """
import os, pickle, torch
from hf_memfit.estimator import forked
x = torch.randn(1500, 1500)
(x @ x).sum()                                   # the parent's parallel region
def work():
    y = torch.randn(1500, 1500)
    return float((y @ y).sum() * 0) + torch.arange(4_000_000).cumsum(0)[-1].item()
read, pid = forked._start(work, ())
data = b""
while chunk := os.read(read, 1 << 16):
    data += chunk
os.waitpid(pid, 0)
ok, value = pickle.loads(data)
print(ok, value)
from hf_memfit.estimator import worker_pool
with worker_pool.keep_workers():               # a kept worker, forked the same way
    sent = worker_pool.active.launcher(work, [()])(0)
    while (done := sent.read()) is None:
        pass
print(*done)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", str(float(sum(range(4_000_000))))] * 2, done.stdout


def test_a_later_micro_batch_is_matched_to_the_first_one_op_by_op():
    """A later micro-batch runs the first one's ops plus its own (accumulating a gradient into the one that is
    live): each of its clocks is matched to the first one's same moment, and its own ops to the one before."""
    import numpy as np

    def live(changes):  # clocks of one category from the region's entry and each op's change in live bytes
        return np.cumsum([[100]] + [[c] for c in changes], axis=0).astype(float)

    first = live([+8, +4, -4, +16, -8])
    later = live([+8, +4, +2, -2, -4, +16, -8])  # a temporary of its own after the second op
    assert parametric_fit._matching_clocks(later, first) == [0, 1, 2, 2, 2, 3, 4, 5]
    assert parametric_fit._matching_clocks(live([+1, +3]), live([+5])) is None


@pytest.mark.parametrize("config, settings", [
    (TINY_QWEN3, dict(device="cpu")),
    (TINY_QWEN3, dict(device="cuda", precision="bf16", optim="adamw_torch_4bit", gradient_accumulation_steps=3)),
    (TINY_QWEN3_MOE, dict(device="cuda", precision="bf16-mixed", optim="adamw_bnb_8bit", lora_r=4,
                         lora_target_modules=("all-linear",))),
])
def test_later_shapes_copy_the_first_shape_s_optimizer_step_byte_for_byte(config, settings, monkeypatch):
    """A fit traces one optimizer step, at its first shape; every later shape's is that one, moved by what else was
    live (`trace._step_repeats`, `parametric_fit._copy_repeated_optimizer_steps`). The series are those of running
    the step at every shape (no checkpointing here: with it, transformers frees autocast's cached copies in an
    order that differs from one run to the next, and the two runs would differ in that order only)."""
    from hf_memfit.estimator import trace

    spec = ModelSpec.from_config("tiny", config)
    plan = parametric._calibration_plan(spec, parametric_settings(spec, batch_size=2, seq_len=192, **settings))
    depths = plan["depth_sets"][0]
    copied = parametric._trace_summary(spec, plan["traced"], depths, plan["shapes"])
    monkeypatch.setattr(trace, "_step_repeats", lambda settings: False)
    stepped = parametric._trace_summary(spec, plan["traced"], depths, plan["shapes"])
    assert len(copied["series"]) == len(stepped["series"]) == len(plan["shapes"]) > 2
    for point, (a, b) in enumerate(zip(copied["series"], stepped["series"])):
        assert a.keys() == b.keys(), point
        for region in a:
            assert (a[region] == b[region]).all(), (point, region)
    assert copied["host_peaks"] == stepped["host_peaks"]


def test_only_the_first_shape_runs_the_optimizer_step(monkeypatch):
    from hf_memfit.estimator import step, trace

    spec = ModelSpec.from_config("tiny", TINY_QWEN3)
    plan = parametric._calibration_plan(spec, parametric_settings(spec, batch_size=2, seq_len=192, device="cpu"))
    steps = []
    original = step.optimizer_step
    monkeypatch.setattr(step, "optimizer_step", lambda *a, **k: steps.append(1) or original(*a, **k))
    result = trace.trace_step(spec.with_layers(2), plan["traced"], (2,), shapes=plan["shapes"])
    assert len(steps) == 2  # the warm-up's and the first shape's
    assert result.repeated_optimizer_steps == list(range(2, len(plan["shapes"]) + 1))

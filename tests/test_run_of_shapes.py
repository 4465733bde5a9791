"""`estimate --vary-seq-len`: a run of varying shapes traced on fake CUDA tensors and replayed through the
simulated caching allocator (hf_memfit/estimator/run_of_shapes.py)."""

import json
import re

import pytest

from hf_memfit.cli.main import main
from conftest import TINY_LLAMA


@pytest.fixture(scope="module")
def tiny_llama():
    from hf_memfit.models.spec import ModelSpec

    return ModelSpec.from_config("tiny-llama", TINY_LLAMA)


def _settings(**changes):
    from hf_memfit.settings import TrainSettings

    return TrainSettings(**{"batch_size": 2, "seq_len": 96, "gradient_accumulation_steps": 2, "device": "cuda",
                            "gpu": "h100", "mode": "exact", **changes})


def test_a_run_of_one_shape_reserves_what_its_step_does(tiny_llama):
    # With the shortest length the longest, every micro-batch is the step's own shape: once the optimizer's
    # states exist nothing new is cached, so the run's figures are the step's in the same replay.
    from hf_memfit.estimator.run_of_shapes import run_of_shapes

    run = run_of_shapes(tiny_llama, _settings(), min_seq_len=96, micro_batches=6, needed=False)
    assert {length for length, _ in run.shapes} == {96}
    assert run.peak_reserved_bytes == run.step_reserved_bytes
    assert len(run.reserved_after) == 6 and run.reserved_after == sorted(run.reserved_after)
    assert run.reserved_after[-1] == run.peak_reserved_bytes


def test_a_run_of_varying_lengths_allocates_its_largest_step_and_needs_less_than_it_reserves(tiny_llama):
    from hf_memfit.estimator.run_of_shapes import needed_capacity, replay, run_of_shapes
    from hf_memfit.estimator.trace import trace_step
    from hf_memfit.models.depths import config_with_depths, real_depths

    settings = _settings().validate(tiny_llama)
    run = run_of_shapes(tiny_llama, settings, min_seq_len=8, micro_batches=10)
    lengths = [length for length, _ in run.shapes]
    assert 96 in lengths and min(lengths) >= 8 and len(set(lengths)) > 3
    # the run's allocated peak is about its largest step's (the shorter ones hold less; the step also has the
    # largest shape in the micro-batch that adds to existing gradients, which the drawn run may not), in the same
    # replay: on an H200 the two differed by 0.03% (docs/benchmarks.md section 19)
    depths = real_depths(tiny_llama)
    step = trace_step(config_with_depths(tiny_llama, depths), settings, depths, shapes=((settings,) * 2,) * 2)
    sim, _ = replay(step.tracker.events, workspace_bytes=64 * 2**20)
    assert 0.97 * sim.peak_allocated_bytes <= run.peak_allocated_bytes <= sim.peak_allocated_bytes
    assert run.peak_allocated_bytes <= run.needed_bytes <= run.peak_reserved_bytes
    # `needed_capacity` is a bisection: what it returns runs, and 32 MiB less does not (unless that is below the
    # allocated peak, which nothing can run under)
    events = trace_step(config_with_depths(tiny_llama, depths), settings, depths,
                        shapes=tuple(tuple(settings.replace(seq_len=n) for n in lengths[i:i + 2])
                                     for i in range(0, 10, 2))).tracker.events
    need = needed_capacity(events, low=sim.peak_allocated_bytes - 2**20, high=run.peak_reserved_bytes,
                           workspace_bytes=64 * 2**20)
    assert need == run.needed_bytes or abs(need - run.needed_bytes) <= 32 * 2**20
    assert replay(events, need, workspace_bytes=64 * 2**20)[0] is not None


def test_the_allocator_keeps_segments_a_shorter_shape_cannot_reuse():
    # The mechanism behind a run's growth, in the simulator alone: a 30 MiB block freed and cached cannot serve a
    # 40 MiB request, so a card with room reserves both; capped at 40 MiB, the allocator frees its cache and
    # retries, and the run fits.
    from hf_memfit.estimator.run_of_shapes import replay

    MiB = 2**20
    events = [(1, 30 * MiB), (-1, 30 * MiB), (2, 40 * MiB), (-2, 40 * MiB)]
    roomy, _ = replay(events)
    assert roomy.peak_reserved_bytes == 70 * MiB and roomy.peak_allocated_bytes == 40 * MiB
    capped, _ = replay(events, 40 * MiB)
    assert capped is not None and capped.num_alloc_retries == 1
    assert replay(events, 39 * MiB)[0] is None


def _estimate(capsys, *argv):
    code = main(["estimate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_estimate_vary_seq_len_reports_the_run_beside_the_step(tmp_path, capsys):
    model = tmp_path / "config.json"
    model.write_text(json.dumps(TINY_LLAMA))
    step = ["--batch-size", "2", "--seq-len", "96", "--gradient-accumulation-steps", "2", "--gpu", "h100"]
    code, out, err = _estimate(capsys, str(model), *step, "--vary-seq-len", "16", "--micro-batches", "6", "--json")
    assert code == 0, err
    document = json.loads(out)
    run = document["run_of_shapes"]
    assert run["micro_batches"] == 6 and len(run["shapes"]) == 6 and run["min_seq_len"] == 16
    # what the estimate puts outside the allocator (the CUDA context) is added to the run's reserved peak too
    outside = document["device_total_bytes"] - document["peak_reserved_bytes"]
    assert run["device_total_bytes"] == run["peak_reserved_bytes"] + outside
    code, out, err = _estimate(capsys, str(model), *step, "--vary-seq-len", "16", "--micro-batches", "6")
    assert code == 0 and "over a run of 6 micro-batches, lengths drawn from 16 to 96 tokens" in out and "smallest card" in out
    assert re.search(r"on H100\S* +[\d.]+ GiB +the run fits", out)  # `--gpu` names the card it is checked against


@pytest.mark.parametrize("flags, says", [
    (["--device", "cpu", "--vary-seq-len", "16"], "the CPU has none"),
    (["--vary-seq-len", "200"], "from 1 to `--seq-len` (96)"),
    (["--vary-seq-len", "16", "--micro-batches", "0"], "at least 1"),
    (["--micro-batches", "8"], "add `--vary-seq-len MIN`"),
    (["--vary-image-size", "224"], "add `--vary-seq-len MIN`"),
    (["--vary-seq-len", "16", "--vary-image-size", "224"], "--task image-text-to-text"),
    (["--vary-seq-len", "16", "--zero-stage", "2", "--num-gpus", "2"], "ZeRO"),
    (["--vary-seq-len", "16", "--expandable-segments"], "expandable segments"),
    (["--vary-seq-len", "16", "--num-gpus", "2"], "DDP"),
])
def test_estimate_vary_seq_len_refuses_what_it_cannot_simulate_in_one_line(tmp_path, capsys, flags, says):
    model = tmp_path / "config.json"
    model.write_text(json.dumps(TINY_LLAMA))
    code, out, err = _estimate(capsys, str(model), "--batch-size", "2", "--seq-len", "96", *flags)
    assert code == 2 and out == "" and err.count("\n") == 1 and says in err, err


def test_an_image_or_audio_step_has_no_length_to_draw():
    from hf_memfit.estimator.run_of_shapes import run_problems

    problems = run_problems(_settings(task="image-cls"), min_seq_len=16, micro_batches=8)
    assert len(problems) == 1 and "image-cls" in problems[0] and "not drawn" in problems[0]
    assert run_problems(_settings(task="image-text-to-text"), min_seq_len=16, micro_batches=8) == []


def test_a_last_partial_step_is_not_stepped(tiny_llama):
    # 5 micro-batches with an optimizer step every 2: the Trainer (and `check --vary-seq-len`'s loop) steps after
    # the 2nd and the 4th only; the replay ends with the 5th micro-batch's backward, not an optimizer step.
    from hf_memfit.estimator.run_of_shapes import trace_run

    settings = _settings().validate(tiny_llama)
    shapes = [(96, None)] * 5
    events, ends, _ = trace_run(tiny_llama, settings, shapes)
    full, full_ends, _ = trace_run(tiny_llama, settings, shapes + [(96, None)])  # the 6th completes the 3rd step
    # up to the 6th micro-batch's start the two runs are the same micro-batches, with no optimizer step after the 5th
    assert len(ends) == 5 and ends[-1] == len(events) == full_ends[4]
    assert events == full[:full_ends[4]]


def test_a_vlm_run_draws_image_sides_too():
    # the tiny Qwen2.5-VL of test_vlm.py; sides 56-112 px are 4-16 image tokens a row (28-px merged patches)
    from hf_memfit.estimator.run_of_shapes import drawn_image_sides, run_of_shapes

    spec = _tiny_qwen25_vl()
    settings = _settings(task="image-text-to-text", seq_len=16, image_size=112).validate(spec)
    sides, problems = drawn_image_sides(settings, 56)
    assert problems == [] and sides[0] == 56 and sides[-1] == 112
    run = run_of_shapes(spec, settings, min_seq_len=8, micro_batches=6, image_sizes=sides, needed=False)
    assert len({side for _, side in run.shapes}) > 2 and (16, 112) in run.shapes
    assert 0 < run.peak_allocated_bytes <= run.peak_reserved_bytes
    assert drawn_image_sides(settings, 113)[1] and drawn_image_sides(_settings(), 56)[1]  # out of range; not a VLM


def _tiny_qwen25_vl():
    from transformers import AutoConfig

    from hf_memfit.models.spec import ModelSpec
    from test_vlm import QWEN25VL

    return ModelSpec.from_config("tiny-qwen2.5-vl", AutoConfig.for_model(**QWEN25VL).to_dict())


@pytest.mark.parametrize("model", ["llama", "qwen2.5-vl"])
def test_a_run_traced_in_two_halves_is_the_run_traced_in_one(model, tiny_llama, monkeypatch):
    # Where a CPU is idle, a run of 3+ optimizer steps is traced in two processes: its first steps here, the first
    # step again and then the rest in a child, joined after the child's first step. The joined stream must make
    # the one process's allocations, numbered alike, with the same micro-batch ends and the same replayed peaks
    # (frees that come together may come in another order in another process: `_halves`).
    from hf_memfit.estimator import forked
    from hf_memfit.estimator import run_of_shapes as runs

    # Qwen2.5-VL keeps a tensor of its last forward between steps (`rope_deltas`): `_halves` matches it by size
    if model == "llama":
        spec, settings, sides = tiny_llama, _settings(), ()
    else:
        spec, settings, sides = _tiny_qwen25_vl(), _settings(task="image-text-to-text", seq_len=16, image_size=112), \
            tuple(range(56, 113))
    settings = settings.validate(spec)
    shapes = runs.varying_shapes(settings, min_seq_len=8, micro_batches=9, seed=1, image_sizes=sides)  # 4 x 2, 1
    monkeypatch.setenv("HF_MEMFIT_NO_FORK", "1")
    one = runs.trace_run(spec, settings, shapes, workspace=64 * 2**20)
    monkeypatch.delenv("HF_MEMFIT_NO_FORK")
    monkeypatch.setattr(forked, "idle_cpus", lambda: 2.0)  # as on an idle machine, whatever the load here
    joined = []
    halves = runs._halves
    monkeypatch.setattr(runs, "_halves", lambda *a: joined.append(halves(*a)) or joined[-1])
    two = runs.trace_run(spec, settings, shapes, workspace=64 * 2**20)
    assert len(joined) == 1 and joined[0] is not None  # joined, not traced again in one process
    (events, ends, step), (other, other_ends, other_step) = one, two
    assert runs._allocations(other) == runs._allocations(events) and other_ends == ends and other_step == step
    assert sorted(other) == sorted(events)  # the same frees too, whatever their order
    first, second = runs.replay(events)[0], runs.replay(other)[0]
    assert (second.peak_allocated_bytes, second.peak_reserved_bytes) == (first.peak_allocated_bytes,
                                                                        first.peak_reserved_bytes)

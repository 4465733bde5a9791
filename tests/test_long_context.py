"""Long context: ALST's TiledMLP (real DeepSpeed code on the CPU, against the profiler) and `plan --seq-len max`."""

import json

import pytest
import torch

from conftest import TINY_GPT2, TINY_LLAMA, TINY_QWEN3_MOE
from hf_memfit.cli.main import main
from hf_memfit.errors import MemFitError, NothingFits
from hf_memfit.estimator.assemble import estimate_settings
from hf_memfit.estimator.measure import measure_cpu_peak
from hf_memfit.models.spec import ModelSpec
from hf_memfit.planner.longest import longest_seq_len, probe_headroom
from hf_memfit.planner.search import DEFAULT_HEADROOM, plan
from hf_memfit.settings import TrainSettings

LONG_LLAMA = dict(TINY_LLAMA, max_position_embeddings=2048)


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def llama():
    return ModelSpec.from_config("tiny-llama", dict(LONG_LLAMA))


@pytest.mark.parametrize("changes", [
    dict(batch_size=2, seq_len=256),
    dict(batch_size=1, seq_len=200, precision="bf16-mixed", gradient_checkpointing=True, lora_r=8),
], ids=["fp32-b2", "bf16-mixed-checkpointing-lora-uneven-shards"])
def test_tiled_mlp_matches_the_cpu_allocator_in_both_modes(llama, changes):
    """DeepSpeed's TiledMLP really runs in the measured step, and both modes follow it."""
    tiled = TrainSettings(device="cpu", tiled_mlp=True, **changes).validate(llama)
    measured = measure_cpu_peak(llama.config, tiled)
    exact = estimate_settings(llama, tiled.replace(mode="exact")).peak_allocated_bytes
    fast = estimate_settings(llama, tiled).peak_allocated_bytes
    assert abs(exact - measured) / measured < 0.01, (exact, measured)
    assert abs(fast - measured) / measured < 0.02, (fast, measured)
    if not tiled.gradient_checkpointing:  # four shards of 64 tokens: the MLP's intermediates a quarter as large
        assert measured < 0.8 * measure_cpu_peak(llama.config, tiled.replace(tiled_mlp=False))


def test_tiled_mlp_layer_backward_fast_matches_exact():
    """Issue 17: with TiledMLP the layer's backward peaks at an RMSNorm's backward, not in the MLP, which exposed
    fast-mode terms the MLP's intermediates had hidden (one residual-gradient buffer, the offloaded checkpoint's
    input, the embeddings' output counted once, the norm's piece summed into the residual). Their peak
    candidates (ALST's levers as at 8B; vocabulary 32, Liger's fused loss) were 8.3% apart before, under 1% now."""
    levers = dict(precision="bf16-mixed", zero_stage=3, offload_optimizer="cpu", offload_param="cpu",
                  offload_activations=True, use_liger_kernel=True, attn_implementation="flash_attention_2", gpu="h100")
    from hf_memfit.estimator.assemble import traced_settings
    from hf_memfit.estimator.fast import fast_step_memory
    from hf_memfit.estimator.exact import exact_candidates

    spec = ModelSpec.from_config("tiny-llama-v32", dict(TINY_LLAMA, vocab_size=32, num_hidden_layers=2,
                                                        max_position_embeddings=4096))
    settings = traced_settings(TrainSettings(batch_size=1, seq_len=4096, tiled_mlp=True, device="cuda",
                                             gradient_checkpointing=True, **levers).validate(spec))
    fast = max(sum(c.values()) for c in fast_step_memory(spec, settings).candidates.values())
    exact = max(sum(c.values()) for c in exact_candidates(spec, settings.replace(mode="exact")).candidates.values())
    assert abs(fast - exact) / exact < 0.01, (fast, exact)


def test_apply_tiled_mlp_keeps_the_gradients(llama):
    """The lever changes memory, not the training: the same loss and gradients as the plain MLP."""
    from hf_memfit import apply_tiled_mlp
    from hf_memfit.models.build import instantiate

    torch.manual_seed(0)
    plain = instantiate(llama.config, "causal-lm", 2, dtype=torch.float32, attn_implementation="sdpa")
    tiled = instantiate(llama.config, "causal-lm", 2, dtype=torch.float32, attn_implementation="sdpa")
    tiled.load_state_dict(plain.state_dict())
    assert apply_tiled_mlp(tiled) == LONG_LLAMA["num_hidden_layers"]
    ids = torch.randint(0, LONG_LLAMA["vocab_size"], (1, 256))
    for model in (plain, tiled):
        model(input_ids=ids, labels=ids).loss.backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), tiled.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), name


def test_tiled_mlp_is_refused_for_a_mixture_of_experts(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_QWEN3_MOE))
    code, out, err = run_cli(capsys, "estimate", str(config), "--batch-size", "1", "--seq-len", "128", "--tiled-mlp")
    assert code == 2 and out == ""
    assert "`--tiled-mlp`" in err and "mixture of experts" in err and len(err.strip().splitlines()) == 1


def test_seq_len_max_is_the_longest_length_the_planner_fits(llama, monkeypatch):
    from hf_memfit.planner import longest as search

    kwargs = dict(global_batch_size=2, gpu_memory="1100MiB", gpu="h100", tiled_mlp=False)
    confirmations = []
    probe_or_confirm = search.plan
    monkeypatch.setattr(search, "plan", lambda *a, **k: (k.get("confirm_in_exact", True) and confirmations.append(
        k["seq_len"])) or probe_or_confirm(*a, **k))
    longest = longest_seq_len(llama, **kwargs)
    assert confirmations == [longest.seq_len]  # the search's margin: exact mode confirms its first answer
    # The answer is a plan, and a plan at the next length the search tried is refused with the margin the
    # search keeps for fast mode's error.
    assert plan(llama, seq_len=longest.seq_len, **kwargs).plan.settings.seq_len == longest.seq_len
    refused = min(p.seq_len for p in longest.points if not p.fits and p.seq_len > longest.seq_len)
    with pytest.raises(NothingFits):
        plan(llama, seq_len=refused, headroom=probe_headroom(DEFAULT_HEADROOM), **kwargs)
    assert refused - longest.seq_len <= max(64, longest.seq_len // 64)
    table = longest.scaling()
    fits = [p for p in table if p.fits]
    assert fits[-1].seq_len == longest.seq_len and [p.seq_len for p in fits] == sorted(p.seq_len for p in fits)
    assert all(p.device_total_bytes <= 1100 * 2**20 for p in fits)
    assert "budget" in longest.bound


def test_seq_len_max_stops_at_a_learned_position_table():
    gpt2 = ModelSpec.from_config("tiny-gpt2", dict(TINY_GPT2))
    longest = longest_seq_len(gpt2, global_batch_size=1, gpu_memory="40GiB", gpu="a100")
    assert longest.seq_len == TINY_GPT2["n_positions"] and "learned positions" in longest.bound


def test_seq_len_max_from_the_command_line(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LONG_LLAMA))
    code, out, _ = run_cli(capsys, "plan", str(config), "--seq-len", "max", "--global-batch-size", "2",
                           "--gpu-memory", "1100MiB", "--gpu", "h100", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["longest_seq_len"] == data["estimate"]["settings"]["seq_len"]
    assert data["scaling"][-1]["fits"] is False or data["bound"].startswith("the search")
    code, out, _ = run_cli(capsys, "plan", str(config), "--seq-len", "max", "--global-batch-size", "2",
                           "--gpu-memory", "1100MiB", "--gpu", "h100", "--explain")
    assert code == 0 and out.startswith("Longest sequence that fits: ") and "How memory and step time grow" in out


def test_seq_len_max_refusals_are_one_line(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LONG_LLAMA))
    code, out, err = run_cli(capsys, "plan", str(config), "--seq-len", "max", "--global-batch-size", "2",
                             "--gpu-memory", "1MiB", "--gpu", "h100")
    errors = [line for line in err.splitlines() if not line.startswith("hf-memfit: [")]  # progress lines aside
    assert code == 2 and out == "" and len(errors) == 1 and "nothing fits even at 128 tokens" in errors[0]
    code, out, err = run_cli(capsys, "estimate", str(config), "--batch-size", "1", "--seq-len", "max")
    assert code == 2 and "--seq-len" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(MemFitError, match="decoder-seq-len"):
        from hf_memfit.planner.longest import check_seq_len_max_request

        check_seq_len_max_request({"decoder_seq_len": 64})


def test_seq_len_max_search_leaving_out_what_did_not_fit_is_the_full_search(llama, monkeypatch):
    """Settings refused at a length are left out at longer ones; every probe's plan is the full search's."""
    from hf_memfit.planner import candidates, longest

    kwargs = dict(global_batch_size=2, gpu_memory="1100MiB", gpu="h100")  # TiledMLP searched: 64-token shards
    evaluated = []
    evaluate = candidates.evaluate_candidate
    monkeypatch.setattr("hf_memfit.planner.search.evaluate_candidate",
                        lambda *a: evaluated.append(a[1]) or evaluate(*a))
    low, high, points = longest._search(llama, longest.LONGEST, kwargs)
    pruned = len(evaluated)
    evaluated.clear()
    full_plan = longest.plan
    monkeypatch.setattr(longest, "plan", lambda *a, not_fitting=None, **k: full_plan(*a, **k))
    full_low, full_high, full_points = longest._search(llama, longest.LONGEST, kwargs)
    assert (low, high) == (full_low, full_high) and sorted(points) == sorted(full_points)
    assert pruned < 0.7 * len(evaluated), (pruned, len(evaluated))
    over = min(k for k, p in full_points.items() if not p.fits and k > low)
    assert points[over] == full_points[over]  # the bound's reason: planned in full
    for length, point in full_points.items():
        assert (points[length].fits, points[length].device_total_bytes, points[length].summary,
                points[length].step_seconds) == (point.fits, point.device_total_bytes, point.summary,
                                                 point.step_seconds), length


def test_seq_len_max_in_forked_children_is_the_answer_of_one_process(llama, monkeypatch, tmp_path):
    """Where CPUs are idle the search runs in a child beside the imports, and exact mode's two depth traces side
    by side: the same answer, points and exact figure as one process."""
    from hf_memfit.estimator import exact, forked

    kwargs = dict(global_batch_size=1, gpu_memory="1100MiB", gpu="h100")
    monkeypatch.setattr(forked, "idle_cpus", lambda: 2.0)  # as on an idle machine, whatever the load here
    started = []
    start = forked._start
    monkeypatch.setattr(forked, "_start", lambda *a: started.append(a[0].__name__) or start(*a))
    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path / "children"))
    children = longest_seq_len(llama, **kwargs)
    assert "_search" in started and "_depth_trace" in started
    monkeypatch.setenv("HF_MEMFIT_NO_FORK", "1")
    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path / "here"))
    here = longest_seq_len(llama, **kwargs)
    assert json.dumps(children.to_dict(), sort_keys=True) == json.dumps(here.to_dict(), sort_keys=True)
    assert children.result.estimate.settings.mode == "exact"  # the answer, near its budget, was traced
    assert exact._depth_trace.__module__ == "hf_memfit.estimator.exact"


def test_forked_helpers_run_beside_and_side_by_side(monkeypatch):
    """`run_beside` returns the child's result after `meanwhile`; a child that fails has its job run here, so its
    error is raised here; `run_side_by_side` keeps the jobs' order."""
    from hf_memfit.estimator import forked

    monkeypatch.setattr(forked, "idle_cpus", lambda: 2.0)
    ran = []
    assert forked.run_beside(divmod, (7, 2), lambda: ran.append("here")) == (3, 1) and ran == ["here"]
    with pytest.raises(ZeroDivisionError):
        forked.run_beside(divmod, (7, 0), lambda: None)
    with pytest.raises(KeyError):  # an error here stops (and reaps) the child
        forked.run_beside(divmod, (7, 2), lambda: {}["missing"])
    assert forked.run_side_by_side(divmod, [(7, 2), (9, 4), (1, 1)]) == [(3, 1), (2, 1), (1, 0)]
    monkeypatch.setattr(forked, "idle_cpus", lambda: 0.5)  # a busy machine: here, and nothing beside
    assert forked.run_beside(divmod, (7, 2), lambda: ran.append("again")) == (3, 1) and ran == ["here"]


def test_a_job_started_ahead_is_read_not_run_again_and_a_wrong_guess_is_ended(monkeypatch):
    """`speculate` starts a job before it is asked for; `run_side_by_side` reads its result for the job of that key
    and runs the others here; a guess no call asks for is ended (and reaped) before other jobs run."""
    import os

    from hf_memfit.estimator import forked

    monkeypatch.setattr(forked, "idle_cpus", lambda: 2.0)
    ran_here = []

    def traced(a, b):
        ran_here.append(os.getpid())
        return divmod(a, b)

    assert forked.speculate(traced, (7, 2), key="deep") and forked.speculated("deep")
    assert forked.run_side_by_side(traced, [(9, 4), (7, 2)], keys=["shallow", "deep"]) == [(2, 1), (3, 1)]
    assert ran_here == [os.getpid()] and not forked.speculated("deep")  # (7, 2) ran in the child only
    assert forked.speculate(traced, (5, 0), key="wrong")  # a failing guess
    assert forked.run_side_by_side(traced, [(9, 4), (8, 3)], keys=["a", "b"]) == [(2, 1), (2, 2)]
    assert not forked.speculated("wrong")  # ended unread, before the jobs that were asked for
    forked.speculate(traced, (1, 1), key="unread")
    forked.discard_speculations()
    assert not forked.speculated("unread")
    monkeypatch.setattr(forked, "idle_cpus", lambda: 0.5)  # a busy machine: nothing is started ahead
    assert not forked.speculate(traced, (7, 2), key="deep")


def test_json_output_stays_json_when_exact_mode_imports_deepspeed(tmp_path):
    """DeepSpeed logs to the stdout of its first import (its accelerator check warns on a machine without a
    GPU); a fresh process that first imports it for TiledMLP must still print nothing but the JSON, and no
    warning that this machine has no GPU."""
    import os
    import subprocess
    import sys

    config = tmp_path / "config.json"
    config.write_text(json.dumps(LONG_LLAMA))
    env = dict(os.environ, HF_MEMFIT_CACHE=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "-m", "hf_memfit.cli.main", "estimate", str(config), "--batch-size", "1",
                          "--seq-len", "256", "--device", "cpu", "--tiled-mlp", "--mode", "exact", "--json"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["mode"] == "exact", run.stdout[:300]
    # its accelerator check's warning speaks of this machine, not of the GPU planned for (`deepspeed_import`)
    assert "Setting accelerator to CPU" not in run.stderr

"""The lazy grid search (`planner/lazy_grid.py`) plans what an exhaustive search plans, estimating fewer settings."""

import pytest

from hf_memfit.errors import NothingFits
from hf_memfit.models.spec import ModelSpec
from hf_memfit.planner import lazy_grid
from hf_memfit.planner.search import plan
from hf_memfit.report.text import format_plan
from tests.conftest import TINY_LLAMA

# Hand-written families (formulas: every estimate costs milliseconds), across what makes the search take
# another path: a roomy budget, checkpointing, ZeRO with offload, sequence parallelism, a last-resort
# offload of the checkpoints, pure bf16, TRL's activation offloading (its step time only bounded before the
# estimate), the CPU's speed model, and a refusal.
CASES = {
    "roomy": dict(model="gpt2", seq_len=1024, global_batch_size=32, gpu="a100"),
    "lora-tight": dict(model="meta-llama/Llama-3.1-8B", seq_len=4096, global_batch_size=16, gpu="a10g", lora_r=16),
    "full-ft-offload": dict(model="meta-llama/Llama-3.1-8B", seq_len=2048, global_batch_size=16, gpu="a10g",
                            num_gpus=2),
    "sequence-parallel": dict(model="meta-llama/Llama-3.1-8B", seq_len=131072, global_batch_size=8, gpu="h100",
                              num_gpus=8),
    "qlora-12gb": dict(model="Qwen/Qwen2.5-7B", seq_len=8192, global_batch_size=8, gpu_memory="12GiB",
                       load_in_4bit=True, lora_r=16),
    "pure-bf16": dict(model="gpt2-xl", seq_len=1024, global_batch_size=16, gpu_memory="16GiB", allow_pure_bf16=True,
                      allow_offload="none"),
    "trl-activation-offloading": dict(model="meta-llama/Llama-3.2-1B", seq_len=8192, global_batch_size=8,
                                      gpu="a10g", trainer="sft", activation_offloading=True),
    "cpu": dict(model="gpt2", seq_len=256, global_batch_size=8, gpu_memory="3GiB", device="cpu"),
    "refused": dict(model="meta-llama/Llama-2-70b-hf", seq_len=4096, global_batch_size=8, gpu_memory="12GiB",
                    allow_offload="none"),
}


def _outcome(monkeypatch, lazy: bool, kwargs: dict):
    monkeypatch.setattr(lazy_grid, "LAZY", lazy)
    try:
        result = plan(**{"confirm_in_exact": False, **kwargs})
    except NothingFits as refusal:
        return str(refusal), None
    table = format_plan(result).split("\n", 1)[1]  # the first line counts what was estimated
    return (result.to_dict(), table), result


@pytest.mark.parametrize("name", CASES)
def test_the_same_plan_as_an_exhaustive_search(monkeypatch, name):
    lazy, lazy_result = _outcome(monkeypatch, True, CASES[name])
    exhaustive, exhaustive_result = _outcome(monkeypatch, False, CASES[name])
    assert lazy == exhaustive
    if lazy_result is not None:
        assert exhaustive_result.candidates_tried == exhaustive_result.candidates_searched
        assert lazy_result.candidates_searched == exhaustive_result.candidates_searched
        assert lazy_result.candidates_tried <= exhaustive_result.candidates_tried


def test_a_roomy_plan_estimates_a_fraction_of_its_grid(monkeypatch):
    monkeypatch.setattr(lazy_grid, "LAZY", True)
    result = plan(**CASES["roomy"])
    assert result.candidates_tried < result.candidates_searched / 2
    assert "configurations searched" in format_plan(result).splitlines()[0]


def test_near_budget_choices_confirmed_in_exact_mode_as_an_exhaustive_search_confirms_them(monkeypatch):
    """The plan's fastest fast-mode choices sit near the budget: exact mode confirms (or rejects) them first,
    so the lazy search counts the runners-up only from the first one it cannot reject."""
    spec = ModelSpec.from_config("tiny-llama", TINY_LLAMA)
    common = dict(seq_len=128, global_batch_size=4, device="cpu", headroom=0.0)
    roomy = plan(spec, gpu_memory="1GiB", **common)
    budget = int(roomy.estimate.device_total_bytes * 1.02)  # the fastest plan within 5% of the budget
    outcomes = [_outcome(monkeypatch, lazy, dict(model=spec, gpu_memory=budget, confirm_in_exact=True, **common))
                for lazy in (True, False)]
    assert outcomes[0][0] == outcomes[1][0]
    assert any("confirmed in exact mode" in r for r in outcomes[0][1].plan.reasons)


def test_offloaded_checkpoints_wait_until_nothing_on_the_device_is_certain(monkeypatch):
    """A plan offloads activation checkpoints only when nothing on the device fits, so once an on-device plan is
    certain the offloaded candidates are not estimated (each is a traced fit for image and VLM inputs); the plan
    still says what offloading would free, from the one counterpart it looks up."""
    from hf_memfit.planner.candidates import Candidates

    seen = []  # the settings each plan estimated (`Candidates.estimate_one`'s calls)
    original = Candidates.__init__
    monkeypatch.setattr(Candidates, "__init__", lambda self, estimate_one, *rest: original(
        self, lambda settings: seen.append(settings) or estimate_one(settings), *rest))
    estimated = {}
    for lazy in (True, False):
        monkeypatch.setattr(lazy_grid, "LAZY", lazy)
        seen.clear()
        result = plan(confirm_in_exact=False, **CASES["full-ft-offload"])
        estimated[lazy] = [s for s in seen if s.offload_activations]
    assert result.plan.gradient_checkpointing and not result.plan.offload_activations
    assert len(estimated[False]) > 10
    chosen = result.estimate.settings
    assert estimated[True] == [s for s in estimated[False] if s == chosen.replace(offload_activations=True)]
    assert not any(c.settings.offload_activations for c in result.alternatives)


def test_an_on_device_plan_traces_no_fit_for_offloaded_checkpoints_to_explain_itself():
    """Where fast mode reads traced fits (a family without formulas), offloaded checkpoints are a fit of their own,
    seconds of traces: a plan that fits on the device does not make it for one line of its explanation, and the
    line says how to get the figure. With formulas the counterpart costs nothing and is estimated (its figure:
    `test_levers.py`)."""
    import functools

    from hf_memfit.estimator.assemble import fit_group
    from hf_memfit.planner.candidates import Candidate, Candidates
    from hf_memfit.planner.explain import activation_offload_reason
    from hf_memfit.settings import TrainSettings
    from tests.conftest import TINY_QWEN3

    chosen = TrainSettings(batch_size=2, seq_len=256, task="causal-lm", gradient_checkpointing=True, device="cuda",
                           gpu="a10g", precision="bf16-mixed")
    offloaded = chosen.replace(offload_activations=True)
    for spec, traced in ((ModelSpec.from_config("qwen3", TINY_QWEN3), True),
                         (ModelSpec.from_config("tiny-llama", TINY_LLAMA), False)):
        assert (fit_group(spec, offloaded) is not None) == traced
        asked = []
        candidates = Candidates(asked.append, functools.partial(fit_group, spec))
        candidates.unestimated[offloaded] = None
        reason = activation_offload_reason(Candidate(chosen, None, 1.0, True), candidates)
        if traced:
            assert reason.startswith("activation checkpoints stay on the GPU: a plan fits without offloading them")
            assert "--offload-activations" in reason and not asked
        else:
            assert asked == [offloaded]  # estimated on demand (here it gives no candidate, so no line)

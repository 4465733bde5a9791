"""Estimating a grid lazily: only the candidates that could be the plan, a runner-up, or a faster misfit.

The speed model (`speed.step_seconds`) reads a candidate's estimate for two things only: its parameter counts,
the same for every candidate of one grid (the model, its adapters and what it freezes are fixed there), and,
under TRL's activation offloading, its host bytes, whose PCIe time only grows with them. So once one candidate
is estimated, every other one's step time is known before its memory is (under TRL's offloading, a lower bound
on it): the speed model with that candidate's parameter counts and no host bytes.

The grid is estimated in that order, fastest first, until every candidate left is slower than the second
runner-up of the fastest fitting candidate that exact mode cannot reject (`explain.runner_up_picks`; one
whose fast estimate is near the budget may be rejected when the plan confirms it, so the runners-up are
counted from the first one that is not). A candidate left is then none of what a plan reports: its choice,
the near-budget candidates confirmed before it, its runners-up, and the faster configurations that did not fit.
A grid where nothing fits, or only with activation checkpoints offloaded (a last resort, taken only when
nothing on the device fits), is estimated whole; so is every grid of `plan(mode="exact")`, which confirms
every choice. An explanation naming a slower candidate estimates it on demand (`Candidates.lookup`).

Estimating costs nothing for families with formulas; for image, audio and VLM inputs and families without
formulas each fast-mode fit is traced (seconds each), and a plan whose fastest settings fit needs only theirs.
Candidates that offload activation checkpoints, a last resort, wait until every candidate on the device is
estimated and none is certain to be the plan. Until the plan and its runners-up are known, candidates are
estimated strictly fastest first and fits are made when every faster candidate has been estimated. The first
step makes as many as the idle CPUs trace in one round (`_fit_groups_per_step`): a roomy budget needs only the
fastest setting's fit. Once that leaves the plan unknown, more fits are likely needed, and each step makes the
next fit a candidate on the device needs, the next ones in order beside it (offloaded checkpoints' too) up to
`AT_LEAST_GROUPS` where one fit leaves a CPU idle, and any other whose fastest setting ties theirs (a ZeRO
layout's bf16 step on one GPU). After that, every fit left below the threshold side by side
(`assemble.prepare`). Candidates are kept in grid order, as an exhaustive search lists them, so ties break the
same way. `tests/test_lazy_grid.py` checks that plans come out the same as an exhaustive
search's.
"""

import dataclasses
import itertools
import math
from types import SimpleNamespace

from hf_memfit.estimator.assemble import fit_group, prepare
from hf_memfit.planner.candidates import Candidate, Candidates, MAX_EXACT_CONFIRMATIONS, fitting_last_resort_last
from hf_memfit.planner.explain import RUNNERS_UP, runner_up_picks
from hf_memfit.planner.speed import step_seconds
from hf_memfit.tasks import MEDIA_TASKS

#: False estimates every candidate (the exhaustive search this one must agree with; tests compare the two).
LAZY = True

# Parameter counts for ordering the grid before any candidate is estimated: the speed model's compute and
# sequence exchange alone (its optimizer, offload and communication terms scale with these counts).
_NO_PARAMETERS = SimpleNamespace(total_params=0, trainable_params=0, cpu_bytes=0)


def search_grid(spec, grid: list, found: Candidates, *, gpu_info, uncertain) -> tuple[list[Candidate], int]:
    """Estimate what `grid` needs, adding it to `found` (the rest to `found.unestimated`).

    Returns the fitting candidates, fastest first, offloaded activations last (`fitting_last_resort_last`),
    unconfirmed, and the fastest one's fast-mode device total (0: none fits). `uncertain(candidate)` says
    whether the plan will confirm a fitting candidate in exact mode before choosing it (`needs_confirming`).
    """
    found.searched += len(grid)
    results: dict[int, Candidate | None] = {}  # grid index -> candidate (None: the search skips it)

    def estimate(indices: list[int], also_fit: list[int] | None = None) -> None:
        # the traced fits these read, side by side, and those of `also_fit` (made beside them, estimated later)
        prepare(spec, [grid[i] for i in indices + (also_fit or [])])
        for i in indices:
            results[i] = found.estimate_one(grid[i])

    def estimated() -> list[Candidate]:
        return [results[i] for i in sorted(results) if results[i] is not None]

    if not LAZY:
        estimate(list(range(len(grid))))
        return _done(grid, results, found, estimated())

    groups: dict[int, str | None] = {}  # grid index -> its fit group (`assemble.fit_group`)

    def group(i: int) -> str | None:
        if i not in groups:
            groups[i] = fit_group(spec, grid[i])
        return groups[i]

    # Offloaded activation checkpoints are a last resort (`fitting_last_resort_last`): a plan takes one only when
    # nothing on the device fits, and reports none beside an on-device plan (`explain.runners_up`). So they are
    # searched only once the candidates on the device leave the plan unknown (`last_resort` below).
    on_device = {i for i, s in enumerate(grid) if not s.offload_activations}
    last_resort = not on_device
    compute = [step_seconds(spec, s, _NO_PARAMETERS, gpu_info) for s in grid]
    order = sorted(range(len(grid)), key=compute.__getitem__)
    fitted = any(group(i) is not None for i in order)  # formulas need no fits (nor a look at the idle CPUs)
    first_groups, groups_per_step = _fit_groups_per_step(spec, grid[0].task in MEDIA_TASKS) if fitted else (0, 1)
    firsts = _next_groups([i for i in order if i in on_device or last_resort], set(), group, compute, first_groups,
                          ties=False)
    prepare(spec, [grid[i] for i in firsts])
    made = {group(i) for i in firsts}  # the fit groups made
    seed = None
    for i in sorted(order, key=lambda i: i not in on_device):  # stable: on the device first, fastest first
        estimate([i])
        if results[i] is not None:
            seed = results[i]
            made.add(group(i))
            break
    if seed is None:
        return _done(grid, results, found, [])
    counts = (seed.estimate.total_params, seed.estimate.trainable_params)
    proxy = dataclasses.replace(seed.estimate, cpu_bytes=0)
    bounds = [step_seconds(spec, s, proxy, gpu_info) for s in grid]
    order = sorted(range(len(grid)), key=bounds.__getitem__)
    while True:
        beside: list[int] = []  # fits made beside those the step's candidates read, their candidates not estimated
        threshold = _threshold(fitting_last_resort_last(estimated()), uncertain)
        todo = [i for i in order if i not in results and bounds[i] <= threshold and (last_resort or i in on_device)]
        if not todo and math.isinf(threshold) and not last_resort:
            last_resort = True  # every candidate on the device is estimated, and none is a plan for certain
            continue
        if not todo:
            break
        if math.isinf(threshold):
            # Strictly in bound order: what needs no new fit up to the next new fit group, then the next new
            # groups (`_next_groups`); a new fit is made only when every faster candidate is estimated.
            free = list(itertools.takewhile(lambda i: group(i) is None or group(i) in made, todo))
            if free:
                todo = free[:max(1, len(results))]
            else:
                new = {group(i) for i in _next_groups(todo, made, group, bounds, 1)}
                if groups_per_step > 1:  # made beside it: the next groups in order, offloaded checkpoints' too
                    later = [i for i in order if i not in results and bounds[i] <= threshold]
                    beside = _next_groups(later, made | new, group, bounds, groups_per_step - 1)
                    new |= {group(i) for i in beside}
                todo = [i for i in todo if group(i) is None or group(i) in made or group(i) in new]
        made.update(group(i) for i in todo + beside)
        estimate(todo, beside)
        if any((c.estimate.total_params, c.estimate.trainable_params) != counts for c in estimated()):
            bounds = [-math.inf] * len(grid)  # the step times are not known before the estimates: all of them
    return _done(grid, results, found, estimated())


def _next_groups(indices, made: set, group, times, count: int, ties: bool = True) -> list[int]:
    """The first index (in `indices`' order) of each of the next `count` fit groups not in `made`, and with `ties`
    of each further new group whose first setting ties the first one's time (`times`): made side by side (a ZeRO
    layout on one GPU times as the plain one, but the trace of its bf16 step is another fit)."""
    firsts: dict = {}
    for i in indices:
        g = group(i)
        if g is None or g in made or g in firsts:
            continue
        if len(firsts) >= count and not (ties and math.isclose(times[i], times[next(iter(firsts.values()))],
                                                                rel_tol=1e-9)):
            break
        firsts[g] = i
    return list(firsts.values())


# Fits made per step at least once the first step has left the plan unknown (the next ones in order, while there
# are), where one fit's traces leave a CPU idle (`_fit_groups_per_step`): each step waits for its slowest trace, and
# a fit's 3 depth traces leave a CPU idle on two CPUs where two fits' traces keep both busy.
AT_LEAST_GROUPS = 2


def _fit_groups_per_step(spec, media: bool) -> tuple[int, int]:
    """How many fit groups a step makes: (the first step, each later step), from the CPUs that trace side by side
    (`forked.slots`) and the reduced depths each fit traces (`depths.depth_plan`: 2-4).

    The first step, before anything says that more than the fastest fit is needed, makes as many as the idle CPUs
    trace in one round, at least one, and no ties. A group made on speculation costs nothing where its traces run
    on CPUs that would otherwise be idle, and a whole round where they would not: on two CPUs a cold Whisper-small
    plan made its ZeRO layout's bf16 fit beside the mixed-precision one (the two time alike on one GPU) and never
    read it (14.6 s; 11.1 s without).

    A later step makes `AT_LEAST_GROUPS` where one fit's traces leave a CPU idle in their last round (3 traces on
    two CPUs), else one. A second fit made beside one that fills the CPUs costs a round of its own, and may not be
    needed: Gemma-3's fits are 4 traces (sliding and global layers beside its tower). A line of image, audio or VLM
    inputs over 3 depth sets takes 4 jobs on two CPUs, its check point traced apart (`batch_fit.check_apart`): in
    pairs of 3-trace fits Qwen2.5-VL's plan made 5 fits and read 4 (12.6-12.9 s), with 4 jobs a fit it makes the 4
    it reads (10.3-10.4 s).
    """
    from hf_memfit.estimator.batch_fit import check_apart
    from hf_memfit.estimator.forked import slots
    from hf_memfit.models.depths import depth_plan

    cpus, traces = slots(), len(depth_plan(spec).depth_sets)
    traces += media and check_apart(traces)  # a line's check point in a trace of its own
    return max(1, cpus // traces), (AT_LEAST_GROUPS if traces % max(1, cpus) else 1)


def _done(grid, results, found: Candidates, estimated: list[Candidate]) -> tuple[list[Candidate], int]:
    for i, settings in enumerate(grid):
        if i not in results:
            found.unestimated[settings] = None
    found.extend(estimated)
    fitting = fitting_last_resort_last(estimated)
    return fitting, fitting[0].estimate.device_total_bytes if fitting else 0


def _threshold(fitting: list[Candidate], uncertain) -> float:
    """The step time below which every candidate must be estimated; infinite until the plan is known.

    From the first fitting candidate exact mode cannot reject: the plan is it or a faster one (confirmed), so
    its second runner-up's time bounds everything the plan reports. More near-budget candidates before it than
    the plan confirms, and the plan may come out empty (nothing fits): everything is estimated then.
    """
    if not fitting or fitting[0].settings.offload_activations:
        return math.inf  # none on the device yet: one that fits there would be chosen however slow
    for i, candidate in enumerate(fitting):
        if i > MAX_EXACT_CONFIRMATIONS:
            return math.inf
        if not uncertain(candidate):
            picks = runner_up_picks(fitting[i:])
            return picks[-1].step_seconds if len(picks) == RUNNERS_UP else math.inf
    return math.inf

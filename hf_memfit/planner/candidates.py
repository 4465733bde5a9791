"""A candidate setting of the search: its estimate, whether it fits the device and the host, and its step time.

The best fitting candidates are confirmed in exact mode before one is chosen (`confirm_in_exact_mode`).
"""

from dataclasses import dataclass

from hf_memfit.estimator.assemble import MemoryEstimate, estimate_settings
from hf_memfit.planner.speed import step_seconds
from hf_memfit.settings import TrainSettings
from hf_memfit.units import format_bytes


@dataclass
class Candidate:
    settings: TrainSettings
    estimate: MemoryEstimate
    step_seconds: float
    fits: bool
    why_not: str = ""


@dataclass(frozen=True)
class HostLimit:
    """Host RAM per node that offloaded and paged state must fit in, and where the figure came from."""

    bytes: int | None  # None: not checked
    source: str

    def check(self, est: MemoryEstimate) -> str:
        """'' when `est`'s host memory per node fits, else why not."""
        need = host_bytes_per_node(est)
        if self.bytes is None or need <= self.bytes:
            return ""
        return (f"needs {format_bytes(need)} of host memory per node, over the {format_bytes(self.bytes)} "
                f"of {self.source}")


def host_bytes_per_node(est: MemoryEstimate) -> int:
    """Host memory one node needs: each of its ranks holds `cpu_bytes` (offloaded or paged state)."""
    return est.cpu_bytes * est.settings.num_gpus


class Candidates(list):
    """The candidates a plan estimated, in the order an exhaustive search would list them, and the settings its
    lazy search left unestimated (`lazy_grid.py`: they could be neither the plan nor one of its runners-up).

    An explanation that names one of those (`lookup`: "without it the peak would be ...") or a set of them
    (`where`: the bigger micro-batches of the plan's knobs) estimates it on demand, so a plan says what an
    exhaustive search would have said. `estimate_one(settings)` gives the Candidate, or None for settings the
    search skips (`plan(not_fitting=...)`); `searched` counts the settings of the grids searched. `fit_group(settings)`
    names the traced fit fast mode reads for them (`assemble.fit_group`; None: formulas, nothing to trace).
    """

    def __init__(self, estimate_one, fit_group=lambda settings: None):
        super().__init__()
        self.estimate_one = estimate_one
        self.fit_group = fit_group
        self.unestimated: dict[TrainSettings, None] = {}  # insertion-ordered
        self.searched = 0

    def lookup(self, settings: TrainSettings) -> "Candidate | None":
        for c in self:
            if c.settings == settings:
                return c
        return self._estimate(settings) if settings in self.unestimated else None

    def where(self, predicate) -> list["Candidate"]:
        """Every candidate whose settings match `predicate`, the unestimated ones estimated first."""
        for settings in [s for s in self.unestimated if predicate(s)]:
            self._estimate(settings)
        return [c for c in self if predicate(c.settings)]

    def _estimate(self, settings: TrainSettings) -> "Candidate | None":
        del self.unestimated[settings]
        candidate = self.estimate_one(settings)
        if candidate is not None:
            self.append(candidate)
        return candidate


def fitting_last_resort_last(candidates: list[Candidate]) -> list[Candidate]:
    """The fitting candidates, fastest first; offloaded activation checkpoints only when nothing else fits.

    Offloaded checkpoints hold pinned host memory (one hidden state per layer per rank, which host RAM that is
    not checked may not have) and slow every step by copies on the compute stream; the speed model can rank
    them first on a bigger micro-batch, but the plan keeps them as a last resort and says what they would do.
    """
    fitting = sorted((c for c in candidates if c.fits), key=lambda c: c.step_seconds)
    on_device = [c for c in fitting if not c.settings.offload_activations]
    return on_device or fitting


def evaluate_candidate(spec, settings: TrainSettings, usable: int, host: HostLimit, gpu_info) -> Candidate:
    est = estimate_settings(spec, settings)
    why = why_not_fits(est, usable, host)
    return Candidate(settings, est, step_seconds(spec, settings, est, gpu_info), not why, why)


def why_not_fits(est: MemoryEstimate, usable: int, host: HostLimit) -> str:
    """'' when the estimate fits the device and the host, else why not (with its numbers)."""
    if est.device_total_bytes > usable:
        return f"needs {format_bytes(est.device_total_bytes)}, over the {format_bytes(usable)} usable"
    return host.check(est)


# Fast mode agrees with exact mode to within a few percent on the device total
# (docs/benchmarks.md, "Fast vs exact"); a fast-mode choice closer to the budget
# than this is confirmed in exact mode before it is chosen.
CONFIRM_IN_EXACT_MARGIN = 0.05


# At most this many near-budget candidates are traced before giving up on them.
MAX_EXACT_CONFIRMATIONS = 5


def needs_confirming(candidate: Candidate, usable: int, everything: bool) -> bool:
    """Whether `confirm_in_exact_mode` traces this fitting candidate before choosing it."""
    return everything or candidate.estimate.device_total_bytes > (1 - CONFIRM_IN_EXACT_MARGIN) * usable


def confirm_in_exact_mode(spec, fitting: list[Candidate], usable: int, host: HostLimit, *, everything: bool,
                   progress=None) -> list[Candidate]:
    """The fitting candidates, fastest first, with the first one confirmed in exact mode where needed.

    A candidate needs confirming when `everything` (plan --mode exact) or when its
    fast estimate is within CONFIRM_IN_EXACT_MARGIN of `usable`. A confirmed one
    carries its exact estimate; one that exact mode rejects is marked as not
    fitting, with the exact figure, so nothing printed later calls it a fit.
    """
    traced = 0
    for i, candidate in enumerate(fitting):
        if not needs_confirming(candidate, usable, everything):
            return fitting[i:]
        if traced == MAX_EXACT_CONFIRMATIONS:
            break
        if progress is not None:
            progress(f"confirming in exact mode: micro-batch {candidate.settings.batch_size}, "
                     f"fast estimate {format_bytes(candidate.estimate.device_total_bytes)} of "
                     f"{format_bytes(usable)} usable")
        exact = estimate_settings(spec, candidate.settings.replace(mode="exact"))
        traced += 1
        candidate.estimate = exact
        why = why_not_fits(exact, usable, host)
        if not why:
            return fitting[i:]
        candidate.fits, candidate.why_not = False, f"exact mode: {why}"
    return []

"""`--seq-len max`: the longest sequence that trains within the budget, and how memory and time grow to it.

Memory grows monotonically with the sequence for every layout the planner searches (activations,
temporaries and the loss are all at least linear in the tokens; model states do not change), so
the longest fitting length is found by doubling from `SCALE_FROM` until a length does not fit,
then bisecting. Each probe is a whole `plan()` in fast mode, so every lever the plan may use
(checkpointing, offload, ZeRO / FSDP, sequence parallelism, Liger, tiled MLP ...) is used to get
there, with the same global batch, and keeps `FAST_MODE_MARGIN` of the usable memory spare for fast
mode's error, so that the one exact-mode confirmation of the answer holds. Only the answer is confirmed in exact mode (as any plan near
its budget is); the probes are not, which is what keeps a cold answer to seconds.

Because a setting's memory grows with the sequence, a probe leaves out the settings that did not fit
at a shorter length (`plan(not_fitting=...)`; the same points as the full search, tested), and the
search, which imports no torch, runs in a forked child while this process imports what exact mode's
confirmation needs (`estimator/forked.py`, where a CPU is idle). Then, while this process plans the answer's
length, a child starts the confirmation's deepest trace for the plan's choice there, which the search finds as
a probe does (`_choice`): the confirmation reads it, or, where exact mode refuses that choice, it is ended
unread.
"""

import logging
from dataclasses import dataclass, field

from hf_memfit.errors import MemFitError, NothingFits
from hf_memfit.estimator.assemble import speculate_exact
from hf_memfit.estimator.forked import discard_speculations, import_for_traces, run_beside
from hf_memfit.estimator.worker_pool import keeps_workers
from hf_memfit.models.spec import ModelSpec, resolve_model
from hf_memfit.planner.explain import layout_text
from hf_memfit.planner.result import PlanResult
from hf_memfit.planner.search import DEFAULT_HEADROOM, plan
from hf_memfit.units import format_bytes

SCALE_FROM = 8192  # the scaling table starts here (the "from 8K")
SHORTEST = 128  # below this a "longest sequence" is no answer: refuse instead
# The search stops here: past every published run (ALST trains Llama-3.1-8B at 15M tokens on 32 H100s,
# arXiv 2506.13996), and where a 2^24-token row's positions still fit in an int32 index tensor.
LONGEST = 2**24
# The answer's resolution: a multiple of a power of two that is at least 1/RESOLUTION of it (about 1%),
# and never under 64 tokens (so it divides by any sequence-parallel degree up to 64).
RESOLUTION = 64
MIN_GRANULE = 64
# The probes keep this fraction of the usable memory spare, for fast mode's error against exact mode: at
# most 0.33% of the device total over section 6's 13 configurations and -0.01% on the long-context rows of
# section 17 (docs/benchmarks.md). Without it the search's answer sits on the budget's edge, exact mode
# refuses it by a few MB, and the confirmation (two traces of the whole step) runs a second time.
FAST_MODE_MARGIN = 0.005
# Each probe's line goes where exact mode's progress goes: on a terminal at once, in logs only if slow.
_progress_log = logging.getLogger("hf_memfit.progress")


@dataclass
class LengthPoint:
    """The plan at one sequence length of the search, or why nothing fits there."""

    seq_len: int
    fits: bool
    device_total_bytes: int = 0
    step_seconds: float = 0.0
    tokens_per_second: float = 0.0
    summary: str = ""  # micro-batch, checkpointing, layout and levers of the plan there
    why_not: str = ""
    confirmed: bool = False  # re-estimated in exact mode (only the answer is)
    settings: object = None  # the answer's: the TrainSettings its confirmation will trace (`_choice`; not in the JSON)

    def to_dict(self) -> dict:
        return {"seq_len": self.seq_len, "fits": self.fits, "device_total_bytes": self.device_total_bytes,
                "step_seconds": round(self.step_seconds, 4), "tokens_per_second": round(self.tokens_per_second, 1),
                "summary": self.summary, "why_not": self.why_not, "confirmed_in_exact_mode": self.confirmed}


@dataclass
class LongestResult:
    """The longest sequence that fits, its plan, and the plans on the way there."""

    seq_len: int
    result: PlanResult
    bound: str  # what stops the sequence from growing further
    points: list[LengthPoint] = field(default_factory=list)  # ascending; those from SCALE_FROM make the table
    probes: int = 0

    def scaling(self) -> list[LengthPoint]:
        """The table `--explain` shows: each doubling from 8K (or the shortest probed) that fits, and the answer."""
        start = SCALE_FROM if any(p.seq_len >= SCALE_FROM for p in self.points if p.fits) else 0
        rows = [p for p in self.points if p.fits and p.seq_len >= start and _is_doubling(p.seq_len)]
        rows = [p for p in rows if p.seq_len < self.seq_len]
        answer = next(p for p in self.points if p.seq_len == self.seq_len)
        first_over = next((p for p in self.points if not p.fits and p.seq_len > self.seq_len), None)
        return rows + [answer] + ([first_over] if first_over else [])

    def to_dict(self) -> dict:
        return {"longest_seq_len": self.seq_len, "bound": self.bound, "probes": self.probes,
                **self.result.to_dict(), "scaling": [p.to_dict() for p in self.scaling()]}


def longest_seq_len(model: str | ModelSpec, *, progress=None, **plan_kwargs) -> LongestResult:
    """The longest `seq_len` for which `plan(model, seq_len=..., **plan_kwargs)` finds a configuration.

    `plan_kwargs` are `plan()`'s, less `seq_len`. Raises `MemFitError` for a bad request (as
    `plan()` would at any length) and `NothingFits` when nothing fits even at `SHORTEST` tokens.
    """
    if "seq_len" in plan_kwargs:
        raise TypeError("longest_seq_len() searches seq_len; do not pass it")
    spec = model if isinstance(model, ModelSpec) else resolve_model(model)
    _refuse_fixed_sequence(spec, plan_kwargs.get("task"))
    mode = plan_kwargs.pop("mode", "fast")
    limit, limit_reason = _length_limit(spec)
    # The fast-mode search imports no torch; the exact-mode confirmation after it imports torch, transformers
    # and the model's code (seconds). Where a CPU is idle, the search runs in a forked child meanwhile.
    searched = run_beside(_search, (spec, limit, plan_kwargs), lambda: import_for_traces(spec.model_type))
    if isinstance(searched, MemFitError):
        raise searched
    low, high, points = searched
    # The confirmation plans `low` in fast mode (0.7 s for 816 candidates on eight GPUs), then traces its choice at
    # two depths side by side, the deeper one last to finish. The search knows that choice (`_choice`), so that
    # trace starts now, in a child beside the plan (`assemble.speculate_exact`).
    try:
        if points[low].settings is not None:
            speculate_exact(spec, points[low].settings)
        answer, result = _confirm(spec, low, points, mode, progress, plan_kwargs)
    finally:
        discard_speculations()  # the guess no confirmation read (another choice, or none near the budget)
    if high is None and answer == low:
        bound = limit_reason
    else:
        over = min(k for k, p in points.items() if not p.fits and k > answer)
        bound = (f"the budget: {over:,} tokens would not fit with {100 * FAST_MODE_MARGIN:g}% of it spare "
                 "for fast mode's error")
    return LongestResult(answer, result, bound, [points[k] for k in sorted(points)], len(points))


@keeps_workers  # one set of workers for every length's plan
def _search(spec: ModelSpec, limit: int, plan_kwargs: dict):
    """The fast-mode search: (longest length that fits, shortest that does not or None, the points probed).

    Settings that did not fit at a length are left out of the probes at longer ones (`plan(not_fitting=...)`:
    memory grows with the sequence); the length the answer is bounded by is planned again in full, for its
    one-line reason. A refused request comes back as its `MemFitError` (a value, so that a forked child can
    send it).
    """
    points: dict[int, LengthPoint] = {}
    not_fitting: dict = {}
    shortened: set[int] = set()  # lengths refused by a probe that left settings out

    def probe(seq_len: int) -> bool:
        return _probe(spec, seq_len, points, plan_kwargs, not_fitting, shortened)

    try:
        low = min(SCALE_FROM, limit)
        while not probe(low):
            if low // 2 < SHORTEST:
                raise NothingFits(f"`--seq-len max`: nothing fits even at {low} tokens; at that length, "
                                  f"{points[low].why_not}")
            low //= 2
        high = None  # the shortest length known not to fit
        while high is None and low < limit:
            nxt = min(2 * low, limit)
            if probe(nxt):
                low = nxt
            else:
                high = nxt
        if high is not None:
            low = _bisect(low, high, probe)
            over = min(k for k, p in points.items() if not p.fits and k > low)
            if over in shortened:  # its reason, as a plan at that length gives it
                del points[over]
                _probe(spec, over, points, plan_kwargs)
    except MemFitError as refused:
        return refused
    points[low].settings = _choice(spec, low, plan_kwargs, not_fitting)
    return low, high, points


def _choice(spec, seq_len: int, plan_kwargs: dict, not_fitting: dict):
    """The settings the answer's confirmation will trace: what `plan()` chooses at `seq_len` with the user's
    headroom, where the probe had `FAST_MODE_MARGIN` less. Planned as a probe is (leaving out what did not fit
    at a shorter length), in milliseconds where the full plan takes most of a second (eight GPUs: 816
    candidates, for its reasons and runners-up), so that the confirmation's traces can start beside that plan."""
    try:
        return plan(spec, seq_len=seq_len, mode="fast", confirm_in_exact=False, not_fitting=not_fitting,
                    **plan_kwargs).estimate.settings
    except MemFitError:
        return None


def probe_headroom(headroom: float) -> float:
    """The probes' headroom: the user's, and `FAST_MODE_MARGIN` of what it leaves usable."""
    return 1 - (1 - headroom) * (1 - FAST_MODE_MARGIN)


def _probe(spec, seq_len: int, points: dict, plan_kwargs: dict, not_fitting: dict | None = None,
           shortened: set | None = None) -> bool:
    """Plan `seq_len` in fast mode with no exact confirmation (and `probe_headroom`), into `points`; whether it fits."""
    if seq_len not in points:
        _progress_log.info("--seq-len max: planning %s tokens", f"{seq_len:,}")
        leaves_out = not_fitting is not None and any(shortest <= seq_len for shortest in not_fitting.values())
        kwargs = {**plan_kwargs, "headroom": probe_headroom(plan_kwargs.get("headroom", DEFAULT_HEADROOM))}
        try:
            result = plan(spec, seq_len=seq_len, mode="fast", confirm_in_exact=False, not_fitting=not_fitting,
                          **kwargs)
        except NothingFits as refused:
            points[seq_len] = LengthPoint(seq_len, False, why_not=str(refused))
            if leaves_out:
                shortened.add(seq_len)
        else:
            points[seq_len] = _point(seq_len, result, plan_kwargs["global_batch_size"])
    return points[seq_len].fits


def _confirm(spec, low: int, points, mode: str, progress, plan_kwargs) -> tuple[int, PlanResult]:
    """Re-plan the longest fitting length as a plain plan does (exact mode near the budget); step down if refused."""
    tries = 0
    while True:
        try:
            result = plan(spec, seq_len=low, mode=mode, progress=progress, **plan_kwargs)
        except NothingFits as refused:  # exact mode disagrees with the fast probes near the budget
            points[low] = LengthPoint(low, False, why_not=str(refused))
            tries += 1
            # Fast mode agrees with exact mode to a few percent (docs/benchmarks.md): step down ~3% at a time.
            step = max(_granule(low), low // 32 // _granule(low) * _granule(low))
            if low - step < SHORTEST or tries > 8:
                raise NothingFits(f"`--seq-len max`: the longest length fast mode fits, {low:,} tokens, "
                                  f"does not fit in exact mode: {refused}") from None
            low -= step
            continue
        point = _point(low, result, plan_kwargs["global_batch_size"])
        point.confirmed = result.estimate.settings.mode == "exact"
        points[low] = point
        return low, result


def _bisect(low: int, high: int, probe) -> int:
    """The longest length in [low, high) that fits, to the resolution of `_granule`."""
    while True:
        step = _granule(low)
        if high - low <= step:
            return low
        mid = (low + high) // 2 // step * step
        if mid <= low:
            return low
        if probe(mid):
            low = mid
        else:
            high = mid


def _granule(seq_len: int) -> int:
    granule = MIN_GRANULE
    while granule * 2 * RESOLUTION <= seq_len:
        granule *= 2
    return granule


def _is_doubling(seq_len: int) -> bool:
    return seq_len & (seq_len - 1) == 0


def _length_limit(spec: ModelSpec) -> tuple[int, str]:
    """How far the search may go: a learned position table ends the sequence; rotary models go on."""
    positions = spec.max_position_embeddings
    if spec.learned_positions and positions:
        return positions, f"the model's {positions:,} learned positions (`max_position_embeddings`)"
    return LONGEST, f"the search's limit of {LONGEST:,} tokens"


def _point(seq_len: int, result: PlanResult, global_batch_size: int) -> LengthPoint:
    s = result.plan.settings
    seconds = result.plan.predicted_step_seconds
    levers = [name for flag, name in ((s.use_liger_kernel, "Liger"), (s.offload_activations, "checkpoints on host"),
                                      (s.tiled_mlp, "tiled MLP"),
                                      (s.expandable_segments, "expandable segments")) if flag]
    summary = (f"micro {s.batch_size} x acc {s.gradient_accumulation_steps}, ckpt "
               f"{'on' if s.gradient_checkpointing else 'off'}, {layout_text(s)}"
               + (f", {', '.join(levers)}" if levers else ""))
    return LengthPoint(seq_len, True, result.estimate.device_total_bytes, seconds,
                       global_batch_size * seq_len / seconds if seconds else 0.0, summary)


def format_scaling(longest: LongestResult) -> str:
    """The table `--seq-len max --explain` prints: memory and step time from 8K to the longest that fits."""
    rows = [("tokens", "device peak", "step", "tokens/s", "plan")]
    for p in longest.scaling():
        if p.fits:
            rows.append((f"{p.seq_len:,}" + (" (max)" if p.seq_len == longest.seq_len else ""),
                         format_bytes(p.device_total_bytes), f"{p.step_seconds:.2f} s", f"{p.tokens_per_second:,.0f}",
                         p.summary + (" [exact]" if p.confirmed else "")))
        else:
            rows.append((f"{p.seq_len:,}", "does not fit", "", "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["How memory and step time grow with the sequence (each row is the plan at that length):"]
    for r in rows:
        lines.append("  " + "  ".join(r[i].rjust(widths[i]) if i else r[i].ljust(widths[i]) for i in range(4))
                     + "  " + r[4])
    return "\n".join(lines)


def _refuse_fixed_sequence(spec: ModelSpec, task: str | None) -> None:
    """Image and audio tasks have no text length to search: their inputs' shape sets the sequence."""
    from hf_memfit.models.inputs import sequence_source
    from hf_memfit.tasks import FIXED_SEQUENCE_TASKS, task_named

    task = task_named(task, spec.supported_tasks) or spec.default_task
    if task in FIXED_SEQUENCE_TASKS:
        raise MemFitError(f"`--seq-len max` searches a text length; {spec.name} is planned as {task}, whose sequence "
                          f"is {sequence_source(spec.config, task)}: drop `--seq-len`")


def check_seq_len_max_request(plan_kwargs: dict) -> None:
    """Flags that make no sense with `--seq-len max`, named in one line."""
    if plan_kwargs.get("decoder_seq_len"):
        raise MemFitError("`--seq-len max` searches one length; drop `--decoder-seq-len` (or give `--seq-len N`)")

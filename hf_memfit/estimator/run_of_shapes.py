"""A run of varying shapes on the CUDA caching allocator: what `max_memory_reserved` climbs to over many
micro-batches, and the smallest card the whole run fits on.

An estimate is one step at one shape, the largest a run meets. A real run meets many: dynamic padding makes every
batch its own length, and a VLM's images their own token counts. The caching allocator keeps the segments each
shape made, and a block one shape freed may be too small, or split, for the next, so a card with room reserves
more over a run than one step did (docs/benchmarks.md section 19: 1.12-2.24x on an H200, the allocated peak
unchanged). That is the `memory(GiB)` ms-swift logs and what `nvidia-smi` shows mid-run.

No formula follows that growth: it comes in jumps when a new size meets a split cache (the H200's Qwen2.5-0.5B
runs climbed 7 GiB at a time). So this traces the run itself, micro-batch by micro-batch, at the model's full
depth on fake CUDA tensors (exact mode's tracer, one build, the lengths drawn as `check --vary-seq-len` draws
them), and replays its allocations and frees through `CachingAllocatorSimulator`, the allocator's rules in
Python. The same replay with a capacity answers the question that decides a run: on a card of N bytes the
allocator frees its cache and retries before it raises an OOM, so the smallest N on which the whole run
completes (`needed_bytes`) is what a budget must hold, and it lies between the run's allocated peak and its
reserved peak on a roomy card.

What it does not cover, refused by `run_problems`: DDP, ZeRO and FSDP (their shards and buckets are laid out
by formula, not traced), sequence and context parallelism, 4- and 8-bit base weights (packed by formula after the
trace), and expandable segments (the simulator follows the default allocator; with expandable segments a run
reserves what its step does, one partly used page per pool: `cuda_overhead.EXPANDABLE_SEGMENTS_SLACK_BYTES`).
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field

from hf_memfit.estimator.cuda_overhead import CachingAllocatorSimulator, SimulatedOutOfMemoryError
from hf_memfit.settings import TrainSettings
from hf_memfit.tasks import FIXED_SEQUENCE_TASKS

# A run's micro-batches when none are given: enough draws that the longest batches meet shorter ones in every
# order (the H200 runs of docs/benchmarks.md section 19 reached their reserved maxima by the 48th).
DEFAULT_MICRO_BATCHES = 64
# `needed_bytes` is found by bisection over replays of the run; it stops when the interval is this narrow.
NEEDED_PRECISION_BYTES = 32 * 2**20


def varying_shapes(settings: TrainSettings, *, min_seq_len: int, micro_batches: int, seed: int = 0,
                   image_sizes: tuple[int, ...] = ()) -> list[tuple[int, int | None]]:
    """(text tokens, image side) per micro-batch of a run with dynamic padding: lengths uniform in
    [`min_seq_len`, the settings' length] (image sides uniform over `image_sizes`), drawn with `seed`; the largest
    shape, the settings' own, is placed at a drawn position so the run meets the step the estimate is for.
    `check --vary-seq-len` measures the run these shapes make, and `run_of_shapes` predicts it."""
    rng = random.Random(seed)
    sides = list(image_sizes) or [settings.image_size]
    drawn = [(rng.randint(min_seq_len, settings.seq_len), rng.choice(sides)) for _ in range(micro_batches)]
    drawn[rng.randrange(len(drawn))] = (settings.seq_len, settings.image_size)
    return drawn


def drawn_image_sides(settings: TrainSettings, smallest: int | None,
                      flag: str = "--vary-image-size") -> tuple[tuple[int, ...], list[str]]:
    """The square image sides a VLM run draws, from `smallest` to the settings' `image_size` (none where `smallest`
    is None), and why they cannot be drawn, one line each."""
    if smallest is None:
        return (), []
    if settings.task != "image-text-to-text" or not settings.image_size:
        return (), [f"`{flag}` draws a VLM's image sides: it needs `--task image-text-to-text` and `--image-size`, "
                    "the largest side"]
    if not 1 <= smallest <= settings.image_size:
        return (), [f"`{flag} {smallest}` is the smallest side drawn: give one from 1 to `--image-size` "
                    f"({settings.image_size})"]
    return tuple(range(smallest, settings.image_size + 1)), []


def run_problems(settings: TrainSettings, *, min_seq_len: int, micro_batches: int, flag: str = "--vary-seq-len"
                 ) -> list[str]:
    """Why a run of varying shapes cannot be simulated for these settings, one line each (empty: it can)."""
    problems = drawn_length_problems(settings.seq_len, min_seq_len, micro_batches, flag)
    if settings.task in FIXED_SEQUENCE_TASKS:
        problems.append(f"`{flag}` draws text lengths, and {settings.task} steps have theirs from their images "
                        "or audio, not drawn: drop it")
    return replay_problems(settings, flag) + problems


def drawn_length_problems(seq_len: int | None, min_seq_len: int, micro_batches: int,
                          flag: str = "--vary-seq-len") -> list[str]:
    """What is wrong with a run's drawn lengths (`estimate` and `check --vary-seq-len`), one line each."""
    problems = []
    if seq_len is None or not 1 <= min_seq_len <= seq_len:
        problems.append(f"`{flag} {min_seq_len}` is the shortest length drawn: give one from 1 to `--seq-len` "
                        f"({seq_len})")
    if micro_batches < 1:
        problems.append(f"`--micro-batches` must be at least 1, got {micro_batches}")
    return problems


def replay_problems(settings: TrainSettings, flag: str = "--vary-seq-len") -> list[str]:
    """Why a traced step or run of these settings cannot be replayed through the simulated caching allocator as
    one process's, one line each (empty: it can)."""
    problems = []
    if settings.device != "cuda":
        problems.append(f"`{flag}` simulates the CUDA caching allocator over a run of varying lengths, and the CPU "
                        "has none (its peak is the step's): drop it, or give `--device cuda`")
    unsupported = [(settings.num_gpus * settings.num_nodes > 1 and not (settings.zero_stage or settings.fsdp),
                    "DDP over several GPUs (its gradient buckets are laid out by formula)"),
                   (settings.zero_stage, "ZeRO (`--zero-stage`)"), (settings.fsdp is not None, "FSDP"),
                   (settings.sp_size * settings.cp_size > 1, "sequence or context parallelism"),
                   (settings.load_in_kbit, "4- or 8-bit base weights"),
                   (settings.expandable_segments, "expandable segments, under which a run reserves what its step "
                                                  "does (one page per pool)")]
    for unsupported_here, what in unsupported:
        if unsupported_here:
            problems.append(f"`{flag}` replays a traced run through the default caching allocator on one process, "
                            f"and these settings use {what}: drop one of the two")
    return problems


@dataclass
class RunOfShapes:
    """The caching allocator over a run of `micro_batches` micro-batches of the drawn `shapes`, on one GPU.

    Byte figures are the allocator's (`torch.cuda.max_memory_allocated` / `max_memory_reserved` terms, cuBLAS
    workspaces included); add the CUDA context for nvidia-smi's figure (`device_total_bytes`).
    """

    min_seq_len: int
    micro_batches: int
    shapes: list[tuple[int, int | None]]
    peak_allocated_bytes: int
    peak_reserved_bytes: int  # on a card with room: what the run's logs show
    step_reserved_bytes: int  # the same replay of steps at the largest shape alone
    needed_bytes: int | None  # the smallest allocator capacity the whole run completes on (None: not searched)
    device_total_bytes: int  # peak_reserved_bytes + what the estimate puts outside the allocator (context ...)
    reserved_after: list[int] = field(default_factory=list)  # the running max reserved after each micro-batch
    seconds: float = 0.0
    # The GPU whose CUDA reductions' staged partial sums are in the replay (`kernel_staging.py`); None: no GPU
    # named, so they are left out (on biased models the replay is then under by up to a few hundred MiB).
    reduction_staging_gpu: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def replay(events, capacity: int | None = None, *, workspace_bytes: int = 0,
           boundaries: tuple[int, ...] = ()) -> tuple[CachingAllocatorSimulator | None, list[int]]:
    """Replay a tracker's (+index | -index, bytes) events; the simulator (None if it ran out of `capacity`) and
    the running peak reserved at each event count in `boundaries`. `workspace_bytes` (cuBLAS's, which it takes
    from the caching allocator at the first matmul) is allocated first."""
    sim = CachingAllocatorSimulator(capacity=capacity)
    at, running = sorted(boundaries), []
    try:
        if workspace_bytes:
            sim.malloc("cublas-workspaces", workspace_bytes)
        for number, (index, nbytes) in enumerate(events):
            while at and at[0] == number:
                running.append(sim.peak_reserved_bytes)
                at.pop(0)
            if index > 0:
                sim.malloc(index, nbytes)
            else:
                sim.free(-index)
    except SimulatedOutOfMemoryError:
        return None, running
    running += [sim.peak_reserved_bytes] * len(at)
    return sim, running


def needed_capacity(events, *, low: int, high: int, workspace_bytes: int = 0,
                    precision: int = NEEDED_PRECISION_BYTES) -> int:
    """The smallest capacity (to `precision`) on which the whole event sequence replays without an OOM: the
    allocator frees its cached segments and retries before it raises one, as torch does. `high` must run."""
    while high - low > precision:
        middle = (low + high) // 2
        if replay(events, middle, workspace_bytes=workspace_bytes)[0] is None:
            low = middle
        else:
            high = middle
    return high


def trace_run(spec, settings: TrainSettings, shapes: list[tuple[int, int | None]], *,
              workspace: int | None = None) -> tuple[list, tuple[int, ...], int | None]:
    """The allocator events of a run of micro-batches of these (tokens, image side) shapes, traced at full depth on
    fake CUDA tensors with an optimizer step every `gradient_accumulation_steps`, and the event count at the end
    of each micro-batch. The run is traced as given, from the model's build on, with no warm-up step: a warm-up
    at another shape would leave the allocator another cache (a VLM's at the full image size reserved the run's
    final figure before its first micro-batch, and hid the growth the H200 measured).

    Given `workspace` (cuBLAS's bytes), the third item is the reserved peak of a replay of two steps at the
    largest shape, traced beside the run. Where a CPU is idle, a run of 3+ optimizer steps is traced in two
    halves side by side (`_halves`), with the same events as in one process.
    """
    from hf_memfit.estimator.forked import forking_pays, run_side_by_side

    accumulation = settings.gradient_accumulation_steps
    steps = tuple(tuple(settings.replace(seq_len=length, image_size=side) for length, side in shapes[i:i + accumulation])
                  for i in range(0, len(shapes), accumulation))
    # Two steps at the largest shape, as the estimate traces them (micro-batches past the second repeat it).
    fixed = settings.replace(gradient_accumulation_steps=min(accumulation, 2))
    largest = ((fixed,) * fixed.gradient_accumulation_steps,) * 2
    jobs = [(spec, settings, steps, False)]
    halves = len(steps) >= 3 and forking_pays()
    if halves:  # here the first steps; in a child the first step again, then the rest (`_halves`)
        from hf_memfit.estimator.trace import progress

        split = (len(steps) + 2) // 2
        progress.info("the run's %d optimizer steps in two halves side by side: 1-%d here, %d-%d in a forked child",
                      len(steps), split, split + 1, len(steps))
        jobs = [(spec, settings, steps[:split], False), (spec, settings, steps[:1] + steps[split:], True)]
    jobs += [(spec, fixed, largest, True)] if workspace is not None else []
    traced = run_side_by_side(_trace_steps, jobs)
    events, micro_starts, optimizer_starts = traced[0]
    if halves:
        joined = _halves(traced[0], traced[1], len(steps[0]))
        events, micro_starts, optimizer_starts = joined if joined is not None else _trace_steps(
            spec, settings, steps, False)  # the halves do not join (see there): the run in one process
    if len(shapes) % accumulation:  # a last, partial step: the Trainer never steps it, the tracer always does
        events = events[:optimizer_starts[-1]]
    step_reserved = None
    if workspace is not None:
        step_reserved = replay(traced[-1][0], workspace_bytes=workspace)[0].peak_reserved_bytes
    return events, tuple(micro_starts[1:]) + (len(events),), step_reserved


def _trace_steps(spec, settings: TrainSettings, steps: tuple, quiet: bool) -> tuple[list, list[int], list[int]]:
    """One process's trace of these optimizer steps from the build on: (events, the event count at each
    micro-batch's start, at each optimizer step's start). `quiet`: no progress lines (a child's would interleave
    with the parent's)."""
    from hf_memfit.estimator.kernel_staging import reduction_staging
    from hf_memfit.estimator.trace import progress, trace_step
    from hf_memfit.hardware import named_gpu
    from hf_memfit.models.depths import config_with_depths, real_depths

    depths = real_depths(spec)
    was, progress.disabled = progress.disabled, quiet or progress.disabled
    try:
        tracker = trace_step(config_with_depths(spec, depths), settings, depths, shapes=steps,
                             after_op=reduction_staging(named_gpu(settings.gpu))).tracker
    finally:
        progress.disabled = was
    # Event n happened at clock n + 1 (`StorageTracker.track`): a marker's clock is the events before it. The
    # events after the "end" marker free the model as the trace lets it go, which no run does.
    micro = [clock for clock, label in tracker.markers if " forward" in label]
    optimizer = [clock for clock, label in tracker.markers if label.endswith(" optimizer")]
    end = max(clock for clock, label in tracker.markers if label == "end")
    return tracker.events[:end], micro, optimizer


def _halves(first, second, first_micro_batches: int):
    """The run traced in two processes as one stream: `first` is its first steps; `second` its first step again,
    then the rest. After each optimizer step a run holds the same tensors (the weights and the optimizer's
    states; gradients are set to None and the step's temporaries freed), so the second process's events after
    its first step continue the first's. Its allocations are renumbered after the first's. None where that does
    not hold: the two first steps allocate differently, or what the first process holds at its end is not what
    the second held after its first step. A model may keep a tensor of its last forward between steps (Qwen2-VL's
    `rope_deltas`): the one the first process holds then stands for the one the second held, matched by size in
    the order they were made. (Frees that happen together, as a container of tensors goes, can come in another
    order in another process: the tensors' finalizers run in an order that hashes of addresses set.
    Allocations are numbered in the order they are made, which is the code's.)"""
    events, micro, optimizer = first
    other_events, other_micro, other_optimizer = second
    cut = other_micro[first_micro_batches]  # the second process's second step starts here
    if _allocations(other_events[:cut]) != _allocations(events[:cut]):
        return None
    held, other_held = _live(events), _live(other_events[:cut])
    sizes, other_sizes = dict(_allocations(events)), dict(_allocations(other_events[:cut]))
    kept, other_kept = sorted(held - other_held), sorted(other_held - held)  # tensors a step replaces
    if [sizes[i] for i in kept] != [other_sizes[i] for i in other_kept]:
        return None
    stands_for = dict(zip(other_kept, kept))
    made = len(sizes)
    made_before_cut = len(other_sizes)
    shift = made - made_before_cut

    def renumbered(index: int) -> int:  # an allocation of the second process after the cut gets a new number
        number = abs(index)
        number = number + shift if number > made_before_cut else stands_for.get(number, number)
        return number if index > 0 else -number

    offset = len(events) - cut
    joined = events + [(renumbered(index), nbytes) for index, nbytes in other_events[cut:]]
    return (joined, micro + [m + offset for m in other_micro[first_micro_batches:]],
            optimizer + [o + offset for o in other_optimizer[1:]])


def _allocations(events) -> list[tuple[int, int]]:
    """The allocations of a stream of events, in the order they were made."""
    return [event for event in events if event[0] > 0]


def _live(events) -> set[int]:
    """The allocations a stream of events leaves live."""
    live = set()
    for index, _ in events:
        if index > 0:
            live.add(index)
        else:
            live.discard(-index)
    return live


def workspace_bytes(settings: TrainSettings) -> int:
    """cuBLAS's workspaces, which it takes from the caching allocator (the estimate counts them as allocated)."""
    from hf_memfit.estimator.cuda_overhead import cublas_workspace_bytes
    from hf_memfit.hardware import named_gpu

    return cublas_workspace_bytes(named_gpu(settings.gpu))


def run_of_shapes(spec, settings: TrainSettings, *, min_seq_len: int, micro_batches: int = DEFAULT_MICRO_BATCHES,
                  seed: int = 0, image_sizes: tuple[int, ...] = (), needed: bool = True,
                  outside_allocator_bytes: int = 0) -> RunOfShapes:
    """Trace a run of varying shapes at full depth and replay it through the caching allocator (see the module).

    The shapes are `varying_shapes`' (as `check --vary-seq-len` draws them). `outside_allocator_bytes` (the CUDA
    context, NCCL buffers: the estimate's device total less its reserved) is added to the reserved peak for
    `device_total_bytes`.
    """
    from hf_memfit.errors import check_all
    from hf_memfit.estimator.trace import progress

    settings = settings.validate(spec)
    check_all(run_problems(settings, min_seq_len=min_seq_len, micro_batches=micro_batches))
    started = time.perf_counter()
    shapes = varying_shapes(settings, min_seq_len=min_seq_len, micro_batches=micro_batches, seed=seed,
                            image_sizes=image_sizes)
    progress.info("run of %d micro-batches (%d-%d tokens): tracing %s at full depth", micro_batches, min_seq_len,
                  settings.seq_len, spec.name)
    workspace = workspace_bytes(settings)
    events, ends, step_reserved = trace_run(spec, settings, shapes, workspace=workspace)
    progress.info("replaying %d allocator events", len(events))
    sim, reserved_after = replay(events, workspace_bytes=workspace, boundaries=ends)
    need = None
    if needed:
        progress.info("finding the smallest card the run fits on")
        need = needed_capacity(events, low=sim.peak_allocated_bytes, high=sim.peak_reserved_bytes,
                               workspace_bytes=workspace)
    return RunOfShapes(min_seq_len=min_seq_len, micro_batches=micro_batches, shapes=shapes,
                       peak_allocated_bytes=sim.peak_allocated_bytes, peak_reserved_bytes=sim.peak_reserved_bytes,
                       step_reserved_bytes=step_reserved, needed_bytes=need,
                       device_total_bytes=sim.peak_reserved_bytes + outside_allocator_bytes,
                       reserved_after=reserved_after, seconds=round(time.perf_counter() - started, 1),
                       reduction_staging_gpu=staging_gpu(settings))


def staging_gpu(settings: TrainSettings) -> str | None:
    """The named GPU whose reduction staging a replay of these settings holds (its SMs known), or None."""
    from hf_memfit.estimator.kernel_staging import reduction_staging
    from hf_memfit.hardware import named_gpu

    gpu = named_gpu(settings.gpu)
    return gpu.name if reduction_staging(gpu) is not None else None

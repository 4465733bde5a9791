"""Independent calibration traces run side by side in forked processes, one per free CPU.

A parametric calibration (`parametric.py`) traces the reduced-depth model at two depths, and a plan
asks for a few calibrations (checkpointing on and off, offloaded checkpoints): independent traces of
a few seconds each, on fake tensors, that share nothing while they run; where the machine has an idle
CPU (a busy one gains nothing from children taking turns), they run side by side. A forked child has
torch, transformers and the model spec imported, so it starts in milliseconds; it runs its job and
sends back the (small, picklable) result through a pipe. Results come back in the jobs' order, the
same as running them one after another: a trace reads no clock and no random numbers that decide a
byte. Where fork is unavailable, one CPU is free, or a child fails, the jobs run in this process.

Two more shapes of the same idea: `run_side_by_side` runs the first job here while the others run in
children (exact mode's two depth traces, which share no first-use cost worth waiting for), and
`run_beside` runs one job in a child while this process does something else it will need anyway
(`--seq-len max`: the fast-mode search in a child, the imports of exact mode's confirmation here).
"""

from __future__ import annotations

import gc
import math
import os
import pickle
import select
import signal
import time

from hf_memfit.estimator import worker_pool

# A child that has sent nothing for this long is taken to be stuck, and its job runs in this process.
# The longest calibration trace measured here took about a minute (docs/benchmarks.md, section 13).
CHILD_TIMEOUT_S = 900


def cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def idle_cpus() -> float:
    """CPUs idle beside this process now, where there are none, children would only take turns.

    From the kernel's per-CPU idle time (`/proc/stat`, the CPUs this process may run on), less the one this
    process will use; read again at most every `IDLE_SAMPLE_REUSE_S`. Over the time since the last reading, where
    that is between `IDLE_SAMPLE_S` and `IDLE_WINDOW_S`, with the CPU time this process and its finished children
    used in it counted as idle (it is this process's own work, done by the time they are asked for); else over a
    tenth of a second while this process sleeps. A plan asks once per step of its search: the sleeps were 0.3 s
    of a cold VLM plan. Not the load average: its minute-long memory still counts a process that finished
    seconds ago (a plan run right after another saw a busy machine on an idle one and traced one fit at a time).
    Where `/proc/stat` cannot be read (not Linux), the load average it is.
    """
    global _idle_sample
    now = time.monotonic()
    if _idle_sample is None or now - _idle_sample[0] > IDLE_SAMPLE_REUSE_S:
        _idle_sample = (now, _sample_idle_cpus())
    return _idle_sample[1]


IDLE_SAMPLE_S = 0.1
IDLE_SAMPLE_REUSE_S = 2.0
IDLE_WINDOW_S = 10.0  # a longer time since the last reading says little about now: a fresh sample instead
_idle_sample: tuple[float, float] | None = None  # (when, idle CPUs beside this process)
_last_reading: tuple | None = None  # `_reading()` when idle CPUs were last read


def mark_idle_baseline() -> None:
    """Read the CPUs' times now, so that the first `idle_cpus` reads them over the time since (a command calls
    this as it starts: its imports are its own work), without a sample's sleep."""
    global _last_reading
    try:
        _last_reading = _reading()
    except (OSError, ValueError):
        pass


def _reading() -> tuple[float, dict, float]:
    """(monotonic time, `_cpu_times()`, ticks this process, its finished children and its kept workers have run)."""
    own = os.times()
    seconds = own.user + own.system + own.children_user + own.children_system + worker_pool.cpu_seconds
    ticks = seconds * os.sysconf("SC_CLK_TCK")
    return time.monotonic(), _cpu_times(), ticks


def _sample_idle_cpus() -> float:
    global _last_reading
    try:
        before, after = _last_reading, _reading()
        if before is None or not IDLE_SAMPLE_S <= after[0] - before[0] <= IDLE_WINDOW_S:
            before = after
            time.sleep(IDLE_SAMPLE_S)
            after = _reading()
        _last_reading = after
    except (OSError, ValueError):
        try:
            return cpus() - os.getloadavg()[0]
        except OSError:
            return 0.0
    (_, first, own_first), (_, last, own_last) = before, after
    idle = sum(last[c][0] - first[c][0] for c in last if c in first)
    total = sum(last[c][1] - first[c][1] for c in last if c in first)
    if total <= 0:
        return 0.0
    idle = min(total, idle + max(0.0, own_last - own_first))  # this process's own work: free when it waits
    # To the nearest whole CPU: the kernel counts in ticks (1/100 s), about ten per CPU in a sample, and one tick
    # of anything (a kernel thread, the sample's own reads) read an idle 2-CPU machine as 0.9 idle CPUs beside
    # this process (1 sample in 40 on an idle machine here), and that step's fits were traced one at a time
    # (Qwen2.5-VL-7B's last step: 8 traces in a row). Less this process, which will run.
    return float(math.floor(len(last) * idle / total - 1 + 0.5))


def _cpu_times() -> dict[int, tuple[int, int]]:
    """Per CPU this process may run on: (idle + iowait ticks, all ticks) since boot, from `/proc/stat`."""
    allowed = os.sched_getaffinity(0)
    times = {}
    with open("/proc/stat") as stat:
        for line in stat:
            name, *fields = line.split()
            if not name.startswith("cpu") or name == "cpu":
                continue
            if int(name[3:]) in allowed:
                ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
                times[int(name[3:])] = (ticks[3] + ticks[4], sum(ticks))
    if not times:
        raise ValueError("no CPU lines in /proc/stat")
    return times


def slots() -> int:
    """How many jobs `run_jobs` runs at a time: the idle CPUs (this process waits while children run), at least
    two, where one is idle beside this process; else one."""
    idle = idle_cpus()
    return 1 if idle < 1 else max(2, int(idle))


def run_jobs(function, jobs: list, workers: int | None = None) -> list:
    """`[function(*job) for job in jobs]`, up to `workers` (default: the idle CPUs, and at least 2) at a
    time in forked children, where there is an idle CPU to run them; else one after another here."""
    global _ran_here
    at_once = slots()  # 1 where no CPU is idle beside this process, whatever `workers` asks
    if workers and at_once > 1:
        at_once = workers
    # The first job runs here: a process's first trace also pays for what torch and transformers set up on
    # first use (about 1.5 s of CPU), which children forked after it inherit instead of each paying it again.
    # Once a job has run here, every job of a later call can start in a child at once.
    first = 0 if _ran_here else 1
    if at_once < 2 or len(jobs) < 2 or not hasattr(os, "fork") or os.environ.get("HF_MEMFIT_NO_FORK"):
        results = [function(*job) for job in jobs]
        _ran_here = _ran_here or bool(jobs)
        return results
    results = [None] * len(jobs)
    launch = worker_pool.active.launcher(function, jobs) if worker_pool.active is not None else None
    beside = None
    if first:
        # The other CPUs start jobs at once while the first runs here, each of those children paying its own first
        # use, rather than stay idle through the first job; the jobs left after it start in children that
        # inherit it (a Gemma-3 fit's four depths: two rounds, where the first job alone, then two, then the
        # last alone made three).
        def beside():
            results[0] = function(*jobs[0])
    _ran_here = True
    gc.freeze()  # what this process holds now is left out of the children's collections (no copy-on-write churn)
    try:
        _run_forked(function, jobs, min(at_once - (beside is not None), len(jobs) - first), results, first=first,
                    meanwhile=beside, launch=launch)
    finally:
        gc.unfreeze()
    return results


_ran_here = False  # whether run_jobs has run a job in this process (it has then paid for first use)


def forking_pays() -> bool:
    """Whether a forked child would run beside this process: fork exists, is allowed, and a CPU is idle."""
    return hasattr(os, "fork") and not os.environ.get("HF_MEMFIT_NO_FORK") and idle_cpus() >= 1


def run_side_by_side(function, jobs: list, keys: list | None = None) -> list:
    """`[function(*job) for job in jobs]`, the first job here while the others run in forked children (as
    many at a time as the idle CPUs leave beside this process, at least one), where a CPU is idle; else one
    after another here. Results come back in the jobs' order; a child that fails has its job run here.

    A job whose `keys` entry was started ahead by `speculate` is not run again: its child's result is read."""
    ahead = [i for i, key in enumerate(keys or ()) if key in _speculated]
    if keys is not None and not ahead and _speculated:
        discard_speculations()  # a guess at other jobs: its child would only take the CPU these need
    if ahead:  # the others here, one after another: the child started ahead has the other CPU
        results = [None if i in ahead else function(*job) for i, job in enumerate(jobs)]
        for i in ahead:
            ok, value = _collect(_speculated.pop(keys[i]))
            results[i] = value if ok else function(*jobs[i])
        return results
    if len(jobs) < 2 or not forking_pays():
        return [function(*job) for job in jobs]
    results: list = [None] * len(jobs)
    workers = max(1, int(idle_cpus()) - 1)

    def here():
        results[0] = function(*jobs[0])

    gc.freeze()
    try:
        _run_forked(function, jobs, workers, results, first=1, meanwhile=here)
    finally:
        gc.unfreeze()
    return results


def run_beside(function, job: tuple, meanwhile):
    """`function(*job)` in a forked child while this process runs `meanwhile()`; returns the child's result.

    Where no CPU is idle (or fork is unavailable) `function(*job)` runs here and `meanwhile` does not run:
    it is for work this process would do later anyway (imports), worth doing early only beside the child.
    A child that fails has its job run here, so that a real error is raised as it would be without it.
    """
    if not forking_pays():
        return function(*job)
    results: list = [None]
    gc.freeze()
    try:
        _run_forked(function, [job], 1, results, first=0, meanwhile=meanwhile)
    finally:
        gc.unfreeze()
    return results[0]


# Jobs started ahead of the call that needs them (`speculate`): key -> (read end, pid) of the child running it.
_speculated: dict = {}


def speculate(function, job: tuple, key) -> bool:
    """Start `function(*job)` now in a forked child, for a later `run_side_by_side` whose job has this `key` to
    read instead of running it; where no CPU is idle (or fork is unavailable), nothing starts (False). What it
    starts is a guess: `discard_speculations` ends the children no call read."""
    if key in _speculated or not forking_pays():
        return key in _speculated
    gc.freeze()
    try:
        started = _start(function, job)
    finally:
        gc.unfreeze()
    if started is not None:
        _speculated[key] = started
    return started is not None


def speculated(key) -> bool:
    """Whether a child started by `speculate` is running (or has run) the job of this key."""
    return key in _speculated


def discard_speculations() -> None:
    """End the children `speculate` started that no call read (their guess was not asked for)."""
    while _speculated:
        fd, pid = _speculated.popitem()[1]
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(fd)


def _collect(started: tuple[int, int]) -> tuple[bool, object]:
    """(ok, result) of a child `_start` started, once it has written it and exited."""
    child = _Child(*started)
    while (done := child.read()) is None:
        pass
    return done


def _reaped(pid: int, data: bytearray) -> tuple[bool, object]:
    """(ok, result) of a child that has closed its pipe, reaped; (False, None) where it failed, or died
    mid-write: the caller then runs its job itself, so that a real error is raised as it would be without it."""
    _, status = os.waitpid(pid, 0)
    try:
        return pickle.loads(bytes(data)) if status == 0 else (False, None)
    except Exception:  # noqa: BLE001 - a child that died mid-write
        return False, None


def _run_forked(function, jobs: list, workers: int, results: list, first: int, meanwhile=None, launch=None) -> None:
    """Run `jobs[first:]` beside this process, `workers` at a time, into `results`; `meanwhile()` runs here once
    the first are started (those still running if it raises are abandoned), and once it is done its CPU takes a
    job too: `workers + 1` at a time. `launch(index)` starts a job and returns its handle (`_Child`), or None where
    it cannot start; by default a child forked for it (`worker_pool` sends it to a kept worker instead). A job that
    cannot start, fails, or sends nothing for `CHILD_TIMEOUT_S` runs here afterwards, so that a real error is
    raised as it would be without children."""
    launch = launch or (lambda index: _Child.start(function, jobs[index]))
    failed = []
    running: dict[int, tuple[int, object, float]] = {}  # read end -> (job index, handle, when started)
    pending = list(range(first, len(jobs)))
    while pending or running or meanwhile is not None:
        while pending and len(running) < workers:
            index = pending.pop(0)
            handle = launch(index)
            if handle is None:
                failed.append(index)
            else:
                running[handle.fd] = (index, handle, time.monotonic())
        if meanwhile is not None:
            work, meanwhile = meanwhile, None
            try:
                work()
            except BaseException:
                for _, handle, _ in running.values():
                    handle.abandon()
                raise
            workers += 1  # this process now only waits: its CPU is free for another job
            continue
        if not running:  # every job left failed to start: they run here
            break
        ready, _, _ = select.select(list(running), [], [], 30.0)
        now = time.monotonic()
        for fd, (index, handle, started) in list(running.items()):
            if fd in ready:
                done = handle.read()
                if done is None:
                    continue
                del running[fd]
                ok, value = done
                if ok:
                    results[index] = value
                else:
                    failed.append(index)
            elif now - started > CHILD_TIMEOUT_S:  # stuck (a lock held at fork): here instead
                del running[fd]
                handle.abandon()
                failed.append(index)
    for index in sorted(failed):  # here, so that a real error is raised as it would be without children
        results[index] = function(*jobs[index])


class _Child:
    """A child forked for one job (`_start`), as `_run_forked` reads it: its result comes whole at end of file."""

    def __init__(self, fd: int, pid: int):
        self.fd, self.pid, self.data = fd, pid, bytearray()

    @classmethod
    def start(cls, function, job) -> "_Child | None":
        started = _start(function, job)
        return None if started is None else cls(*started)

    def read(self) -> tuple[bool, object] | None:
        """What is ready: None while the result is still coming, else (ok, result) with the child reaped."""
        chunk = os.read(self.fd, 1 << 20)
        if chunk:
            self.data += chunk
            return None
        os.close(self.fd)
        return _reaped(self.pid, self.data)

    def abandon(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        os.close(self.fd)


def _start(function, job) -> tuple[int, int] | None:
    """Fork a child that runs `function(*job)` and writes (ok, result) pickled to a pipe: (read end, pid)."""
    read, write = os.pipe()
    pid = worker_pool.fork(read, write)
    if pid is None:
        return None
    if pid:  # parent
        os.close(write)
        return read, pid
    code = 1
    try:  # child: never returns into the parent's code
        os.close(read)
        worker_pool.set_up_child()
        try:
            payload = pickle.dumps((True, function(*job)), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:  # noqa: BLE001 - reported by running the job again in the parent
            payload = pickle.dumps((False, None))
        worker_pool.write_all(write, payload)
        os.close(write)
        code = 0
    finally:
        os._exit(code)


def import_for_traces(model_type: str | None = None) -> None:
    """Import what an exact-mode trace imports on its way: torch with its fake tensors, transformers' modeling
    code, the model family's module, and DeepSpeed's sequence-parallel module (Ulysses, TiledMLP) where
    installed. Seconds of imports, done early only beside a child's work. (Not the Trainer's optimizer table:
    a trace of PyTorch's AdamW does without it, `step.needs_trainer_table`.)"""
    import importlib
    import importlib.util

    names = ["hf_memfit.estimator.trace", "transformers.modeling_utils"]
    if model_type:
        from transformers.models.auto.configuration_auto import model_type_to_module_name

        module = model_type_to_module_name(model_type)
        names.append(f"transformers.models.{module}.modeling_{module}")
    if importlib.util.find_spec("deepspeed") is not None:
        names.append("deepspeed.runtime.sequence_parallel.ulysses_sp")
    from hf_memfit.estimator.step_levers import deepspeed_import  # DeepSpeed's log on stderr, not in --json

    for name in names:
        try:
            deepspeed_import(name) if name.startswith("deepspeed") else importlib.import_module(name)
        except Exception:  # noqa: BLE001 - only a head start: the trace that needs it reports it
            pass

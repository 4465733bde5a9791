"""Forked workers that outlive one `forked.run_jobs` call, so that what a trace caches stays warm between jobs.

A trace's fake tensor mode caches each op's output by its arguments' shapes (`trace_mode.TraceFakeTensorMode`); a
miss costs about ten hits. `forked.run_jobs` forks a child per job, which starts with the parent's cache and loses
what it adds. But a fit's traces (2-4 depths of the same layers) and the planner's fits of one model (with and
without checkpointing: the same forward) repeat most of their ops: a worker that traced one hits where a fresh
child missed. Within `keep_workers()` (the planner's search, an estimate), `run_jobs` sends its jobs to such
workers instead. Jobs and results go through pipes as length-prefixed pickles: the job's function by reference (a
module-level function), its arguments by value.
`forked._run_forked` runs both kinds of job; one that does not pickle, fails or is stuck runs in the parent.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import signal
import sys


class _Worker:
    """A forked child that runs jobs sent to it one after another, until its pipe closes. Jobs and results go as
    length-prefixed pickles: the job's function by reference (a module-level function), its arguments by value."""

    def __init__(self, pid: int, jobs_fd: int, results_fd: int):
        self.pid, self.jobs_fd, self.results_fd = pid, jobs_fd, results_fd
        self.received = bytearray()

    @classmethod
    def start(cls, others: list["_Worker"]) -> "_Worker | None":
        jobs_read, jobs_write = os.pipe()
        results_read, results_write = os.pipe()
        pid = fork(jobs_read, jobs_write, results_read, results_write)
        if pid is None:
            return None
        if pid:
            os.close(jobs_read)
            os.close(results_write)
            return cls(pid, jobs_write, results_read)
        try:  # child: never returns into the parent's code
            os.close(jobs_write)
            os.close(results_read)
            for other in others:  # another worker's pipes: its end of file must not wait for this process
                os.close(other.jobs_fd)
                os.close(other.results_fd)
            set_up_child()
            _serve(jobs_read, results_write)
        finally:
            os._exit(0)

    def send(self, function, job) -> bool | None:
        """Send a job: True; False where it does not pickle, None where this worker has died while idle (the job
        then runs in the parent)."""
        try:
            payload = pickle.dumps((function, job), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - an argument that does not pickle
            return False
        try:
            _write_message(self.jobs_fd, payload)
        except OSError:  # a broken pipe: nobody reads it
            return None
        self.received = bytearray()
        return True

    def receive(self) -> bool | None:
        """Read what is ready: True once a whole result is in, False while it is not, None at end of file."""
        chunk = os.read(self.results_fd, 1 << 20)
        if not chunk:
            return None
        self.received += chunk
        return len(self.received) >= 8 and len(self.received) >= 8 + int.from_bytes(self.received[:8], "little")

    def result(self) -> tuple[bool, object, float]:
        return pickle.loads(bytes(self.received[8:]))

    def stop(self) -> None:
        os.close(self.jobs_fd)
        os.close(self.results_fd)
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)


def write_all(fd: int, data: bytes) -> None:
    """Write all of `data` to a pipe (a write may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_message(fd: int, payload: bytes) -> None:
    write_all(fd, len(payload).to_bytes(8, "little") + payload)


def _read_exactly(fd: int, count: int) -> bytes | None:
    data = bytearray()
    while len(data) < count:
        chunk = os.read(fd, count - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _serve(jobs_fd: int, results_fd: int) -> None:
    """A worker's loop: each job's (ok, result, CPU seconds) back, until the pipe closes or a job fails."""
    while (header := _read_exactly(jobs_fd, 8)) is not None:
        message = _read_exactly(jobs_fd, int.from_bytes(header, "little"))
        if message is None:
            return
        before = os.times()
        try:
            function, job = pickle.loads(message)
            value = (True, function(*job))
        except BaseException:  # noqa: BLE001 - reported by running the job again in the parent
            value = (False, None)
        after = os.times()
        seconds = after.user + after.system - before.user - before.system
        _write_message(results_fd, pickle.dumps(value + (seconds,), protocol=pickle.HIGHEST_PROTOCOL))
        if not value[0]:
            return


class _Pool:
    """The workers `keep_workers` keeps: `launcher` starts `forked.run_jobs`' jobs on them."""

    def __init__(self):
        self.workers: list[_Worker] = []
        self.idle: list[_Worker] = []

    def launcher(self, function, jobs: list):
        """`forked._run_forked`'s `launch`: job `index` sent to an idle worker (one forked now where none is idle);
        None where it cannot start (no fork, the job does not pickle, the worker died while idle), and it then
        runs in the parent."""
        def launch(index: int) -> _Sent | None:
            worker = self.idle.pop() if self.idle else self._start()
            if worker is None:
                return None
            sent = worker.send(function, jobs[index])
            if sent is False:
                self.idle.append(worker)
            elif sent is None:  # died while idle: a new worker takes its place next time
                self.drop(worker)
            if not sent:
                return None
            return _Sent(self, worker)
        return launch

    def _start(self) -> _Worker | None:
        worker = _Worker.start(self.workers)  # under `run_jobs`' gc.freeze, as every child it forks
        if worker is not None:
            self.workers.append(worker)
        return worker

    def drop(self, worker: _Worker) -> None:
        self.workers.remove(worker)
        worker.stop()

    def close(self) -> None:
        for worker in list(self.workers):
            self.drop(worker)


class _Sent:
    """A job sent to a kept worker, as `forked._run_forked` reads it (its `_Child` counterpart)."""

    def __init__(self, pool: _Pool, worker: _Worker):
        self.pool, self.worker, self.fd = pool, worker, worker.results_fd

    def read(self) -> tuple[bool, object] | None:
        """What is ready: None while the result is still coming, else (ok, result). The worker is idle again, or,
        where its job failed (it exits then) or it died, dropped."""
        global cpu_seconds
        done = self.worker.receive()
        if done is False:
            return None
        ok, value, seconds = self.worker.result() if done else (False, None, 0.0)
        cpu_seconds += seconds
        if ok:
            self.pool.idle.append(self.worker)
        else:
            self.pool.drop(self.worker)
        return ok, value

    def abandon(self) -> None:
        self.pool.drop(self.worker)


active: _Pool | None = None  # the workers `keep_workers` keeps, while it does
cpu_seconds = 0.0  # CPU time the pool's workers spent on jobs: this process's own work (`forked._reading`)


@contextlib.contextmanager
def keep_workers():
    """Within it, `forked.run_jobs` sends its jobs to workers that stay up until it ends (see the module's
    doc). Nested, the outer one's workers serve."""
    global active
    if active is not None:
        yield
        return
    active = _Pool()
    try:
        yield
    finally:
        pool, active = active, None
        pool.close()


def fork(*fds: int) -> int | None:
    """`os.fork()` with stdout and stderr flushed first (so nothing buffered is written twice); None where it fails,
    with `fds` (the pipes made for the child) closed. The child calls `set_up_child` inside its own try block."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        return os.fork()
    except OSError:
        for fd in fds:
            os.close(fd)
        return None


def set_up_child() -> None:
    """In a forked child (a worker, or a child per job), before its first job.

    The parent's kept workers are not this process's to use: a job that runs jobs of its own forks its own children.
    And torch runs one intra-op thread: GNU OpenMP is not fork-safe, so once the parent has run a parallel region (a
    real tensor op: a VLM's image grid, the first trace run in the parent), the child's first parallel op waits forever
    for the parent's worker threads, which fork did not copy. One thread never enters a parallel region."""
    global active
    active = None
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def keeps_workers(function):
    """`function` run inside `keep_workers()` (the planner's search, an estimate)."""
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        with keep_workers():
            return function(*args, **kwargs)
    return wrapped

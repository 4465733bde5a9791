"""Workers kept for a planner's search (`estimator/worker_pool.py`): their fake tensor caches stay warm from one
job to the next, and what they return is what a child per job, or this process, returns."""

import json
import os

import pytest
from conftest import TINY_QWEN3

from hf_memfit.estimator import forked, parametric, worker_pool
from hf_memfit.models.spec import ModelSpec
from hf_memfit.settings import TrainSettings


@pytest.fixture
def two_idle_cpus(monkeypatch):
    """As on an idle 2-CPU machine, whatever the load here, with the process's first use already paid."""
    monkeypatch.delenv("HF_MEMFIT_NO_FORK", raising=False)
    monkeypatch.setattr(forked, "idle_cpus", lambda: 2.0)
    monkeypatch.setattr(forked, "_ran_here", True)


# Jobs are sent to a worker by reference: module-level functions.

def _fake_matmul(n: int) -> tuple[int, int]:
    """(the process, how many fake-mode cache misses a fake n x n matmul took in it)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    before = FakeTensorMode.cache_misses
    with FakeTensorMode():
        a = torch.empty(n, n)
        a @ a
    return os.getpid(), FakeTensorMode.cache_misses - before


def _fails_at(value: int, bad: int) -> int:
    if value == bad:
        raise ValueError(f"job {value} failed")
    return os.getpid()


def _has_a_pool() -> bool:
    return worker_pool.active is not None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_workers_kept_from_one_call_to_the_next_miss_nothing_the_second_time(two_idle_cpus):
    """A child per job starts from this process's cache and misses again; kept workers miss once."""
    jobs = [(24,), (24,)]
    forked.run_jobs(_fake_matmul, jobs)
    assert all(misses > 0 for _, misses in forked.run_jobs(_fake_matmul, jobs))  # a fresh child each time
    with worker_pool.keep_workers():
        first = forked.run_jobs(_fake_matmul, jobs)
        second = forked.run_jobs(_fake_matmul, jobs)
        workers = [worker.pid for worker in worker_pool.active.workers]
    assert sorted(pid for pid, _ in first) == sorted(workers) and len(set(workers)) == 2
    assert os.getpid() not in workers
    assert all(misses > 0 for _, misses in first)
    assert {pid for pid, _ in second} <= set(workers) and all(misses == 0 for _, misses in second)
    assert worker_pool.active is None and not any(_alive(pid) for pid in workers)  # reaped on the way out


def test_a_failed_job_raises_its_own_error_here_and_its_worker_is_dropped(two_idle_cpus):
    with worker_pool.keep_workers():
        assert len(set(forked.run_jobs(_fails_at, [(1, 0), (2, 0)]))) == 2
        workers = [worker.pid for worker in worker_pool.active.workers]
        with pytest.raises(ValueError, match="job 2 failed"):
            forked.run_jobs(_fails_at, [(1, 2), (2, 2)])
        left = [worker.pid for worker in worker_pool.active.workers]
        assert len(left) == 1 and set(left) < set(workers)
        assert sum(_alive(pid) for pid in workers) == 1  # the worker that failed has exited and is reaped
        assert set(forked.run_jobs(_fails_at, [(1, 0), (2, 0)])) - set(left)  # a new worker takes its place


def test_jobs_that_do_not_pickle_run_here_and_workers_use_no_pool_of_their_own(two_idle_cpus):
    here = os.getpid()
    with worker_pool.keep_workers():
        assert forked.run_jobs(lambda value: os.getpid(), [(1,), (2,)]) == [here, here]  # a lambda: by value only
        assert forked.run_jobs(_has_a_pool, [(), ()]) == [False, False]  # a worker's jobs fork their own children
        assert _has_a_pool()
    assert not _has_a_pool()


def test_fits_traced_on_kept_workers_are_the_fits_traced_here(tmp_path, monkeypatch, two_idle_cpus):
    """The same fits, byte for byte, from kept workers (warm from the job before) and from this process."""
    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path))
    spec = ModelSpec.from_config("qwen3", TINY_QWEN3)
    settings = TrainSettings(batch_size=3, seq_len=320, device="cuda", precision="bf16-mixed",
                             gradient_checkpointing=True).validate(spec)
    many = [settings, settings.replace(gradient_checkpointing=False)]
    with worker_pool.keep_workers():  # four traces (two depths each) on two workers: each worker's second is warm
        pooled = parametric.calibrate_many(spec, many)
    monkeypatch.setenv("HF_MEMFIT_NO_FORK", "1")
    here = parametric.calibrate_many(spec, many)
    assert json.dumps(pooled, sort_keys=True) == json.dumps(here, sort_keys=True)
    assert pooled[0]["candidates"] != pooled[1]["candidates"]


def test_a_worker_that_died_while_idle_is_replaced_and_its_job_still_runs(two_idle_cpus):
    import signal
    import time

    with worker_pool.keep_workers():
        dead = forked.run_jobs(_fails_at, [(1, 0), (2, 0)])[0]
        os.kill(dead, signal.SIGKILL)  # between two calls (out of memory, say)
        time.sleep(0.2)
        after = forked.run_jobs(_fails_at, [(1, 0), (2, 0)])
        workers = [worker.pid for worker in worker_pool.active.workers]
        assert dead not in after and dead not in workers and not _alive(dead)  # dropped and reaped
        assert set(after) <= set(workers) | {os.getpid()}  # its job ran here or on the worker forked in its place
        assert len(set(forked.run_jobs(_fails_at, [(1, 0), (2, 0)])) & set(workers)) >= 1

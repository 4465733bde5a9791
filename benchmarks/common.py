"""Helpers shared by the benchmark scripts (not part of the package, not a test).

`run_forked(work)` runs `work(emit)` in a forked child process and returns
everything the child emitted, merged into one dict, plus how the child ended.
The parent is expected to have imported the heavy libraries (torch,
transformers, peft, ...) but to have run no tensor op, so every child starts
from a clean heap without paying the imports again, and a child that dies
(segfault, abort, out of memory) costs only its own work.
"""

from __future__ import annotations

import queue as queue_module
import traceback

from hf_memfit.estimator.measure import allocator_peak


def run_forked(work, *, timeout_s: float | None = None) -> tuple[dict, str | None]:
    """Run `work(emit)` in a forked child; `emit(dict)` sends partial results to the parent as they are made.

    Returns `(result, crash)`: the union of the emitted dicts (later keys win) and
    None, or a text saying how the child died (exit code or signal, or the
    timeout). An exception inside `work` is caught in the child and reported as
    `result["row_error"]` / `result["traceback"]`, not as a crash.
    """
    import multiprocessing as mp
    import time

    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child():
        try:
            work(q.put)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            q.put({"row_error": f"{type(exc).__name__}: {exc}"[:300], "traceback": traceback.format_exc()[-2000:]})
        q.put(None)
        q.close()
        q.join_thread()

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    result: dict = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    timed_out = False
    while True:
        try:
            item = q.get(timeout=1.0)
        except queue_module.Empty:
            if deadline is not None and time.monotonic() > deadline:
                proc.kill()
                timed_out = True
            if not proc.is_alive():
                while True:  # drain anything left, then record how the child ended
                    try:
                        item = q.get(timeout=0.5)
                    except queue_module.Empty:
                        break
                    if item is not None:
                        result.update(item)
                break
            continue
        if item is None:
            break
        result.update(item)
    proc.join()
    crash = None
    if timed_out:
        crash = f"killed after the {timeout_s:.0f} s timeout"
    elif proc.exitcode:
        crash = f"process died with exit code {proc.exitcode}" + (
            f" (signal {-proc.exitcode})" if proc.exitcode < 0 else "")
    return result, crash


# A size nothing else allocates: a benchmark allocates and frees one buffer of it where its training steps begin.
MARKER_BYTES = 7_777_777


def peak_after_marker(prof) -> int:
    """The allocator's peak in a profiler run, counted from the MARKER_BYTES allocation on (bytes live before
    the marker, model creation and wrapping, still count; only maxima after it are taken)."""
    return allocator_peak(prof, from_marker_bytes=MARKER_BYTES)

"""Pinned host memory: what CUDA's caching host allocator takes for each offloaded tensor, and how a fit carries it.

Offloaded activation checkpoints (transformers' `save_on_cpu(pin_memory=True)`) and TRL's activation offloading
copy tensors to pinned host memory, which the host allocator rounds up to a power of two per allocation. So a
step's host bytes are a staircase in the batch and the length, not the line or polynomial that a fit's device
bytes follow. The fitted fast modes (`parametric.py`, `batch_fit.py`) therefore fit each offloaded tensor's own
size, which is a polynomial in the shape (a layer's input is b*s*hidden), count the tensors of each size, and round
each when they evaluate, as the allocator does and as exact mode does tensor by tensor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable


def pinned_host_bytes(nbytes: int) -> int:
    """What a pinned host allocation takes: CachingHostAllocator rounds it up to a power of two
    (ATen/core/CachingHostAllocator.h, `PowerOf2Ceil`, below `pinned_max_round_threshold`, unlimited by default)."""
    return 1 << max(0, (nbytes - 1).bit_length()) if nbytes > 0 else 0


class HostStash:
    """Pinned host memory held by offloaded tensors: the live bytes, their peak, and each tensor held at the peak (in
    the order they were saved), which the fits read.

    A tensor is held as (the size its offloading compares with `min_bytes`, the size of its host copy, `min_bytes`):
    TRL keeps a saved tensor under 1 KiB on the GPU, so at a small batch a tensor may take no host memory that a
    larger batch offloads. Such a tensor is held at no bytes, and the fits see it grow past the threshold.
    """

    def __init__(self):
        self.live = self.peak = 0
        self._held: dict[int, tuple[tuple[int, int, int], int]] = {}  # token -> (tensor, bytes it takes)
        self._next = 0
        self.peak_tensors: list[tuple[int, int, int]] = []

    def add(self, nbytes: int, compared: int | None = None, min_bytes: int = 0) -> int:
        """Hold a host copy of `nbytes`, or nothing where `compared` (by default `nbytes`) is under `min_bytes`;
        returns the token `remove` takes."""
        compared = nbytes if compared is None else compared
        taken = pinned_host_bytes(nbytes) if compared >= min_bytes else 0
        token, self._next = self._next, self._next + 1
        self._held[token] = ((compared, nbytes, min_bytes), taken)
        self.live += taken
        if self.live >= self.peak:  # at a tie too: a tensor held at no bytes is still one the fits must see
            self.peak, self.peak_tensors = self.live, [tensor for tensor, _ in self._held.values()]
        return token

    def remove(self, token: int) -> None:
        self.live -= self._held.pop(token)[1]

    def restart_peak(self) -> None:
        """A new step: its peak starts from what is held now."""
        self.peak, self.peak_tensors = self.live, [tensor for tensor, _ in self._held.values()]


def fit_offloaded_tensors(per_depth: list[list[list[tuple]]], steps: list[float],
                          solve: Callable[[tuple[int, ...]], list[float]]) -> list | None:
    """The tensors held at the host peak as [compared size, host size, threshold, count] classes at the real depth,
    each size a polynomial's coefficients.

    `per_depth`: for each traced depth, for each fit point, the tensors `HostStash.peak_tensors` recorded. The same
    step at another shape saves the same tensors in the same order, so a tensor is what it was at each point;
    tensors alike at every point are one class, fitted once by `solve`. A class's count is extrapolated to the real
    depth as exact mode extrapolates its bytes. None where the points do not hold as many tensors, or a count would
    not be a whole number: the caller then fits the rounded sums.
    """
    counts: dict[tuple, list[int]] = {}
    for at, points in enumerate(per_depth):
        if len({len(tensors) for tensors in points}) != 1:
            return None
        for tensor, n in Counter(zip(*(map(tuple, tensors) for tensors in points))).items():
            counts.setdefault(tensor, [0] * len(per_depth))[at] = n
    classes = []
    for tensor, by_depth in counts.items():
        count = by_depth[0] + sum(step * (grown - by_depth[0]) for step, grown in zip(steps, by_depth[1:]))
        if count < -1e-6 or abs(count - round(count)) > 1e-6 or len({m for _, _, m in tensor}) != 1:
            return None
        if round(count):
            compared, host = tuple(c for c, _, _ in tensor), tuple(h for _, h, _ in tensor)
            host_fit = solve(host)
            classes.append([host_fit if compared == host else solve(compared), host_fit, tensor[0][2],
                            int(round(count))])
    return classes


def offloaded_bytes(classes: list, size_at: Callable[[list[float]], int]) -> int:
    """Host bytes of the fitted classes at a shape: each tensor's size there (`size_at` of its coefficients),
    rounded up as the allocator rounds it, or nothing where it stays under its threshold."""
    return sum(count * pinned_host_bytes(max(0, size_at(host))) for compared, host, min_bytes, count in classes
               if size_at(compared) >= min_bytes)

"""What a real GPU adds beyond the tensors a CPU trace sees.

A fake-tensor trace on the CPU counts the tensors the model makes. On a GPU,
PyTorch's caching allocator rounds and packs those tensors into segments, the
CUDA context and cuBLAS workspaces take their share, and the optimizer's step
makes temporaries that depend on which code path torch picks on that device.
Every constant below cites where it comes from; the facts are collected, with
sources, in shared/CUDA_MEMORY_FACTS.md. None were measured here (no GPU).

Pure functions and one simulator class; nothing imports torch.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

from hf_memfit.hardware import GPU
from hf_memfit.units import CUDA_BLOCK_BYTES, GiB, MiB, cuda_block_bytes

# --- CUDA context -------------------------------------------------------------
# Outside memory_allocated and memory_reserved, but counted by nvidia-smi and
# taken out of the card's total. Lazy module loading is the default since torch
# 1.13 (pytorch#86509) and CUDA 12.2, so the context starts small and grows as
# kernels load:
#   bare context 0.25-0.45 GiB: 287 MB (pytorch#86509), 426 MiB (RTX 6000 Ada,
#     torch 2.10/cu130), 256 MiB (RTX 3090, torch 2.7/cu128);
#   about +0.5 GiB once a training step has loaded its kernels;
#   0.47-0.92 GiB on A100 (stas00 ml-engineering), and one single-GPU training
#     run showed 0.95 GiB in use outside PyTorch's reserved memory.
# We take the upper half of the bare range (newer CUDA sits there) plus the
# kernel images: 0.4 + 0.5 = 0.9 GiB, which lands inside both training-time
# observations. The spread in the reports tracks the CUDA version more than the
# architecture, and no per-compute-capability numbers are trustworthy enough to
# split on, so one value serves every GPU. Before lazy loading it was 0.7-1.7 GB
# (pytorch#55277); we do not model torch < 1.13.
CUDA_CONTEXT_BARE_BYTES = int(0.4 * GiB)
CUDA_KERNEL_IMAGES_BYTES = int(0.5 * GiB)

# --- cuBLAS workspace ---------------------------------------------------------
# aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize():
#   "/* :4096:2:16:8 default, 32MiB for Hopper and Blackwell */"
#   use32mb = major == 9 || major == 10 || major == 12
#   default_size = use32mb ? 4096 * 8 * 1024 : 4096 * 1024 * 2 + 16 * 1024 * 8
# The workspace comes from the caching allocator (getNewWorkspace), so it counts
# as allocated, and it lives as long as the process. There is one per (handle,
# stream); the forward runs on the main thread and backward on the autograd
# thread, each with its own handle, hence two. cuBLASLt shares the cuBLAS
# workspace by default (TORCH_CUBLASLT_UNIFIED_WORKSPACE), so no third buffer.
CUBLAS_WORKSPACE_BYTES_SM9X_PLUS = 4096 * 8 * 1024  # 32 MiB
CUBLAS_WORKSPACE_BYTES_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8  # 8,519,680 B
CUBLAS_HANDLES_PER_TRAINING_PROCESS = 2  # main thread (forward) + autograd thread (backward)

# --- Caching allocator (c10/cuda/CUDACachingAllocator.cpp, default settings) --
K_MIN_BLOCK_SIZE = CUDA_BLOCK_BYTES  # kMinBlockSize: "all sizes are rounded to at least 512 bytes"
K_SMALL_SIZE = 1 * MiB  # kSmallSize: "largest 'small' allocation is 1 MiB"
K_SMALL_BUFFER = 2 * MiB  # kSmallBuffer: "'small' allocations are packed in 2 MiB blocks"
K_LARGE_BUFFER = 20 * MiB  # kLargeBuffer: "'large' allocations may be packed in 20 MiB blocks"
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: "allocations between 1 and 10 MiB may use kLargeBuffer"
K_ROUND_LARGE = 2 * MiB  # kRoundLarge: "round up large allocations to 2 MiB"

# Allocator slack: what the caching allocator needs beyond the allocated peak.
# One model serves both estimator modes, so that they agree: fast mode cannot
# replay an allocation sequence, and exact mode's trace is of 2-3 layers, whose
# replay is not the real depth's (benchmarks/allocator.py: gpt2-large's
# unlimited-device gap is 476 MiB at 2 layers and 2344 MiB at its 36). The
# slack is a share of the activations and temporaries live at the peak: the
# weights, gradients and optimizer states are allocated once, in the same sizes
# every step, and reuse their blocks; what fragments is the churn of transient
# tensors of many sizes (forward activations freed in backward, gradients made
# where they were, the loss's vocabulary-sized buffers).
# The share comes from replaying full-depth traces of 18 configurations through
# `CachingAllocatorSimulator` and finding, for each, the smallest capacity the
# step runs in (the allocator empties its cache and retries before an OOM, as
# torch does): that capacity minus the allocated peak, over the activations and
# temporaries at the peak, had quartiles 0.062 / 0.103 / 0.251 (range 0.020 to
# 0.857; `python benchmarks/allocator.py`, docs/benchmarks.md). We take the upper
# quartile: an under-predicted slack is an OOM.
ALLOCATOR_FRAGMENTATION_RATIO = 0.25
# With PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (torch >= 2.1) each pool
# is one virtual segment per stream that maps and unmaps physical pages as it
# grows and shrinks, so freed memory is reusable for any size and fragmentation
# mostly disappears: torchtune#1185 measured 16.39 GiB reserved without it and
# 10.83 GiB with it on the same QLoRA 8B run. What is left is the partly used
# last page of each pool's segment: 2 MiB pages for the small pool and 20 MiB
# (kLargeBuffer) for the large one (CUDACachingAllocator.cpp, ExpandableSegment).
EXPANDABLE_SEGMENTS_SLACK_BYTES = K_SMALL_BUFFER + K_LARGE_BUFFER


def cuda_context_bytes(gpu: GPU | None) -> int:
    """CUDA context with a training step's kernels loaded (outside torch's counters).

    About 0.9 GiB; see the constants above for the 0.25-0.95 GiB evidence. The
    `gpu` argument is accepted so callers need not change if per-architecture
    figures become trustworthy; today every GPU gets the same value.
    """
    del gpu  # no per-architecture evidence strong enough to split on
    return CUDA_CONTEXT_BARE_BYTES + CUDA_KERNEL_IMAGES_BYTES


def cublas_workspace_bytes(gpu: GPU | None, handles: int = CUBLAS_HANDLES_PER_TRAINING_PROCESS) -> int:
    """cuBLAS workspaces of a training process: `handles` x (32 MiB on sm9x/10x/12x, else 8,519,680 B).

    Counts as allocated (it comes from the caching allocator). An unknown GPU
    gets the larger Hopper/Blackwell size, to err on the safe side.
    """
    if gpu is None or gpu.compute_capability[0] in (9, 10, 12):
        each = CUBLAS_WORKSPACE_BYTES_SM9X_PLUS
    else:
        each = CUBLAS_WORKSPACE_BYTES_DEFAULT
    return handles * each


def round_allocation(nbytes: int) -> int:
    """The caching allocator's block size for a request: a multiple of 512 bytes, at least 512.

    Mirrors `round_size()` with the default `roundup_power2_divisions` (off).
    """
    if nbytes < 0:
        raise ValueError(f"allocation size must be non-negative, got {nbytes}")
    return cuda_block_bytes(nbytes)


def segment_bytes(nbytes: int) -> int:
    """Size of the segment (cudaMalloc) a request gets when nothing cached fits.

    Mirrors `get_allocation_size()`: 2 MiB for requests up to 1 MiB, 20 MiB for
    1-10 MiB, and the rounded size rounded up to 2 MiB from 10 MiB on.
    """
    size = round_allocation(nbytes)
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


def allocator_slack_bytes(transient_bytes: int, *, expandable_segments: bool = False) -> int:
    """Reserved memory the caching allocator needs beyond the allocated peak.

    `transient_bytes` is the activations plus temporaries live at the peak;
    both estimator modes pass their own figure for it, and nothing else, so
    they can differ only by what they disagree on there. See
    ALLOCATOR_FRAGMENTATION_RATIO for the evidence.
    """
    if expandable_segments:
        return EXPANDABLE_SEGMENTS_SLACK_BYTES
    return int(ALLOCATOR_FRAGMENTATION_RATIO * max(0, transient_bytes))


# --- The allocator simulator ----------------------------------------------------


class SimulatedOutOfMemoryError(RuntimeError):
    """A `malloc` that would raise torch.OutOfMemoryError on a GPU of the given capacity."""

    def __init__(self, requested: int, allocated: int, reserved: int, capacity: int):
        self.requested, self.allocated = requested, allocated
        self.reserved, self.capacity = reserved, capacity
        super().__init__(f"simulated CUDA out of memory: tried to allocate {requested} bytes with "
                         f"{allocated} allocated and {reserved} reserved of a {capacity}-byte capacity")


@dataclass(eq=False, slots=True)
class _Block:
    """A contiguous piece of one segment; prev/next link the pieces of that segment."""

    addr: int
    size: int
    small: bool
    allocated: bool = False
    requested: int = 0
    prev: _Block | None = None
    next: _Block | None = None


class CachingAllocatorSimulator:
    """Pure-Python replay of PyTorch's CUDACachingAllocator (default settings, one stream).

    Follows c10/cuda/CUDACachingAllocator.cpp with expandable_segments off:
    - requests are rounded to 512 B (`round_allocation`); those <= 1 MiB go to the
      small pool, the rest to the large pool;
    - `get_free_block`: best fit, the smallest cached free block of the pool that
      is big enough, lowest address first among equals;
    - otherwise a new segment (`segment_bytes`): 2 MiB, 20 MiB, or the size
      rounded up to 2 MiB;
    - `should_split`: a small block is split when >= 512 B would remain, a large
      one only when > 1 MiB would remain (and the request is below
      `max_split_size`), so an unsplit large block carries up to 1 MiB of slack
      that counts as allocated, as in torch;
    - freeing coalesces with free neighbours in the same segment;
    - `max_split_size` (None = unlimited, the default): blocks at least that big
      are never split, are not handed to smaller requests, and serve larger ones
      only within 20 MiB of their size;
    - with a `capacity`, a segment that would push reserved memory past it fails
      like cudaMalloc; the allocator then frees oversize cached blocks (only with
      `max_split_size`), then every whole cached segment (empty_cache), and
      retries once before raising `SimulatedOutOfMemoryError`.

    `allocated_bytes` and `reserved_bytes` match torch.cuda.memory_allocated()
    and memory_reserved(). Free lists are sorted (size, address) lists per pool
    searched with `bisect`, so each event costs O(log n) comparisons.
    """

    # Where cudaMalloc puts a new segment: below every earlier one ("descending") or above ("ascending"). Among free
    # blocks of one size the lowest address serves a request (BlockComparator), so the order decides which block
    # is reused. Replaying the eleven H100/H200 snapshots' own events (docs/benchmarks.md section 21), descending
    # reproduced the measured reserved peak on 10 (ascending on 7); the real addresses, on all 11.
    SEGMENT_ORDER = "ascending"

    def __init__(self, capacity: int | None = None, max_split_size: int | None = None):
        self.capacity = capacity
        self.max_split_size = max_split_size
        self.descending = self.SEGMENT_ORDER == "descending"
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # small? -> [(size, addr)]
        self._free_blocks: dict[int, _Block] = {}  # addr -> free block
        self._live: dict[object, _Block | None] = {}
        self._next_addr = 2**62 if self.descending else 0
        self._allocated = self._reserved = 0
        self._peak_allocated = self._peak_reserved = 0
        self._requested = 0
        self.num_segments = 0
        self.num_alloc_retries = 0
        self.num_ooms = 0

    # -- public API --

    @property
    def allocated_bytes(self) -> int:
        """Bytes in live blocks, slack of unsplit blocks included (torch.cuda.memory_allocated)."""
        return self._allocated

    @property
    def reserved_bytes(self) -> int:
        """Bytes in segments held from cudaMalloc (torch.cuda.memory_reserved)."""
        return self._reserved

    @property
    def peak_allocated_bytes(self) -> int:
        return self._peak_allocated

    @property
    def peak_reserved_bytes(self) -> int:
        return self._peak_reserved

    @property
    def requested_bytes(self) -> int:
        """Sum of the live requests as asked for, before any rounding."""
        return self._requested

    def block_size(self, key: object) -> int:
        """Size of the block serving a live allocation (0 for an empty tensor)."""
        block = self._live[key]
        return 0 if block is None else block.size

    def malloc(self, key: object, nbytes: int) -> int:
        """Allocate `nbytes` under `key`; returns the block size it occupies."""
        if key in self._live:
            raise ValueError(f"allocation key {key!r} is already live; free it first")
        if nbytes < 0:
            raise ValueError(f"allocation size must be non-negative, got {nbytes}")
        if nbytes == 0:  # torch never calls the allocator for an empty tensor
            self._live[key] = None
            return 0
        size = round_allocation(nbytes)
        small = size <= K_SMALL_SIZE
        block = self._get_free_block(size, small)
        if block is None:
            block = self._alloc_segment_with_retries(size, small)
        if self._should_split(block, size):
            rest = _Block(block.addr + size, block.size - size, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._insert_free(rest)
        block.allocated = True
        block.requested = nbytes
        self._live[key] = block
        self._requested += nbytes
        self._allocated += block.size
        if self._allocated > self._peak_allocated:
            self._peak_allocated = self._allocated
        return block.size

    def free(self, key: object) -> None:
        """Free the allocation made under `key`, returning its block to the cache."""
        try:
            block = self._live.pop(key)
        except KeyError:
            raise KeyError(f"allocation key {key!r} is not live") from None
        if block is None:
            return
        block.allocated = False
        self._requested -= block.requested
        self._allocated -= block.size
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated:  # [prev block] -> one block at prev's address
            self._remove_free(prev)
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev.prev
            if block.prev is not None:
                block.prev.next = block
        if nxt is not None and not nxt.allocated:  # [block next]
            self._remove_free(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if block.next is not None:
                block.next.prev = block
        self._insert_free(block)

    def empty_cache(self) -> None:
        """Release every cached segment that is entirely free (torch.cuda.empty_cache)."""
        for small in (True, False):
            for size, addr in list(self._free[small]):
                block = self._free_blocks[addr]
                if block.prev is None and block.next is None:
                    self._release(block)

    def reset_peak_stats(self) -> None:
        """Set the peaks to the current values (torch.cuda.reset_peak_memory_stats)."""
        self._peak_allocated = self._allocated
        self._peak_reserved = self._reserved

    # -- internals, named after their counterparts in CUDACachingAllocator.cpp --

    def _get_free_block(self, size: int, small: bool) -> _Block | None:
        pool = self._free[small]
        i = bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        block_size, addr = pool[i]
        mss = self.max_split_size
        if mss is not None:
            if size < mss and block_size >= mss:  # no oversize block for a smaller request
                return None
            if size >= mss and block_size >= size + K_LARGE_BUFFER:  # oversize: round up at most 20 MiB
                return None
        del pool[i]
        return self._free_blocks.pop(addr)

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.small:
            return remaining >= K_MIN_BLOCK_SIZE
        below_max = self.max_split_size is None or size < self.max_split_size
        return below_max and remaining > K_SMALL_SIZE

    def _alloc_segment_with_retries(self, size: int, small: bool) -> _Block:
        alloc_size = segment_bytes(size)
        block = self._alloc_segment(alloc_size, small)
        if block is None and self._release_available_cached_blocks(size, small):
            block = self._alloc_segment(alloc_size, small)
        if block is None:
            self.empty_cache()
            self.num_alloc_retries += 1
            block = self._alloc_segment(alloc_size, small)
        if block is None:
            self.num_ooms += 1
            raise SimulatedOutOfMemoryError(alloc_size, self._allocated, self._reserved, self.capacity or 0)
        return block

    def _alloc_segment(self, alloc_size: int, small: bool) -> _Block | None:
        if self.capacity is not None and self._reserved + alloc_size > self.capacity:
            return None  # cudaMalloc would fail
        if self.descending:
            self._next_addr -= alloc_size
            block = _Block(self._next_addr, alloc_size, small)
        else:
            block = _Block(self._next_addr, alloc_size, small)
            self._next_addr += alloc_size
        self._reserved += alloc_size
        self.num_segments += 1
        if self._reserved > self._peak_reserved:
            self._peak_reserved = self._reserved
        return block

    def _release_available_cached_blocks(self, size: int, small: bool) -> bool:
        # Only acts when max_split_size is set: frees one oversize cached block
        # big enough, else the largest oversize ones until enough is freed.
        mss = self.max_split_size
        if mss is None:
            return False
        pool = self._free[small]
        target = max(size, mss)
        i = bisect_left(pool, (target, -1))
        if i < len(pool):
            block = self._free_blocks[pool[i][1]]
            if block.prev is None and block.next is None:
                self._release(block)
                return True
            return False
        released = 0
        for block_size, addr in reversed(list(pool)):
            if released >= target or block_size < mss:
                break
            block = self._free_blocks[addr]
            if block.prev is None and block.next is None:
                self._release(block)
                released += block_size
        return released >= target

    def _release(self, block: _Block) -> None:
        self._remove_free(block)
        self._reserved -= block.size
        self.num_segments -= 1

    def _insert_free(self, block: _Block) -> None:
        insort(self._free[block.small], (block.size, block.addr))
        self._free_blocks[block.addr] = block

    def _remove_free(self, block: _Block) -> None:
        pool = self._free[block.small]
        i = bisect_left(pool, (block.size, block.addr))
        del pool[i]
        del self._free_blocks[block.addr]

    def _check_invariants(self) -> None:
        """Walk every segment and check the bookkeeping (for tests; O(blocks))."""
        blocks = list(self._free_blocks.values()) + [b for b in self._live.values() if b is not None]
        heads = {id(b): b for b in blocks if b.prev is None}
        total = seen = allocated = 0
        for head in heads.values():
            block, addr = head, head.addr
            while block is not None:
                assert block.addr == addr, "blocks of a segment must be contiguous"
                next_free = block.next is not None and not block.next.allocated
                assert block.allocated or not next_free, "free neighbours not merged"
                in_free_list = self._free_blocks.get(block.addr) is block
                assert block.allocated != in_free_list, "free list out of sync"
                allocated += block.size if block.allocated else 0
                total += block.size
                addr += block.size
                seen += 1
                block = block.next
        assert seen == len(blocks), "a block is unreachable from its segment's head"
        assert total == self._reserved and allocated == self._allocated
        assert len(heads) == self.num_segments
        for small, pool in self._free.items():
            assert pool == sorted(pool) and all(self._free_blocks[a].small == small for _, a in pool)
        assert sum(len(p) for p in self._free.values()) == len(self._free_blocks)


# --- Optimizer step temporaries ---------------------------------------------------
# Modelled with every other optimizer fact in `hf_memfit.optimizers`; the old name stays importable.
from hf_memfit.optimizers import step_temporary_bytes as optimizer_step_temporary_bytes  # noqa: E402,F401

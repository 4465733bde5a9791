"""GPU-side overheads and the caching-allocator simulator: pure Python, no GPU."""

import random

import pytest

from hf_memfit.estimator.cuda_overhead import (
    ALLOCATOR_FRAGMENTATION_RATIO,
    CachingAllocatorSimulator,
    SimulatedOutOfMemoryError,
    allocator_slack_bytes,
    cublas_workspace_bytes,
    cuda_context_bytes,
    optimizer_step_temporary_bytes,
    round_allocation,
    segment_bytes,
)
from hf_memfit.errors import MemFitError
from hf_memfit.hardware import find_gpu
from hf_memfit.units import GiB, MiB

KiB = 1024


# --- constants and pure functions ---

def test_cuda_context_is_the_documented_figure_and_reaches_the_device_total():
    # CUDA_MEMORY_FACTS.md: a bare lazily-loaded context of 0.25-0.45 GiB (the upper half, 0.4 GiB, for
    # current CUDA) plus about 0.5 GiB once a training step has loaded its kernels.
    expected = int(0.4 * GiB) + int(0.5 * GiB)
    from hf_memfit.estimator.assemble import estimate

    for gpu in (None, "t4", "h100"):
        assert cuda_context_bytes(find_gpu(gpu) if gpu else None) == expected
        one = estimate("gpt2", batch_size=1, seq_len=128, gpu=gpu)
        assert one.device_total_bytes - one.peak_reserved_bytes == expected  # nvidia-smi counts it, torch does not
    # With more GPUs, NCCL's buffers join it outside the allocator: 0.6 GiB per communicator (nccl#964).
    two = estimate("gpt2", batch_size=1, seq_len=128, gpu="h100", num_gpus=2)
    assert two.device_total_bytes - two.peak_reserved_bytes == expected + int(0.6 * GiB)


def test_cublas_workspaces():
    assert cublas_workspace_bytes(find_gpu("h100")) == 2 * 32 * MiB
    assert cublas_workspace_bytes(find_gpu("h200")) == 2 * 32 * MiB
    assert cublas_workspace_bytes(find_gpu("a100")) == 2 * 8_519_680
    assert cublas_workspace_bytes(find_gpu("4090")) == 2 * 8_519_680
    assert cublas_workspace_bytes(None) == 2 * 32 * MiB  # unknown: the larger size
    assert cublas_workspace_bytes(find_gpu("t4"), handles=1) == 8_519_680


@pytest.mark.parametrize("nbytes, rounded", [
    (0, 512), (1, 512), (511, 512), (512, 512), (513, 1024), (1000, 1024),
    (MiB, MiB), (MiB + 1, MiB + 512), (15 * MiB, 15 * MiB),
])
def test_round_allocation(nbytes, rounded):
    assert round_allocation(nbytes) == rounded


def test_round_allocation_rejects_negative():
    with pytest.raises(ValueError):
        round_allocation(-1)


@pytest.mark.parametrize("nbytes, segment", [
    (1, 2 * MiB), (MiB, 2 * MiB), (MiB + 1, 20 * MiB), (5 * MiB, 20 * MiB),
    (10 * MiB - 512, 20 * MiB), (10 * MiB, 10 * MiB), (15 * MiB, 16 * MiB), (15 * MiB + 1, 16 * MiB),
])
def test_segment_bytes(nbytes, segment):
    assert segment_bytes(nbytes) == segment


def test_allocator_slack_is_a_share_of_the_transient_bytes():
    assert allocator_slack_bytes(0) == 0
    assert allocator_slack_bytes(1000 * MiB) == int(ALLOCATOR_FRAGMENTATION_RATIO * 1000 * MiB)
    assert allocator_slack_bytes(3 * 1000 * MiB) == 3 * allocator_slack_bytes(1000 * MiB)
    # expandable segments: at most the last partly used page of each pool, whatever the churn
    assert allocator_slack_bytes(1000 * MiB, expandable_segments=True) == 22 * MiB
    assert allocator_slack_bytes(0, expandable_segments=True) == 22 * MiB


# --- the simulator ---

def test_small_allocation_takes_a_2mib_segment():
    sim = CachingAllocatorSimulator()
    assert sim.malloc("a", 1000) == 1024
    assert sim.allocated_bytes == 1024 and sim.reserved_bytes == 2 * MiB
    for i in range(7):  # more small tensors share the segment
        sim.malloc(i, 256 * KiB)
    assert sim.reserved_bytes == 2 * MiB and sim.num_segments == 1
    sim.malloc("spill", 256 * KiB)  # 1024 B + 8 x 256 KiB > 2 MiB: a second segment
    assert sim.reserved_bytes == 4 * MiB
    sim._check_invariants()


def test_medium_allocation_takes_a_20mib_segment():
    sim = CachingAllocatorSimulator()
    sim.malloc("a", 5 * MiB)
    assert sim.allocated_bytes == 5 * MiB and sim.reserved_bytes == 20 * MiB
    sim.malloc("b", 5 * MiB)  # split off the same segment's remainder
    assert sim.allocated_bytes == 10 * MiB and sim.reserved_bytes == 20 * MiB
    sim._check_invariants()


def test_large_allocation_rounds_to_2mib_and_keeps_unsplit_slack():
    sim = CachingAllocatorSimulator()
    assert sim.malloc("a", 15 * MiB) == 16 * MiB  # 1 MiB remainder: not > 1 MiB, so no split
    assert sim.reserved_bytes == 16 * MiB and sim.allocated_bytes == 16 * MiB
    assert sim.requested_bytes == 15 * MiB
    assert sim.malloc("b", 14 * MiB + 512 * KiB) == 14 * MiB + 512 * KiB  # 1.5 MiB left: split
    assert sim.reserved_bytes == 32 * MiB
    sim._check_invariants()


def test_free_and_malloc_again_reuses_cached_blocks():
    sim = CachingAllocatorSimulator()
    for step in range(5):  # a training loop with fixed shapes
        for i, size in enumerate((300 * KiB, 3 * MiB, 40 * MiB, 700)):
            sim.malloc((step, i), size)
        reserved = sim.reserved_bytes
        for i in range(4):
            sim.free((step, i))
        assert sim.allocated_bytes == 0 and sim.reserved_bytes == reserved
    assert sim.reserved_bytes == 2 * MiB + 20 * MiB + 40 * MiB
    assert sim.num_segments == 3
    sim._check_invariants()


def test_small_pool_splits_down_to_512_bytes():
    sim = CachingAllocatorSimulator()
    sim.malloc("a", 2 * MiB - 512)  # small? no: > 1 MiB goes to the large pool
    assert sim.reserved_bytes == 20 * MiB
    sim = CachingAllocatorSimulator()
    sim.malloc("a", MiB)  # small pool: 2 MiB segment, split leaves 1 MiB
    sim.malloc("b", MiB - 512)  # leaves exactly 512 B: still split
    assert sim.allocated_bytes == 2 * MiB - 512 and sim.reserved_bytes == 2 * MiB
    assert sim.malloc("c", 100) == 512  # the 512 B sliver serves it
    assert sim.reserved_bytes == 2 * MiB
    sim._check_invariants()


def test_coalescing_and_best_fit():
    sim = CachingAllocatorSimulator()
    for key in "abcd":  # four 5 MiB blocks fill one 20 MiB segment
        sim.malloc(key, 5 * MiB)
    assert sim.reserved_bytes == 20 * MiB
    sim.free("a")
    sim.free("b")  # a and b merge into one 10 MiB free block
    assert sim.malloc("e", 9 * MiB + 512 * KiB) == 10 * MiB  # 0.5 MiB left: not split
    assert sim.reserved_bytes == 20 * MiB
    sim._check_invariants()
    sim.free("e")
    sim.free("d")  # free: [0, 10) and [15, 20), c is live at [10, 15)
    assert sim.malloc("f", 4 * MiB + 768 * KiB) == 5 * MiB  # best fit: the 5 MiB hole, not the 10 MiB one
    assert sim.malloc("g", 6 * MiB) == 6 * MiB  # the 10 MiB hole, split (4 MiB left)
    assert sim.reserved_bytes == 20 * MiB
    for key in "cfg":
        sim.free(key)
    sim._check_invariants()
    assert sim.allocated_bytes == 0 and len(sim._free_blocks) == 1  # all merged back into one block


def test_small_and_large_pools_do_not_share():
    sim = CachingAllocatorSimulator()
    sim.malloc("big", 5 * MiB)
    sim.free("big")  # 20 MiB cached in the large pool
    sim.malloc("small", 4 * KiB)
    assert sim.reserved_bytes == 22 * MiB


def test_peak_tracking():
    sim = CachingAllocatorSimulator()
    sim.malloc("a", 50 * MiB)
    sim.malloc("b", 30 * MiB)
    sim.free("a")
    sim.malloc("c", 10 * MiB)  # fits in a's cached 50 MiB segment
    assert sim.peak_allocated_bytes == 80 * MiB
    assert sim.peak_reserved_bytes == 80 * MiB
    assert sim.allocated_bytes == 40 * MiB
    sim.reset_peak_stats()
    assert sim.peak_allocated_bytes == 40 * MiB and sim.peak_reserved_bytes == 80 * MiB
    sim.free("b")
    sim.free("c")
    sim.empty_cache()
    assert sim.reserved_bytes == 0 and sim.peak_reserved_bytes == 80 * MiB


def test_zero_byte_and_bad_keys():
    sim = CachingAllocatorSimulator()
    assert sim.malloc("empty", 0) == 0 and sim.reserved_bytes == 0
    sim.free("empty")
    sim.malloc("x", 10)
    with pytest.raises(ValueError):
        sim.malloc("x", 10)
    with pytest.raises(KeyError):
        sim.free("nope")


def test_capacity_frees_cache_and_retries_before_oom():
    sim = CachingAllocatorSimulator(capacity=40 * MiB)
    sim.malloc("a", 5 * MiB)
    sim.free("a")  # 20 MiB segment stays cached
    sim.malloc("b", 30 * MiB)  # 20 + 30 > 40: empty the cache, then it fits
    assert sim.reserved_bytes == 30 * MiB and sim.num_alloc_retries == 1
    with pytest.raises(SimulatedOutOfMemoryError) as err:
        sim.malloc("c", 30 * MiB)
    assert err.value.requested == 30 * MiB and sim.num_ooms == 1
    assert "c" not in sim._live
    sim._check_invariants()


def test_split_segments_are_not_released_by_empty_cache():
    sim = CachingAllocatorSimulator(capacity=30 * MiB)
    sim.malloc("a", 5 * MiB)
    sim.malloc("b", 5 * MiB)
    sim.free("a")  # the segment is half free but still in use: cannot be returned
    with pytest.raises(SimulatedOutOfMemoryError):
        sim.malloc("c", 12 * MiB)  # needs 12 MiB more, 20 + 12 > 30
    assert sim.reserved_bytes == 20 * MiB


def test_max_split_size_oversize_blocks():
    sim = CachingAllocatorSimulator(max_split_size=64 * MiB)
    sim.malloc("big", 100 * MiB)
    sim.free("big")
    sim.malloc("small", 30 * MiB)  # may not take the oversize 100 MiB block
    assert sim.reserved_bytes == 130 * MiB
    assert sim.malloc("near", 90 * MiB) == 100 * MiB  # within 20 MiB of it: reused whole
    sim.free("near")
    sim.malloc("far", 70 * MiB)  # 100 >= 70 + 20: not reused
    assert sim.reserved_bytes == 200 * MiB
    sim._check_invariants()


def test_max_split_size_releases_oversize_blocks_first():
    sim = CachingAllocatorSimulator(capacity=150 * MiB, max_split_size=64 * MiB)
    sim.malloc("big", 100 * MiB)
    sim.free("big")
    sim.malloc("keep", 5 * MiB)  # a 20 MiB segment, partly used
    sim.malloc("new", 70 * MiB)  # 120 + 70 > 150: release the cached oversize 100 MiB block
    assert sim.reserved_bytes == 90 * MiB and sim.num_alloc_retries == 0  # no empty_cache needed
    sim.free("new")
    sim.malloc("newer", 130 * MiB)  # 90 + 130 > 150: no single oversize block is enough;
    assert sim.reserved_bytes == 150 * MiB  # the cached 70 MiB goes, then the retry fits
    assert sim.num_alloc_retries == 1
    sim._check_invariants()


def _random_trace(seed, steps):
    rng = random.Random(seed)
    sim = CachingAllocatorSimulator()
    live: dict[int, int] = {}
    for i in range(steps):
        if live and rng.random() < 0.45:
            key = rng.choice(list(live))
            del live[key]
            sim.free(key)
        else:
            kind = rng.random()
            if kind < 0.5:
                n = rng.randint(1, MiB)
            elif kind < 0.8:
                n = rng.randint(MiB + 1, 10 * MiB)
            else:
                n = rng.randint(10 * MiB, 120 * MiB)
            sim.malloc(i, n)
            live[i] = n
        yield sim, live


@pytest.mark.parametrize("seed", range(3))
def test_random_traces_keep_the_books(seed):
    for sim, live in _random_trace(seed, 3000):
        rounded = sum(round_allocation(n) for n in live.values())
        large = sum(1 for n in live.values() if round_allocation(n) > MiB)
        assert sim.allocated_bytes == sum(sim.block_size(k) for k in live)
        # allocated is the rounded sizes plus at most 1 MiB of unsplit slack per large block
        assert rounded <= sim.allocated_bytes <= rounded + large * MiB
        assert sim.requested_bytes == sum(live.values())
        assert sim.reserved_bytes >= sim.allocated_bytes
        assert sim.peak_reserved_bytes >= sim.reserved_bytes
        assert sim.peak_allocated_bytes >= sim.allocated_bytes
    sim._check_invariants()
    for key in list(live):
        sim.free(key)
    assert sim.allocated_bytes == 0
    sim._check_invariants()
    sim.empty_cache()
    assert sim.reserved_bytes == 0 and sim.num_segments == 0


class _ReferenceAllocator:
    """CUDACachingAllocator's rules written the slow, obvious way: every segment a list of [size, free] blocks.

    Best fit is a scan over every free block of the pool (smallest size, then lowest address); the
    simulator under test keeps sorted free lists and linked blocks instead. Both must agree exactly.
    """

    def __init__(self):
        self.segments: list[tuple[int, bool, list[list]]] = []  # (base address, small pool?, [[size, free], ...])
        self.live: dict[object, tuple[int, int]] = {}  # key -> (segment index, block address)
        self.next_addr = 0

    def _blocks(self, index):
        base, small, blocks = self.segments[index]
        addr = base
        for position, block in enumerate(blocks):
            yield position, addr, block
            addr += block[0]

    def malloc(self, key, nbytes):
        size = max(512, -(-nbytes // 512) * 512)
        small = size <= MiB
        fits = [(block[0], addr, index, position) for index, (_, pool, _) in enumerate(self.segments) if pool == small
                for position, addr, block in self._blocks(index) if block[1] and block[0] >= size]
        if fits:
            _, addr, index, position = min(fits)
        else:
            segment = 2 * MiB if small else 20 * MiB if size < 10 * MiB else -(-size // (2 * MiB)) * 2 * MiB
            self.segments.append((self.next_addr, small, [[segment, True]]))
            self.next_addr += segment
            index, position, addr = len(self.segments) - 1, 0, self.segments[-1][0]
        blocks = self.segments[index][2]
        remaining = blocks[position][0] - size
        if remaining >= 512 if small else remaining > MiB:
            blocks[position:position + 1] = [[size, False], [remaining, True]]
        else:
            blocks[position][1] = False
        self.live[key] = (index, addr)

    def free(self, key):
        index, addr = self.live.pop(key)
        blocks = self.segments[index][2]
        position = next(p for p, a, _ in self._blocks(index) if a == addr)
        blocks[position][1] = True
        merged = []
        for block in blocks:  # coalesce neighbouring free blocks
            if merged and merged[-1][1] and block[1]:
                merged[-1][0] += block[0]
            else:
                merged.append(list(block))
        blocks[:] = merged

    @property
    def allocated(self):
        return sum(b[0] for _, _, blocks in self.segments for b in blocks if not b[1])

    @property
    def reserved(self):
        return sum(b[0] for _, _, blocks in self.segments for b in blocks)


def test_simulator_matches_a_plain_reference_of_the_same_rules():
    reference = _ReferenceAllocator()
    sim = None
    for step, (sim, live) in enumerate(_random_trace(5, 1500)):
        # replay the same event into the reference: a new key is a malloc, a vanished one a free
        for key in set(reference.live) - set(live):
            reference.free(key)
        for key in set(live) - set(reference.live):
            reference.malloc(key, live[key])
        assert (sim.allocated_bytes, sim.reserved_bytes) == (reference.allocated, reference.reserved), step
    assert sim is not None and sim.num_segments == len(reference.segments)


# --- optimizer step temporaries ---

N, LARGEST = 1_000_000, 100_000


def test_adamw_foreach_on_cuda_keeps_one_state_copy():
    assert optimizer_step_temporary_bytes("adamw_torch", N) == 4 * N
    assert optimizer_step_temporary_bytes("adamw_torch", N, state_dtype_bytes=2) == 2 * N


def test_fused_and_bitsandbytes_have_no_temporaries():
    for optim in ("adamw_torch_fused", "adamw_bnb_8bit", "paged_adamw_8bit", "lion_8bit", "adamw_8bit"):
        assert optimizer_step_temporary_bytes(optim, N, largest_param_numel=LARGEST) == 0


def test_cpu_runs_the_single_tensor_path():
    assert optimizer_step_temporary_bytes("adamw_torch", N, largest_param_numel=LARGEST,
                                          device="cpu") == 3 * 4 * LARGEST
    assert optimizer_step_temporary_bytes("adamw_torch_fused", N, device="cpu") == 0


def test_sgd_adagrad_rmsprop():
    assert optimizer_step_temporary_bytes("sgd", N) == 0
    assert optimizer_step_temporary_bytes("sgd", N, weight_decay=True) == 4 * N
    assert optimizer_step_temporary_bytes("adagrad", N) == 2 * 4 * N
    assert optimizer_step_temporary_bytes("rmsprop", N) == 4 * N
    assert optimizer_step_temporary_bytes("rmsprop", N, weight_decay=True) == 2 * 4 * N


def test_adafactor_scales_with_the_largest_tensor():
    fp32 = optimizer_step_temporary_bytes("adafactor", N, largest_param_numel=LARGEST)
    bf16 = optimizer_step_temporary_bytes("adafactor", N, largest_param_numel=LARGEST, param_dtype_bytes=2)
    assert fp32 == 3 * 4 * LARGEST and bf16 == 5 * 4 * LARGEST
    # without the largest tensor's size, the whole model is the safe bound
    assert optimizer_step_temporary_bytes("adafactor", N) == 3 * 4 * N


def test_unknown_optimizer_is_a_one_line_error():
    with pytest.raises(MemFitError) as err:
        optimizer_step_temporary_bytes("lomo", N)
    assert "`--optim`" in str(err.value) and "adamw_torch_fused" in str(err.value)
    assert "\n" not in str(err.value)

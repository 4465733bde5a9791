"""The global-memory block CUDA's reduction kernel stages, which a CPU trace never sees.

When PyTorch's CUDA reduction splits one output's inputs over several CTAs, it asks the caching
allocator for a buffer of partial sums plus a semaphore array, frees both when the launch is queued,
and so adds a transient block to the peak: `gpu_reduce_kernel` in
`aten/src/ATen/native/cuda/Reduce.cuh`, sized by `ReduceConfig::global_memory_size()` and
`ReduceConfig::semaphore_size()` as `setReduceConfig` chooses them. A bias gradient's `grad.sum(0)`
is the usual case in training: BERT-base's `intermediate.dense` bias over 4,096 rows x 3,072
outputs asked for 100,663,296 B + 96 B (H200 memory snapshot), and
`benchmarks/results/gpu_h200_3/staging.json` holds 70 more `grad.sum(0)` rows (H200, 132 SMs,
2048 threads per SM, torch 2.11+cu130); all match exactly. So did 20 more shapes x {bf16, fp32} on that
H200 (inner and full reductions, odd output counts, inputs past 32-bit indexing), once the output's own
rounding to 512 B was taken off. The logic re-stated here is torch 2.13's header; 2.11's differs from it
only inside the kernel, and 2.14.1 only writes `max(min(c1, c2), c3)` as `std::clamp(c1, c3, c2)`.

Pure Python, no torch import. NVIDIA builds only (the ROCm branches of the C++ are left out).
"""

from __future__ import annotations

from math import prod

MAX_NUM_THREADS = 512  # mnt_wrapper<T>::MAX_NUM_THREADS (256 only for complex<double>)
WARP_SIZE = 32  # at::cuda::warp_size() on NVIDIA
MIN_VALUES_PER_THREAD = 16  # setReduceConfig (128 on ROCm)
MAX_VALUES_PER_THREAD = 256  # setReduceConfig
SEMAPHORE_BYTES = 4  # sizeof(int) in ReduceConfig::semaphore_size
INT32_MAX = 2**31 - 1  # TensorIteratorBase::can_use_32bit_indexing
ALLOCATOR_ROUND = 512  # CUDACachingAllocator kMinBlockSize: every request rounds up to a multiple


def _div_up(a: int, b: int) -> int:  # Reduce.cuh div_up
    return -(-a // b)


def _last_pow2(n: int) -> int:  # Reduce.cuh last_pow2: largest power of two <= n, at least 1
    return 1 << (n.bit_length() - 1) if n > 1 else 1


def _round_request(nbytes: int) -> int:  # what torch.cuda.memory_allocated counts for one request
    return _div_up(nbytes, ALLOCATOR_ROUND) * ALLOCATOR_ROUND


def staging_request_bytes(num_outputs: int, reduced: int, *, outputs_contiguous: bool,
                          element_size_acc: int, input_element_size: int, sm_count: int,
                          max_threads_per_sm: int, output_vec_size: int | None = None,
                          input_vec_size: int | None = None, reduce_dims: int = 1) -> tuple[int, ...]:
    """Bytes `gpu_reduce_kernel` asks the allocator for in one launch: (partial-sum buffer, semaphores), or ().

    `outputs_contiguous`: the input's fastest-moving dim is kept (`grad.sum(0)`: "vectorize along output");
    False when it is reduced (`x.sum(-1)`, a full `x.sum()`: "vectorize along input"). `output_vec_size`
    defaults to what `get_output_vec_size` picks for an aligned contiguous [reduced, num_outputs] input;
    `input_vec_size` to what `sum_functor` (ReduceSumProdKernel.cu) passes: 8 for 16-bit inputs, else 4.
    `reduce_dims` is `iter.num_reduce_dims()` after coalescing (input vectorization needs exactly 1).
    """
    num_inputs = reduced  # setReduceConfig: inputs_per_output = numel / num_outputs
    # setReduceConfig: map block.x to the fastest-moving dim, then vectorize along it.
    if outputs_contiguous:  # reduction_on_fastest_striding_dimension == false
        dim0, dim1 = num_outputs, num_inputs
        if output_vec_size is None:  # get_output_vec_size: 4, halved until it divides the sizes
            output_vec_size = next(v for v in (4, 2, 1) if num_outputs % v == 0)
        dim0 //= output_vec_size
    else:
        dim0, dim1 = num_inputs, num_outputs
        output_vec_size = 1
        if dim0 >= 128 and reduce_dims == 1:  # config.vectorize_input = true
            dim0 //= input_vec_size or (8 if input_element_size == 2 else 4)
    # ReduceConfig::set_block_dimension<scalar_t>
    max_num_threads = MAX_NUM_THREADS // output_vec_size
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_num_threads else max_num_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_num_threads else max_num_threads
    block_width = min(dim0_pow2, WARP_SIZE)
    block_height = min(dim1_pow2, max_num_threads // block_width)
    block_width = min(dim0_pow2, max_num_threads // block_height)
    num_threads = block_width * block_height
    # ReduceConfig::split_input / split_output multiply step_input / step_output; input_mult[0] set
    # (should_block_x_reduce) when the lanes of a warp share one output's inputs.
    step_input = step_output = 1
    block_x_reduce = not outputs_contiguous
    if block_x_reduce:
        step_input *= block_width  # input_mult[0] = split_input(block_width)
    else:
        step_output *= block_width  # output_mult[0] = split_output(block_width)
    # ReduceConfig::values_per_thread = div_up(num_inputs, step_input)
    warp_split_threshold = min(block_height * 16, MAX_VALUES_PER_THREAD)
    if _div_up(num_inputs, step_input) < warp_split_threshold:
        return ()  # output_mult[1] set instead: input_mult[1] == 0 rules out splitting across CTAs
    step_input *= block_height  # input_mult[1] = split_input(block_height)
    # Split across CTAs (input_mult[2], should_global_reduce) if there is enough work per thread
    # and the grid is small next to what the SMs can hold.
    blocks_per_sm = max_threads_per_sm // num_threads
    target_grid_size = sm_count * blocks_per_sm
    grid_x = _div_up(num_outputs // output_vec_size, step_output)  # ReduceConfig::grid().x
    values_per_thread = _div_up(num_inputs, step_input)
    if values_per_thread < MAX_VALUES_PER_THREAD or grid_x > target_grid_size:
        return ()
    ctas_per_output1 = _div_up(target_grid_size, grid_x)
    ctas_per_output2 = _div_up(values_per_thread, MIN_VALUES_PER_THREAD)
    ctas_per_output3 = _div_up(values_per_thread, MAX_VALUES_PER_THREAD)
    ctas_per_output = max(min(ctas_per_output1, ctas_per_output2), ctas_per_output3)
    if ctas_per_output <= 1:
        return ()
    # ReduceConfig::global_memory_size: one acc_t per output per CTA, times the lanes (and vector
    # slots) of block.x when those lanes hold different outputs.
    buffer = element_size_acc * num_outputs * ctas_per_output
    if not block_x_reduce:
        buffer *= block_width * output_vec_size
    return buffer, SEMAPHORE_BYTES * grid_x  # ReduceConfig::semaphore_size = sizeof(int) * grid().x


def _iterator_dims(shape: tuple[int, ...], reduced: set[int]) -> list[list[int]]:
    """A contiguous tensor's dims as TensorIterator sees them: [size, input stride in elements, is_reduced].

    Size-1 dims dropped and same-role neighbours merged (TensorIteratorBase::coalesce_dimensions; in a
    contiguous tensor they always merge), reduced dims first, each group innermost first
    (reorder_dimensions moves dims whose output stride is 0 to the front)."""
    dims: list[list[int]] = []  # innermost first
    stride = 1
    for i in reversed(range(len(shape))):
        if shape[i] != 1:
            if dims and dims[-1][2] == (i in reduced):
                dims[-1][0] *= shape[i]
            else:
                dims.append([shape[i], stride, i in reduced])
        stride *= shape[i]
    return [d for d in dims if d[2]] + [d for d in dims if not d[2]]


def _split_32bit(dims: list[list[int]], offset: int, elem: int):
    """Yield (dims, element offset) for each sub-iterator `iter.with_32bit_indexing()` hands
    `gpu_reduce_kernel`. The input bounds the check (the output's strides and size are no larger)."""
    numel = prod(d[0] for d in dims)
    if numel <= INT32_MAX and 1 + sum((d[0] - 1) * d[1] * elem for d in dims) <= INT32_MAX:
        yield dims, offset  # can_use_32bit_indexing
        return
    # get_dim_to_split: the dim of largest extent, scanning from the last; TensorIteratorBase::split
    # gives the first shape/2 to a copy and keeps the rest.
    split = max(reversed(range(len(dims))), key=lambda j: (dims[j][0] - 1) * dims[j][1])
    size, stride, red = dims[split]
    for part, start in ((size // 2, 0), (size - size // 2, size // 2)):
        sub = [list(d) for d in dims]
        sub[split] = [part, stride, red]
        yield from _split_32bit(sub, offset + start * stride, elem)


def sum_staging_requests(shape, dims, dtype_bytes: int, sm_count: int,
                         max_threads_per_sm: int) -> tuple[int, list[tuple[int, ...]]]:
    """What `x.sum(dims)` asks the caching allocator for beyond its output, for a contiguous floating-point `x` of
    `shape` and `dtype_bytes` (fp16/bf16 2, fp32 4, fp64 8): (bytes held through every launch, 0 or an fp16/bf16
    output's fp32 accumulation buffer; per launch, the requests it frees when queued). Unrounded."""
    if not shape or prod(shape) == 0:
        return 0, []
    reduced = {d % len(shape) for d in dims} if dims else set(range(len(shape)))  # sum(dim=[]): all
    it = _iterator_dims(tuple(shape), reduced)
    acc = max(4, dtype_bytes)  # sum accumulates fp16/bf16/fp32 in float, fp64 in double
    held = 0
    subs = list(_split_32bit(it, 0, dtype_bytes))
    if len(subs) > 1 and dtype_bytes == 2:
        # gpu_reduce_kernel: fp16/bf16 cannot accumulate in their own output across sub-iterators, so an
        # AccumulationBuffer of one acc_t per output is held through all of them.
        held = acc * prod(d[0] for d in it if not d[2])
    launches = []
    for sub, offset in subs:  # run one after another; each frees its block before the next asks
        red = [d for d in sub if d[2]]
        kept = [d for d in sub if not d[2]]
        num_outputs = prod(d[0] for d in kept)
        # reduction_on_fastest_striding_dimension: all dims reduced, or the innermost reduced stride
        # is below the innermost kept one.
        outputs_contiguous = bool(kept) and (not red or kept[0][1] < red[0][1])
        vec = None
        if outputs_contiguous:  # get_output_vec_size: divide base address, output size, other strides
            others = [offset, kept[0][0]] + [d[1] for d in sub if d is not kept[0]]
            vec = next(v for v in (4, 2, 1) if all(n % v == 0 for n in others))
        requests = staging_request_bytes(
            num_outputs, prod(d[0] for d in red), outputs_contiguous=outputs_contiguous,
            element_size_acc=acc, input_element_size=dtype_bytes, sm_count=sm_count,
            max_threads_per_sm=max_threads_per_sm, output_vec_size=vec, reduce_dims=len(red))
        if requests:
            launches.append(requests)
    return held, launches


def sum_staging_bytes(shape, dims, dtype_bytes: int, sm_count: int, max_threads_per_sm: int) -> int:
    """Peak bytes (as `max_memory_allocated` counts them) that `x.sum(dims)` adds beyond its output
    (`sum_staging_requests`, each request rounded as the allocator rounds it)."""
    held, launches = sum_staging_requests(shape, dims, dtype_bytes, sm_count, max_threads_per_sm)
    return (_round_request(held) if held else 0) + max(
        (sum(_round_request(r) for r in requests) for requests in launches), default=0)

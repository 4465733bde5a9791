"""The block CUDA's reduction stages in global memory: pure Python, checked against H200 measurements."""

import json
from pathlib import Path

import pytest

from hf_memfit.estimator.reduction_staging import staging_request_bytes, sum_staging_bytes

STAGING_JSON = Path(__file__).parent.parent / "benchmarks" / "results" / "gpu_h200_3" / "staging.json"
H200 = dict(sm_count=132, max_threads_per_sm=2048)


def _allocated(requests):
    # CUDACachingAllocator rounds every request up to a multiple of 512 B; memory_allocated counts that.
    return sum(-(-r // 512) * 512 for r in requests)


def _staging_rows():
    data = json.loads(STAGING_JSON.read_text())
    assert (data["multi_processor_count"], data["max_threads_per_multi_processor"]) == (132, 2048)
    assert len(data["rows"]) == 70
    return data["rows"]


@pytest.mark.parametrize("row", _staging_rows(), ids=lambda r: f"{r['dtype']}-{r['rows']}x{r['outputs']}")
def test_every_measured_bias_grad_sum_matches_exactly(row):
    element_size = {"bfloat16": 2, "float32": 4}[row["dtype"]]
    requests = staging_request_bytes(row["outputs"], row["rows"], outputs_contiguous=True, element_size_acc=4,
                                     input_element_size=element_size, **H200)
    assert _allocated(requests) == row["staged_bytes"]
    # The convenience form, from the tensor's shape, agrees.
    assert sum_staging_bytes((row["rows"], row["outputs"]), (0,), element_size, **H200) == row["staged_bytes"]


def test_bert_intermediate_bias_grad_requests_the_snapshot_blocks():
    # H200 memory snapshot, BERT-base backward of intermediate.dense: a 100,663,296 B block and a 96 B
    # block, allocated and freed together (4,096 rows x 3,072 outputs, bf16).
    assert staging_request_bytes(3072, 4096, outputs_contiguous=True, element_size_acc=4,
                                 input_element_size=2, **H200) == (100_663_296, 96)
    # [B, S, O] reduced over (0, 1) coalesces to the same [B*S, O] problem.
    assert sum_staging_bytes((32, 128, 3072), (0, 1), 2, **H200) == 100_663_296 + 512


def test_a_small_reduction_stages_nothing():
    # 256 rows: 4 warps of a 128-thread block split them 4 ways, 64 values per thread < 256.
    assert staging_request_bytes(3072, 256, outputs_contiguous=True, element_size_acc=4,
                                 input_element_size=2, **H200) == ()
    assert sum_staging_bytes((256, 3072), (0,), 2, **H200) == 0


def test_the_sm_count_sets_the_split():
    # By hand from setReduceConfig, T4 (40 SMs, 1024 threads/SM), 4096 x 3072 bf16: output_vec_size 4,
    # block 32 x 4 = 128 threads, grid.x = 3072/4/32 = 24, values_per_thread = 4096/4 = 1024;
    # target grid = 40 * (1024/128) = 320, ctas_per_output = max(min(ceil(320/24)=14, 1024/16=64), 4) = 14;
    # buffer = 4 B * 3072 * 14 * (32 * 4) = 22,020,096; semaphores = 4 * 24 = 96.
    assert staging_request_bytes(3072, 4096, outputs_contiguous=True, element_size_acc=4, input_element_size=2,
                                 sm_count=40, max_threads_per_sm=1024) == (22_020_096, 96)


def test_full_reduction_by_hand():
    # By hand from setReduceConfig, x.sum() over 2**24 bf16 on the H200: reduction on the fastest dim,
    # vectorize_input (dim0 = 2**24 / 8), block 512 x 1, values_per_thread = 2**24 / 512 = 32768 >= 16 so
    # split across warps (step 1), blocks_per_sm = 2048/512 = 4, target grid 528, grid.x = 1;
    # ctas_per_output = max(min(528, 32768/16), 32768/256) = 528. block_x_reduce, so the buffer is one
    # float per output per CTA: 4 * 1 * 528 = 2112; semaphores 4 * 1.
    assert staging_request_bytes(1, 2**24, outputs_contiguous=False, element_size_acc=4,
                                 input_element_size=2, **H200) == (2112, 4)
    assert sum_staging_bytes((2**24,), (0,), 2, **H200) == 2560 + 512
    assert sum_staging_bytes((4, 2**22), (), 2, **H200) == 2560 + 512  # sum(dim=[]) reduces everything


def test_inner_reduction_by_hand():
    # By hand, x.sum(-1) over [8, 2**20] bf16 on the H200: dim0 = 2**20 / 8 (vectorize_input), dim1 = 8;
    # block width 64, height 8 (512 threads); step_input 64 then 512; values_per_thread = 2048;
    # grid.x = 8, ctas_per_output = max(min(ceil(528/8)=66, 128), 8) = 66; buffer 4 * 8 * 66 = 2112,
    # semaphores 4 * 8 = 32.
    assert staging_request_bytes(8, 2**20, outputs_contiguous=False, element_size_acc=4,
                                 input_element_size=2, **H200) == (2112, 32)


# Measured on the H200 (132 SMs, 2048 threads/SM, torch 2.11+cu130) with x = torch.empty(shape) and
# max_memory_allocated during x.sum(dims), less what was allocated before and less the output's
# allocation rounded up to 512 B. Inner and full reductions, odd output counts (vec 2, 1), a middle dim,
# two non-coalescable reduced dims, and inputs past 32-bit indexing (split into sub-iterators; for bf16 an
# AccumulationBuffer of one float per output is held across them).
MEASURED_H200 = [
    ((8, 1 << 20), (-1,), 3072, 3072),
    ((64, 65536), (-1,), 0, 0),
    ((4, 1 << 22), (1,), 3072, 3072),
    ((1000, 4096), (1,), 0, 0),
    ((1 << 24,), (0,), 3072, 3072),
    ((1 << 28,), (0,), 8704, 8704),
    ((1 << 20,), (0,), 1024, 1024),
    ((8, 4096, 768), (1,), 138412544, 138412544),
    ((4, 1024, 3072), (0, 1), 100663808, 100663808),
    ((4096, 770), (0,), 6308352, 6308352),
    ((4096, 771), (0,), 1579520, 1579520),
    ((8192, 50257), (0,), 0, 0),
    ((16, 64, 4096), (0, 2), 0, 0),
    ((65536, 40000), (0,), 327841792, 163841536),
    ((3, 1 << 30), (1,), 33792, 16896),
    ((1 << 31,), (0,), 33792, 16896),
    ((32768, 70000), (0,), 287002624, 143362560),
    ((2, 1 << 28), (1,), 16896, 16896),
    ((65536, 100), (0,), 13107712, 13107712),
    ((65536, 7), (0,), 4096, 4096),
]


@pytest.mark.parametrize("shape,dims,bf16,fp32", MEASURED_H200, ids=lambda v: str(v))
def test_other_measured_shapes(shape, dims, bf16, fp32):
    assert sum_staging_bytes(shape, dims, 2, **H200) == bf16
    assert sum_staging_bytes(shape, dims, 4, **H200) == fp32


# --- in a traced run (kernel_staging.py, run_of_shapes.py) -------------------------------------------------------

def test_the_tracker_adds_a_cuda_sums_staged_blocks_after_its_output_and_frees_them_at_once():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hf_memfit.estimator.kernel_staging import reduction_staging
    from hf_memfit.estimator.trace import StorageTracker
    from hf_memfit.hardware import find_gpu

    tracker = StorageTracker(round_to=512)
    tracker.after_op = reduction_staging(find_gpu("h200"))
    with FakeTensorMode(allow_non_fake_inputs=True), tracker:
        grad = torch.empty(4096, 3072, dtype=torch.bfloat16, device="cuda")
        bias_grad = grad.sum(0)  # BERT-base's intermediate.dense bias gradient (the H200 snapshot's 96 MiB)
        del bias_grad
    sizes = [nbytes for index, nbytes in tracker.events if index > 0]
    # the input, the output (3,072 bf16 = 6,144 B), then the partial sums and the semaphores (96 B -> 512)
    assert sizes == [4096 * 3072 * 2, 6144, 100_663_296, 512]
    assert tracker.events[4:6] == [(-4, 512), (-3, 100_663_296)]  # freed inside the op, semaphores first
    assert tracker.peak_bytes == 4096 * 3072 * 2 + 6144 + 100_663_296 + 512


def test_an_unnamed_gpu_leaves_the_staging_out():
    from hf_memfit.estimator.kernel_staging import reduction_staging
    from hf_memfit.hardware import find_gpu

    assert reduction_staging(None) is None
    assert reduction_staging(find_gpu("t4")) is not None


def test_a_run_of_a_biased_model_holds_its_staged_blocks_where_a_gpu_is_named():
    # Tiny BERT at 16 x 256 tokens: every biased linear's gradient sums 4,096 rows of 64 or 128 outputs, which
    # stages on an H200. Named, the run's events are the unnamed run's plus those blocks, each taken and given
    # back inside its sum; unnamed, none.
    from collections import Counter

    from conftest import TINY_BERT

    from hf_memfit.estimator.reduction_staging import sum_staging_requests
    from hf_memfit.estimator.run_of_shapes import run_of_shapes, trace_run
    from hf_memfit.models.spec import ModelSpec
    from hf_memfit.settings import TrainSettings

    spec = ModelSpec.from_config("tiny-bert", TINY_BERT)
    base = TrainSettings(batch_size=16, seq_len=256, device="cuda", mode="exact", precision="bf16-mixed").validate(spec)
    named = base.replace(gpu="h200")
    shapes = [(256, None), (256, None)]
    plain_events, named_events = trace_run(spec, base, shapes)[0], trace_run(spec, named, shapes)[0]
    extra = Counter(n for i, n in named_events if i > 0) - Counter(n for i, n in plain_events if i > 0)
    hidden, intermediate = TINY_BERT["hidden_size"], TINY_BERT["intermediate_size"]
    blocks = {outputs: sum_staging_requests((4096, outputs), [0], 2, 132, 2048)[1][0] for outputs in (hidden, intermediate)}
    assert blocks[intermediate][0] == 8 * 4096 * intermediate  # 8 B x rows x outputs at these sizes (staging.json)
    staged = {size for requests in blocks.values() for size in requests} | {512}  # semaphores round to 512
    assert extra and set(extra) <= {-(-size // 512) * 512 for size in staged}
    assert extra[blocks[intermediate][0]] == TINY_BERT["num_hidden_layers"] * len(shapes)  # one per layer's MLP
    run = run_of_shapes(spec, named, min_seq_len=128, micro_batches=3, needed=False)
    assert run.reduction_staging_gpu == "H200"
    assert run_of_shapes(spec, base, min_seq_len=128, micro_batches=3, needed=False).reduction_staging_gpu is None

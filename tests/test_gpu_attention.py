"""Exact mode's SDPA stand-in does what CUDA does: autocast's cast, and the flash kernel's own GQA.

Found on an H200 (docs/benchmarks.md section 19): the stand-in kept RoPE's fp32 q and k in fp32 and expanded
k and v to every head, +9.5% to +11% on a tiny Llama whose SDPA is now within 2%.
"""

import pytest
import torch

from hf_memfit.estimator.fake_patches import gpu_sdpa


def _qkv(heads=4, kv_heads=2, seq=8, head_dim=16):
    q = torch.randn(1, heads, seq, head_dim, requires_grad=True)  # fp32, as RoPE leaves q and k under *-mixed
    k = torch.randn(1, kv_heads, seq, head_dim, requires_grad=True)
    v = torch.randn(1, kv_heads, seq, head_dim, dtype=torch.bfloat16, requires_grad=True)  # v_proj's output
    return q, k, v


def test_under_autocast_the_kernel_sees_half_precision_and_gqa_as_it_is():
    q, k, v = _qkv()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gpu_sdpa(flash_supported=True)(q, k, v, is_causal=True, enable_gqa=True)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 4, 8, 16)
    saved_q, saved_k, saved_v, saved_out, lse = out.grad_fn.saved_tensors
    assert (saved_q.dtype, saved_k.dtype, saved_v.dtype) == (torch.bfloat16,) * 3  # autocast's copies
    assert saved_k.shape[1] == saved_v.shape[1] == 2  # the KV heads, not expanded: flash runs GQA natively
    assert lse.dtype == torch.float32 and lse.shape == (1, 4, 8)
    out.float().sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("flash_supported", [False, True])
def test_without_flash_or_with_a_mask_the_kernel_sees_every_head(flash_supported):
    q, k, v = _qkv()
    mask = None if not flash_supported else torch.zeros(1, 1, 8, 8)  # a mask rules flash out
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gpu_sdpa(flash_supported=flash_supported)(q, k, v, attn_mask=mask)
    node = out.grad_fn
    while node is not None and not node.name().startswith("GpuAttentionMemory"):
        node = node.next_functions[0][0]
    saved_q, saved_k, saved_v, _, lse = node.saved_tensors
    assert saved_k.shape[1] == saved_v.shape[1] == 4  # memory-efficient: k and v expanded to the query heads
    assert lse.shape[-1] == 32  # memory-efficient pads the logsumexp to a multiple of 32


def test_without_autocast_nothing_is_cast():
    q, k, v = _qkv()
    out = gpu_sdpa(flash_supported=True)(q, k, v.float(), is_causal=True)
    assert out.dtype == torch.float32  # fp32: not the flash kernel (half precision only)


def test_cross_entropy_of_half_logits_runs_as_cuda_autocast_decomposes_it():
    # CPU autocast casts cross_entropy's logits to fp32 as a whole; CUDA autocast keeps log_softmax in the logits'
    # dtype and gives nll_loss an fp32 copy (Whisper's H100 snapshot, docs/benchmarks.md section 21). Under the
    # trace's policy the storages made are the GPU's: the bf16 log_softmax output, then its fp32 copy; in backward
    # the fp32 gradient, its bf16 cast and the bf16 log_softmax backward.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hf_memfit.estimator.fake_patches import cuda_autocast_policy
    from hf_memfit.estimator.trace import StorageTracker

    n, vocab = 64, 1000
    tracker = StorageTracker()
    with FakeTensorMode(allow_non_fake_inputs=True), tracker, cuda_autocast_policy():
        logits = torch.randn(n, vocab, dtype=torch.bfloat16, requires_grad=True)
        target = torch.randint(0, vocab, (n,))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.CrossEntropyLoss()(logits, target)
        made_forward = len(tracker.allocations)
        loss.backward()
    half, single = n * vocab * 2, n * vocab * 4
    forward = [a.nbytes for a in tracker.allocations[:made_forward] if a.nbytes >= half]
    backward = [a.nbytes for a in tracker.allocations[made_forward:] if a.nbytes >= half]
    assert forward == [half, half, single]  # logits, log_softmax in bf16, nll_loss's fp32 copy (no fp32 logits)
    assert backward == [single, half, half]
    assert loss.dtype == torch.float32

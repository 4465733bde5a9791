"""The trace's fake tensor mode keys its dispatch cache its own way (`estimator/trace_mode.py`): the keys must tell
apart every argument that can change an op's output, and a cached output must be the one a fresh dispatch makes."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, _CacheKeyState
from transformers import AutoConfig

from hf_memfit.estimator.exact import trace_step
from hf_memfit.estimator.trace_mode import MISS, TraceFakeTensorMode
from hf_memfit.models.depths import config_with_depths, real_depths
from hf_memfit.models.spec import ModelSpec
from hf_memfit.settings import TrainSettings

from conftest import TINY_LLAMA
from test_vlm import QWEN25VL


def _key(mode, func, *args, **kwargs):
    return mode._cache_key(_CacheKeyState(mode.shape_env), func, args, kwargs)


def test_tensor_keys_differ_wherever_the_output_can():
    mode = TraceFakeTensorMode()
    with mode:
        base = torch.empty(6, 6)
        add = torch.ops.aten.add.Tensor
        same = _key(mode, add, base, torch.empty(6, 6))
        assert same == _key(mode, add, torch.empty(6, 6), torch.empty(6, 6))  # a cache hit
        different = {
            "stride": _key(mode, add, base.t(), base),
            "storage offset": _key(mode, add, torch.empty(7, 6)[1:], base),
            "storage size": _key(mode, add, torch.empty(7, 6)[:6], base),
            "dtype": _key(mode, add, base.to(torch.bfloat16), base),
            "requires_grad": _key(mode, add, torch.empty(6, 6, requires_grad=True), base),
            "device": _key(mode, add, torch.empty(6, 6, device="cuda"), base),
            "scalar type": _key(mode, torch.ops.aten.add.Scalar, base, 1.0),
        }
        complex_ = torch.empty(6, 6, dtype=torch.complex64)
        conj = _key(mode, torch.ops.aten.add.Tensor, complex_.conj(), complex_)
    assert _key_differs(same, different.values())
    assert _key(mode, torch.ops.aten.add.Scalar, base, 1) != different["scalar type"]  # 1 and 1.0 hash alike
    with mode:
        assert conj != _key(mode, torch.ops.aten.add.Tensor, complex_, complex_)


def _key_differs(reference, others) -> bool:
    keys = [reference, *others]
    return len(set(keys)) == len(keys)


@pytest.mark.parametrize("name,config,changes", [
    ("llama", TINY_LLAMA, dict(precision="bf16-mixed", gradient_checkpointing=True, lora_r=4)),
    ("qwen2.5-vl", AutoConfig.for_model(**QWEN25VL).to_dict(),
     dict(task="image-text-to-text", image_size=112, gradient_accumulation_steps=2)),
])
def test_every_cached_output_is_the_one_a_fresh_dispatch_makes(monkeypatch, tmp_path, name, config, changes):
    """torch's own cross-check: each cache hit is dispatched again without the cache and compared (a key that
    matched a different op's arguments would return a tensor of the wrong shape, stride or dtype, and raise)."""
    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path))
    spec = ModelSpec.from_config(f"tiny-{name}", config)
    settings = TrainSettings(batch_size=2, seq_len=16, device="cuda", gpu="A100", mode="exact",
                             **changes).validate(spec)
    depths = real_depths(spec)
    config = config_with_depths(spec, depths)
    plain = trace_step(config, settings, depths)
    hits = FakeTensorMode.cache_hits
    with torch._dynamo.config.patch(fake_tensor_cache_crosscheck_enabled=True):
        checked = trace_step(config, settings, depths)
    assert FakeTensorMode.cache_hits - hits > 1000
    assert checked.peak_bytes == plain.peak_bytes


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_output_made_on_a_cache_hit_is_the_tensor_torch_makes(device):
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    mode = TraceFakeTensorMode()
    with mode:
        made_by_torch_device = torch.empty(2, 3, device=device).device
    with in_kernel_invocation_manager(mode):
        elem = torch.empty_strided((2, 3), (1, 2), dtype=torch.bfloat16, device="meta", requires_grad=True)
    fast = mode.fake_tensor(elem, made_by_torch_device)
    torchs = FakeTensor(mode, elem, made_by_torch_device)
    assert fast.__dict__ == torchs.__dict__
    assert torch._C._dispatch_keys(fast) == torch._C._dispatch_keys(torchs)
    assert (fast.shape, fast.stride(), fast.dtype, fast.requires_grad, fast.device) == \
        (torchs.shape, torchs.stride(), torchs.dtype, torchs.requires_grad, torchs.device)
    assert _data_ptr(fast) == _data_ptr(torchs)  # the same guard on a fake tensor's (absent) data


def _data_ptr(tensor):
    """What asking for the data pointer gives: its value, or its error (torch warns once, the first time)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return tensor.data_ptr()
        except RuntimeError as error:
            return type(error)


def test_unsafe_view_is_cached_and_its_output_shares_its_input_s_storage_as_the_kernel_s_does():
    """torch's fake cache bypasses `_unsafe_view` (its hit path aliases only `is_view` ops); the trace's mode caches
    it, and a hit's output is on the input's storage at the input's offset, like the one the kernel made on the miss."""
    mode = TraceFakeTensorMode()
    with mode:
        base = torch.empty(4, 6, 8)
        outputs = []
        for rows in (base, base, base[1:], base[1:]):
            hits, bypasses = FakeTensorMode.cache_hits, sum(FakeTensorMode.cache_bypasses.values())
            out = torch.ops.aten._unsafe_view(rows, [-1, 8] if rows is base else [18, 8])
            bypassed = sum(FakeTensorMode.cache_bypasses.values()) - bypasses
            outputs.append((out, FakeTensorMode.cache_hits - hits, bypassed))
    (miss, miss_hits, miss_bypassed), (hit, hit_hits, _), (sliced_miss, _, _), (sliced_hit, sliced_hits, _) = outputs
    assert (miss_hits, miss_bypassed, hit_hits, sliced_hits) == (0, 0, 1, 1)
    for out in (miss, hit, sliced_miss, sliced_hit):
        assert out.untyped_storage()._cdata == base.untyped_storage()._cdata and out._base is None
    assert (hit.shape, hit.stride(), hit.storage_offset()) == (miss.shape, miss.stride(), 0)
    assert sliced_hit.storage_offset() == sliced_miss.storage_offset() == 48


@pytest.mark.parametrize("name,config,changes", [
    ("llama", TINY_LLAMA, dict(precision="bf16-mixed", gradient_checkpointing=True, lora_r=4)),
    # the image grid's values run for real (`fake_vision.runs_for_real`), the rest from the cache
    ("qwen2.5-vl", AutoConfig.for_model(**QWEN25VL).to_dict(), dict(task="image-text-to-text", image_size=112)),
])
def test_the_tracker_takes_cached_outputs_from_the_fake_mode_and_counts_the_same_bytes(monkeypatch, tmp_path, name,
                                                                                        config, changes):
    """The storage tracker asks the fake mode's cache before dispatching an op to it (`cached_output`): the same
    trace with every answer a miss (each op dispatched to the fake mode) makes the same allocations and peaks."""
    monkeypatch.setenv("HF_MEMFIT_CACHE", str(tmp_path))
    spec = ModelSpec.from_config(f"tiny-{name}", config)
    settings = TrainSettings(batch_size=2, seq_len=16, device="cuda", gpu="A100", mode="exact",
                             **changes).validate(spec)
    depths = real_depths(spec)
    traced_config = config_with_depths(spec, depths)
    answered = []
    cached_output = TraceFakeTensorMode.cached_output

    def counted(mode, func, args, kwargs):
        out = cached_output(mode, func, args, kwargs)
        answered.append(out is not MISS)
        return out

    monkeypatch.setattr(TraceFakeTensorMode, "cached_output", counted)
    trace_step(traced_config, settings, depths)  # the cache is warm from here on
    answered.clear()
    shortcut = trace_step(traced_config, settings, depths)
    assert sum(answered) > 1000 and sum(answered) > 0.9 * len(answered)
    monkeypatch.setattr(TraceFakeTensorMode, "cached_output", lambda mode, func, args, kwargs: MISS)
    dispatched = trace_step(traced_config, settings, depths)
    assert shortcut.peak_bytes == dispatched.peak_bytes
    assert shortcut.tracker.region_peaks == dispatched.tracker.region_peaks
    # Every allocation and release (their order varies between any two traces: the tracker's weakref finalizers run
    # as Python frees, and a few same-sized tensors go in either order; the region peaks above do not vary)
    assert sorted(shortcut.tracker.events) == sorted(dispatched.tracker.events)


def test_an_op_reaches_a_dispatch_mode_beneath_the_tracker():
    """The tracker answers from the fake mode's cache only where the fake mode is the next mode: a mode between
    them (entered before the tracker) still sees every op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_memfit.estimator.trace import StorageTracker

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    fake_mode, tracker, between = TraceFakeTensorMode(), StorageTracker(), Seen()
    with fake_mode:
        x = torch.empty(8, 8)
        (x @ x).relu()  # cached
        with between, tracker:
            (x @ x).relu()
    assert torch.ops.aten.mm.default in between.ops and torch.ops.aten.relu.default in between.ops

"""The trace's fake tensor mode, and the base of the dispatch mode above it (`trace.StorageTracker`): both see every op
of a traced step, so what each does per op is the trace's time."""

from __future__ import annotations

import torch
from torch._subclasses._fake_tensor_utils import _CacheKeyState
from torch._subclasses.fake_tensor import (
    _DISPATCH_HANDLE_DIRECTLY,
    _DISPATCH_META_HANDLERS,
    FakeTensor,
    FakeTensorConfig,
    FakeTensorMode,
    _BypassDispatchCache,
    _DispatchCacheValidEntry,
)
from torch.utils._python_dispatch import TorchDispatchMode

# Asked by autograd for every gradient and by fused optimizers for every state: two thirds of a VLM step's ops.
DEVICE = torch.ops.prim.device.default
# `reshape`'s and `matmul`'s copy-free output: a view of its input's storage that autograd does not track as a view
# (so `is_view` is False). torch's fake cache never caches it; `TraceFakeTensorMode` does.
UNSAFE_VIEW = torch.ops.aten._unsafe_view.default


class TraceMode(TorchDispatchMode):
    """A dispatch mode of the trace (the storage tracker). torch wraps every mode's `__torch_dispatch__` in
    `torch._disable_dynamo`, a switch of the frame evaluator on every op, unless the mode opts out; nothing is
    compiled in a trace."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


def fake_device(func, args) -> torch.device | None:
    """A fake tensor's device where `func` is `prim.device`, as the fake mode's own handler answers it
    (`fake_tensor._device_handler`) without dispatching there; else None. A trace of Gemma-3's step asks 79,029
    times, 7% of its time."""
    if func is DEVICE and isinstance(args[0], FakeTensor) and not args[0].fake_mode.in_kernel_invocation:
        return args[0].fake_device
    return None


# Argument types whose value is their whole cache key (with the type: 1, 1.0 and True hash alike but make
# different dtypes), as `FakeTensorMode._prep_args_for_hash` keys them.
_SCALARS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})
MISS = object()  # `cached_output`: no cached output
_OWN_KEY = object()  # in each tensor key made here: no key of torch's own format can equal one of these


class TraceFakeTensorMode(FakeTensorMode):
    """`FakeTensorMode` with a cheaper key for its dispatch cache, which answers almost every op of a trace
    (53,672 of 57,374 in a cold SmolVLM plan's traces), and a cheaper output on a hit.

    The key. torch's key of a fake tensor argument builds a `TensorMetadata` dataclass and flattens its 17 fields
    one by one, with its sparse, symbolic and memory-format checks; under cProfile that was a third of a VLM
    trace's dispatch time.

    A dense fake tensor of this mode with concrete sizes is keyed here by a tuple of what the output can depend
    on: dtype, shape, stride, device, storage offset and size, requires_grad, and the conj / neg / inference /
    quantized bits. torch's `memory_format` field is left out because shape and stride determine it. Every other
    argument (a symbolic size, a sparse or foreign tensor, a callable) is keyed by torch's own code, which also
    raises the same cache bypasses. A key is compared only with keys of the same op (the op leads it), so
    these keys are as discriminating as torch's, and an op's output is unchanged: cached or computed, it is the
    same tensor (`benchmarks/trace_identity.py`).

    The output. On a hit torch makes the output tensor through `FakeTensor.__new__`, which checks its arguments,
    normalizes the device and sets 20 attributes one by one, five of them through memo descriptors (three
    attributes each); with the key above that was the largest part of a Qwen2.5-VL trace's dispatch. Here a
    fresh (not in-place) output with concrete sizes is made as `__new__` makes it, `_make_subclass` with the
    fake device's dispatch keys and the mutable-data-pointer guard, and its attributes are copied from a fake
    tensor torch's own constructor made on that device (`_attribute_template`), so they are exactly torch's.
    `tests/test_trace_mode.py` compares the two, attributes and dispatch keys."""

    # torch wraps `FakeTensorMode.__torch_dispatch__` in `torch._disable_dynamo` (see `TraceMode`): a switch of the
    # frame evaluator on every op. This mode takes the function inside the wrapper (still counted by torch's
    # `@count`) and opts out, as the trace's other modes do.
    if FakeTensorMode._should_skip_dynamo():
        __torch_dispatch__ = getattr(FakeTensorMode.__torch_dispatch__, "__wrapped__",
                                     FakeTensorMode.__torch_dispatch__)

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._attribute_templates: dict[torch.device, dict] = {}  # `_attribute_template`'s, by device

    def cached_output(self, func, args, kwargs):
        """The op's output from the dispatch cache where it holds one, else `MISS`: what this mode's dispatch returns on
        a hit, asked by the trace's storage tracker, the mode above this one, instead of dispatching the op to it.

        Dispatched, an op goes from the tracker back through torch's dispatcher and mode stack into
        `FakeTensorMode.__torch_dispatch__`, `dispatch` (which enters `no_dispatch()` to log it) and
        `_cached_dispatch_impl`, then makes the same key and reads the same cache entry as here. A trace answers
        about 95% of its ops from the cache; what skipping that round trip saves is measured in docs/benchmarks.md,
        section 15 (*The tracker answers cached ops without a second dispatch*). Here the key is torch's own
        (`_cache_key`, with this mode's tensor keys), and so is the output (`_output_from_cache_entry`). Everything
        else takes torch's path: a miss, a bypass or a cached bypass (`MISS`), symbolic sizes, torch's cross-check
        of cached outputs, and the ops `dispatch` answers before its cache (`_DISPATCH_META_HANDLERS`,
        `_DISPATCH_HANDLE_DIRECTLY`)."""
        if (self.shape_env is not None or not self.cache_enabled or self.cache_crosscheck_enabled
                or FakeTensorConfig.debug or func in _DISPATCH_META_HANDLERS or func in _DISPATCH_HANDLE_DIRECTLY):
            return MISS
        state = _CacheKeyState(None)
        try:
            key = self._cache_key(state, func, args, kwargs)
        except _BypassDispatchCache:
            return MISS
        entry = FakeTensorMode.cache.get(key)
        if type(entry) is not _DispatchCacheValidEntry or state.cache_on_shape_env():
            return MISS
        FakeTensorMode.cache_hits += 1
        return self._output_from_cache_entry(state, entry, key, func, args)

    def _get_output_tensor_from_cache_entry(self, state, entry, key, func, args):
        metadata = entry.metadata
        if metadata is None or entry.inplace_idx is not None or self.shape_env is not None or FakeTensorConfig.debug:
            # torch's own: an in-place op's output is its argument; symbolic sizes; TORCH_FAKE_TENSOR_DEBUG's
            # construction tracebacks
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        # A meta tensor made with the trace's modes off: torch enters its kernel-invocation context here (the meta
        # dispatch key included, for kernels on fake tensors), which a tensor made on the meta device does not need.
        with torch._C._DisableTorchDispatch():
            empty = torch.empty_strided(metadata.shape, metadata.stride, dtype=metadata.dtype,
                                        layout=metadata.layout, device="meta", requires_grad=metadata.requires_grad)
            if metadata.is_conj:
                torch._C._set_conj(empty, True)
            if metadata.is_neg:
                torch._C._set_neg(empty, True)
            if func is UNSAFE_VIEW or (isinstance(func, torch._ops.OpOverload) and func.is_view):
                # the output shares its input's storage (`_unsafe_view`'s one tensor argument is its first)
                view_of = args[0] if entry.view_idx is None else args[entry.view_idx]
                empty.set_(view_of.untyped_storage(), metadata.storage_offset, metadata.shape, metadata.stride)
        return self.fake_tensor(empty, metadata.device)

    def _validate_cache_key(self, func, args, kwargs) -> None:
        """torch's checks, but `_unsafe_view` is cached: a hit makes its output on the input's storage, as the kernel
        does (`_get_output_tensor_from_cache_entry`). torch bypasses its cache for it because its own hit path
        aliases only `is_view` ops; a step runs it wherever `matmul` folds a batch (a Jamba fit's trace: ~1,000 per
        job, each a full dispatch). Not with symbolic sizes or TORCH_FAKE_TENSOR_DEBUG, which take torch's path."""
        if func is UNSAFE_VIEW and self.shape_env is None and not FakeTensorConfig.debug:
            return
        super()._validate_cache_key(func, args, kwargs)

    def fake_tensor(self, elem: torch.Tensor, device: torch.device) -> FakeTensor:
        """`FakeTensor(self, elem, device)` for a meta `elem`, without `__new__`'s checks (see the class doc)."""
        template = self._attribute_template(device)
        tensor = torch.Tensor._make_subclass(FakeTensor, elem, elem.requires_grad, dispatch_device=True,
                                             device_for_backend_keys=template["_fake_device"])
        if self._allow_unsafe_data_ptr_access:
            torch._C._set_warn_deprecated_on_mutable_data_ptr(tensor)
        else:
            torch._C._set_throw_on_mutable_data_ptr(tensor)
        tensor.__dict__.update(template)
        return tensor

    def _attribute_template(self, device: torch.device) -> dict:
        """The attributes `FakeTensor.__new__` gives a fresh fake tensor of this mode on `device`."""
        if device not in self._attribute_templates:
            with torch._C._DisableTorchDispatch():
                elem = torch.empty(0, device="meta")
            self._attribute_templates[device] = dict(FakeTensor(self, elem, device).__dict__)
        return self._attribute_templates[device]

    def _prep_args_for_hash(self, result, args, state, id_hashed_objects) -> None:
        kind = type(args)
        if kind is dict:
            result.append(dict)
            result.append(len(args))
            self._prep_args_for_hash(result, tuple(args), state, id_hashed_objects)
            self._prep_args_for_hash(result, tuple(args.values()), state, id_hashed_objects)
            return
        if kind is list or kind is tuple:
            result.append(kind)
            result.append(len(args))
        for arg in args:
            arg_type = type(arg)
            if arg_type in _SCALARS:
                result.append(arg_type)
                result.append(arg)
            elif arg_type is FakeTensor and (key := self._tensor_key(arg)) is not None:
                result.append(key)
            elif arg_type is list or arg_type is tuple:
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            else:
                super()._prep_args_for_hash(result, (arg,), state, id_hashed_objects)

    def _tensor_key(self, tensor: FakeTensor) -> tuple | None:
        """The cache key of a dense fake tensor of this mode with concrete sizes; None: torch's key instead."""
        if tensor.fake_mode is not self:
            raise _BypassDispatchCache("not our fake")
        if tensor.constant is not None:
            raise _BypassDispatchCache("constant attribute")
        if tensor.layout is not torch.strided or tensor._has_symbolic_sizes_strides:
            return None
        return (_OWN_KEY, tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.device, tensor.storage_offset(),
                tensor.untyped_storage().nbytes(), tensor.requires_grad, tensor.is_conj(), tensor.is_neg(),
                tensor.is_inference(), tensor.is_quantized)

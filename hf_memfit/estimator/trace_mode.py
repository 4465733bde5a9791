"""What the trace's two dispatch modes share (`trace.StorageTracker`, `fake_vision.RealIntegerMetadata`): both sit
above the fake tensor mode and see every op of a traced step, so what each does per op is the trace's time."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

# Asked by autograd for every gradient and by fused optimizers for every state: two thirds of a VLM step's ops.
DEVICE = torch.ops.prim.device.default


class TraceMode(TorchDispatchMode):
    """A dispatch mode of the trace. torch wraps every mode's `__torch_dispatch__` in `torch._disable_dynamo`, a
    switch of the frame evaluator on every op, unless the mode opts out; nothing is compiled in a trace."""

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

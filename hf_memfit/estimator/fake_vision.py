"""Integer metadata as real tensors in the fake trace: what lets Qwen2-VL / Qwen2.5-VL's vision code run.

Their step reads the image grid's values (`image_grid_thw`): per-image sequence lengths (`cu_seqlens`,
`.tolist()` for the attention's split), rotary positions, the window index (a boolean selection), the LM's
3-D positions (`get_rope_index`, a loop over `mm_token_type_ids.tolist()`). transformers says so itself
(`transformers/vision_utils.py`: "data-dependent tensors ... untraceable ops (`repeat_interleave`,
`.tolist()`, `nonzero()`, loops)"). Fake tensors have shapes but no values, so these calls fail.

The values are small integers computed from the batch's ids and grid, never from the weights or the
activations. In a trace whose storage tracker has `real_integers` set (`trace.StorageTracker`, which asks
`runs_for_real` of every op) they are real tensors and the real code runs on them:

- a factory op that makes integers or bools (`randint`, `zeros(dtype=long)`, ...) or an `arange` runs for real;
- an op whose tensor arguments are all real tensors runs for real (`grid.prod(-1)`, `cu[1:] - cu[:-1]`,
  `ids == image_token`, `torch.tensor([...])`'s `lift_fresh`), so what is computed from real values is real;
- an op that mixes a real tensor with a fake one (an embedding lookup, rotary angles from real positions,
  the window permutation of fake activations) is the fake tensor mode's, which takes the real tensor as a
  constant (`FakeTensorMode(allow_non_fake_inputs=True)`): its output is fake, at the shape the values give.

Everything still passes through the storage tracker beneath the fake mode, real or fake, so each tensor is
counted once at its size, as on the GPU (where these tensors are on the device too). Float activations,
weights, gradients and optimizer states stay fake: a float factory op (`empty`, `zeros`, `randn`, no dtype
or a float one) is the fake mode's. Only the traces of models whose batch carries values the model reads
(`vision_language.reads_batch_values`) run their ops so.
"""

from __future__ import annotations

import itertools

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten

_INTEGER_DEFAULT = frozenset({"randint", "randint_like", "randperm"})  # integer outputs without a dtype argument


def _factory_dtype(func, args, kwargs) -> torch.dtype | None:
    """The dtype a factory op (no tensor arguments) makes: its `dtype`, else what torch infers from the values."""
    if kwargs.get("dtype") is not None:
        return kwargs["dtype"]
    name = func._schema.name.split("::")[-1]
    if name in _INTEGER_DEFAULT:
        return torch.int64
    if name == "arange" or name in ("full", "scalar_tensor"):
        values = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, (bool, int, float))]
        values = values if name == "arange" else values[-1:]  # full / scalar_tensor: the fill value
        if values and all(isinstance(v, bool) for v in values):
            return torch.bool
        return torch.float32 if any(isinstance(v, float) for v in values) else torch.int64
    return None  # empty / zeros / ones / rand / randn with no dtype: the default float dtype


def _integral(dtype: torch.dtype | None) -> bool:
    return dtype is not None and (dtype == torch.bool or not (dtype.is_floating_point or dtype.is_complex))


def _tensors(values):
    """The tensors among an op's arguments: aten schemas nest them in lists and tuples only (`cat`'s list, an
    optional list of indices). `tree_flatten` walked them too, at a fifth of a SmolVLM trace's time."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


def runs_for_real(func, args, kwargs) -> bool:
    """Whether `func` runs outside the fake mode (see the module doc): an integer factory op, an `arange`, or an op
    whose tensor arguments are all real."""
    seen = False
    for tensor in itertools.chain(_tensors(args), _tensors(kwargs.values())):
        if isinstance(tensor, FakeTensor) or tensor.device.type == "meta":
            return False  # the fake mode's (most ops: activations and weights are fake)
        seen = True
    # an `arange` of any dtype is positions or indices (Idefics3's patch buckets are float ones)
    return seen or func._schema.name == "aten::arange" or _integral(_factory_dtype(func, args, kwargs))

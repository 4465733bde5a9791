"""Optimizers that cannot step on fake tensors, replaced by stand-ins that allocate what the real ones do.

bitsandbytes' 8-bit kernels, GaLore's 8-bit projection, APOLLO's random seeds and norm limiter and torchao's
low-bit states each need real data somewhere in their step; only that part is replaced, and each
replacement says why. `make_traced_optimizer` builds what the Trainer would build for `settings.optim`.
"""

import contextlib

import torch

from hf_memfit.estimator import step as training
from hf_memfit.settings import TrainSettings

# --- optimizers that cannot run on fake tensors -----------------------------

class _Bnb8bitStateLayout(torch.optim.Optimizer):
    """bitsandbytes 8-bit AdamW's state layout, for fake tensors.

    bnb's step makes data-dependent calls, so under FakeTensorMode we allocate
    its state exactly as `Optimizer8bit.init_state` does (bitsandbytes 0.50):
    tensors with at least `min_8bit_size` (4096) elements get uint8 `state1`,
    `state2` and fp32 `absmax1`, `absmax2` per 256-element block; smaller ones
    keep fp32 states. On CUDA the step runs one fused kernel per tensor and
    keeps no temporaries; on the CPU (backends/cpu/ops.py) it computes in fp32
    temporaries, one tensor at a time, which `step` allocates the same way.
    """

    min_8bit_size = 4096
    block_size = 256

    def __init__(self, params, state_bits: int = 8, cuda_semantics: bool = True, thirty_two_bit: set = frozenset(),
                 **_):
        super().__init__(params, {})
        self.state_bits = state_bits
        self.cuda_semantics = cuda_semantics
        self.thirty_two_bit = thirty_two_bit  # ids of parameters with a 32-bit override (embeddings)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                eight_bit = (self.state_bits == 8 and p.numel() >= self.min_8bit_size
                             and id(p) not in self.thirty_two_bit)
                if not state:
                    if eight_bit:
                        blocks = -(-p.numel() // self.block_size)
                        state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
                        state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
                        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32)
                        state["absmax2"] = torch.zeros(blocks, dtype=torch.float32)
                    else:
                        state["state1"] = torch.zeros_like(p, dtype=torch.float32)
                        state["state2"] = torch.zeros_like(p, dtype=torch.float32)
                if not self.cuda_semantics:
                    _bnb_cpu_update_temporaries(p, eight_bit)


def _bnb_cpu_update_temporaries(p: torch.Tensor, eight_bit: bool) -> None:
    """What bitsandbytes' CPU update of one tensor allocates, and frees before the next.

    `_optimizer_update_{8bit_blockwise,32bit}_cpu` (bitsandbytes 0.50 backends/cpu/ops.py): the dequantized
    states (8-bit only), grad.float() * gnorm_scale, p.data.float() (a copy unless fp32), and
    denom = state2.sqrt() / correction2 beside its sqrt. On CUDA the kernel updates in place.
    """
    fp32 = lambda: torch.empty_like(p, dtype=torch.float32)  # noqa: E731
    temporaries = [fp32(), fp32()] if eight_bit else []
    temporaries += [fp32(), fp32(), fp32()] + ([fp32()] if p.dtype != torch.float32 else [])
    del temporaries


def _galore_8bit_kernels_as_layout(optimizer, cuda_semantics: bool) -> None:
    """Make a real `GaLoreAdamW8bit` traceable by replacing only its call into bitsandbytes' kernels.

    galore_torch's `GaLoreAdamW8bit` is bitsandbytes' `Optimizer2State`. Its `step` runs
    GaLore in torch, which fake tensors run as they are: project the gradient,
    `p.saved_data = p.data.clone()`, `p.data` and `p.grad` swapped for the low-rank
    gradient (the full gradient is released there), project back and add. bnb's own
    `init_state` makes the states (uint8 + an fp32 absmax per 256-element block, fp32
    under 4096 elements). Only `update_step`, whose kernels read the data, is replaced:
    it does what bnb's does around the kernel (contiguous copies, the step count) and
    allocates what the kernel allocates (nothing on CUDA; `_bnb_cpu_update_temporaries`
    on the CPU). The class is swapped on the instance, so the Trainer's own object,
    with its groups and (layerwise) hooks, is the one traced.
    """

    class GaLore8bitKernelsAsLayout(type(optimizer)):
        @torch.no_grad()
        def update_step(self, group, p, gindex, pindex):
            p.data = p.data.contiguous()
            p.grad = p.grad.contiguous()
            state = self.state[p]
            state["step"] += 1
            if not cuda_semantics:
                _bnb_cpu_update_temporaries(p, state["state1"].dtype == torch.uint8)

    optimizer.__class__ = GaLore8bitKernelsAsLayout


@contextlib.contextmanager
def _bnb_qmaps_made_concrete():
    """bitsandbytes' 8-bit quantization maps, made from real numbers while an optimizer is built on fake tensors.

    `Optimizer8bit.__init__` fills its two 256-entry fp32 maps with
    `functional.create_dynamic_map`, which reads values (`.tolist()`). The values are
    computed outside the fake and tracking modes; what the optimizer keeps is a tensor
    of the same size made in the fake mode, so its bytes are counted as the real ones.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    import bitsandbytes.functional as bnb_functional

    original = bnb_functional.create_dynamic_map

    def create_dynamic_map(*args, **kwargs):
        with _disable_current_modes():
            real = original(*args, **kwargs)
        return torch.empty(real.shape, dtype=real.dtype)

    bnb_functional.create_dynamic_map = create_dynamic_map
    try:
        yield
    finally:
        bnb_functional.create_dynamic_map = original


@contextlib.contextmanager
def apollo_on_fake_tensors():
    """Let APOLLO's real step run on fake tensors: its two reads of data are made concrete.

    apollo_torch 1.0.3 (apollo.py, random_projector.py) reads values twice, which a
    FakeTensor has not:
    - `next_seed` draws the projector's next seed with `torch.randint(...).tolist()`
      on a 15-element CPU tensor. It runs here outside the fake and tracking modes,
      as a real seed: a host-side int64 scratch of 120 bytes, not device memory;
    - the norm-growth limiter takes Python's `max(norm_ratio, 1.01)`, a comparison
      of a 0-d tensor. Either branch then makes the same full-size
      `scaled_grad / limiter` and a 0-d state; only whether `limiter` is a 0-d tensor
      or a float differs. The comparison is answered with the tensor (the norm grew
      by over 1%, the limiter acting).
    Everything else (the seeded Gaussian projector, the low-rank states, the scaled
    gradient) runs as it is.
    """
    import builtins

    from torch.utils._python_dispatch import _disable_current_modes

    import apollo_torch.apollo as apollo
    import apollo_torch.random_projector as projector

    original_next_seed = projector.next_seed

    def next_seed(seed, adv=projector.ADV_DEFAULT):
        with _disable_current_modes():
            return original_next_seed(seed, adv)

    def limiter_max(*args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        return tensors[0] if tensors else builtins.max(*args, **kwargs)

    projector.next_seed = next_seed
    apollo.max = limiter_max  # a module global shadows the builtin for apollo.py's code only
    try:
        yield
    finally:
        projector.next_seed = original_next_seed
        del apollo.max


def _torchao_state_layout(optimizer_cls):
    """torchao's low-bit AdamW (the class the Trainer builds), with its step replaced for fake tensors.

    torchao compiles one update per tensor (`torch.compile(single_param_adam)`),
    which cannot run under FakeTensorMode. The states are made by torchao's own
    `_new_buffer` (quantized `OptimState8bit` / `OptimState4bit`: uint8 codes, an
    fp32 scale per block and the qmap; `zeros_like(param)` for tensors it does not
    quantize), and the compiled update's fp32 buffers, measured on the CPU
    allocator (`optimizers.TORCHAO_STEP_BYTES_PER_ELEMENT`), are allocated one
    tensor at a time, as the real step does.
    """
    from torch.utils._python_dispatch import _disable_current_modes

    from hf_memfit.optimizers import TORCHAO_STEP_BYTES_PER_ELEMENT

    # The lookup tables are computed once with data-dependent ops (lru-cached Python tuples): make them
    # outside the fake and tracking modes, as any real run has before its first step.
    with _disable_current_modes():
        from torchao.optim import subclass_4bit, subclass_8bit

        for module in (subclass_8bit, subclass_4bit):
            module.get_qmap_signed()
            module.get_qmap_unsigned()

    class TorchaoStateLayout(optimizer_cls):
        @torch.no_grad()
        def step(self, closure=None):
            bits = 4 if "4bit" in optimizer_cls.__name__ else 8
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        # torch.tensor(0.0) lives on the host even when the params are on a GPU
                        with _disable_current_modes() if self.cuda_semantics else contextlib.nullcontext():
                            state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = self._new_buffer(p, True)
                        state["exp_avg_sq"] = self._new_buffer(p, False)
                    if hasattr(state["exp_avg"], "codes"):
                        scratch = torch.empty(TORCHAO_STEP_BYTES_PER_ELEMENT[bits] * p.numel(), dtype=torch.uint8)
                        del scratch

    return TorchaoStateLayout


def optimizer_state_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor holding optimizer state, the inner tensors of torchao's quantized states included."""
    out = []
    for inner in training.inner_optimizers(optimizer):
        out += _state_tensors(inner)
    return out


def _state_tensors(optimizer) -> list[torch.Tensor]:
    out = []
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                inner = [getattr(value, name) for name in getattr(value, "tensor_attrs", ())]
                out += inner or [value]
            elif hasattr(value, "ortho_matrix"):  # GaLore / APOLLO projector
                matrix = value.ortho_matrix
                out += [m for m in (matrix if isinstance(matrix, list) else [matrix]) if isinstance(m, torch.Tensor)]
    return out


def make_traced_optimizer(model, settings: TrainSettings, cuda_semantics: bool):
    optimizer = settings.optimizer
    trainable = [p for p in model.parameters() if p.requires_grad]
    if optimizer.implementation == "bnb":
        # The Trainer keeps 32-bit states for nn.Embedding weights (step.trainer_keeps_embeddings_32bit)
        embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        return _Bnb8bitStateLayout(trainable, state_bits=optimizer.state_bits, cuda_semantics=cuda_semantics,
                                   thirty_two_bit=embeddings if optimizer.state_bits == 8 else set())
    if optimizer.implementation == "torchao":
        optimizer_cls, kwargs = training.trainer_optimizer_class(settings, model)
        made = _torchao_state_layout(optimizer_cls)([g for g in training.param_groups(model) if g["params"]],
                                                    **kwargs)
        made.cuda_semantics = cuda_semantics
        return made
    with _bnb_qmaps_made_concrete() if optimizer.state_bits == 8 else contextlib.nullcontext():
        made = training.make_optimizer(model, settings, cuda_semantics=cuda_semantics)
    # Layerwise variants: one real optimizer per parameter, stepped by hooks inside backward.
    for inner in training.inner_optimizers(made):
        if optimizer.low_rank:
            # The projector is remade every `update_proj_gap` steps (GaLore's SVD, APOLLO's new Gaussian,
            # beside the old one); trace it in the measured step too, with the states already there, as
            # every 200th real step runs it.
            for group in inner.param_groups:
                if "update_proj_gap" in group:
                    group["update_proj_gap"] = 1
        if optimizer.family == "galore" and optimizer.state_bits == 8:
            _galore_8bit_kernels_as_layout(inner, cuda_semantics)
    return made


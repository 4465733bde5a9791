"""Fast mode's parameter tensors: their shapes, dtypes and trainability, from the `ModelSpec` and the settings.

Model states are exact arithmetic over these: weights in their storage dtype, gradients for trainable
tensors, optimizer states in the layout each optimizer allocates (`hf_memfit.optimizers`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hf_memfit import models
from hf_memfit.models.forward import DTYPE_BYTES
from hf_memfit.optimizers import allocated_bytes


def family_of(spec):
    """The hand-written family module (models/<family>.py) whose `Forward` fast mode runs."""
    return models.family(spec.model_type)


# ---------------------------------------------------------------------------
# Parameters: the tensors, their dtypes, and what is trainable
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamGroup:
    """`count` parameter tensors of one shape. `shape` is (rows, cols) or (numel,)."""

    shape: tuple[int, ...]
    count: int
    dtype: str
    trainable: bool
    decay: bool  # the Trainer's weight-decay group (not biases or norms)
    kind: str  # embedding | layer | other | norm | head | lora | head_copy
    module: str = ""  # the linear module's name, for the weights of linear modules

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _embedding_tables(spec) -> list[tuple[int, int, bool]]:
    """(rows, cols, decay) of every embedding-like table: the family's own list, else the token table."""
    tables = getattr(family_of(spec), "embedding_tables", None)
    return tables(spec) if tables is not None else [(spec.vocab_size, spec.hidden_size, True)]


def lora_targets(spec, settings) -> frozenset:
    if not settings.uses_lora:
        return frozenset()
    if settings.lora_target_modules is not None:
        if "all-linear" in settings.lora_target_modules:
            # peft's "all-linear": every Linear / Conv1D but the output layer.
            return frozenset(m.name for m in spec.linear_modules(settings.task, settings.num_labels)
                             if m.scope != "head")
        return frozenset(settings.lora_target_modules)
    return frozenset(spec.default_lora_target_modules())


def parameters(spec, settings, wdt: str, kbit_compute: str | None = None) -> list[ParamGroup]:
    """Every parameter tensor of the (peft-wrapped) model, in `model.parameters()` order.

    `kbit_compute`: the dtype of the 4-bit layers' weights (and biases) where peft's preparation put every
    other parameter in `wdt` (fp32).
    """
    task, labels = settings.task, settings.num_labels
    counts = spec.parameter_count(task, labels)
    linears = spec.linear_modules(task, labels)
    lora = settings.uses_lora
    base_trainable = not lora
    tied_head = task != "seq-cls" and spec.tie_word_embeddings
    params: list[ParamGroup] = []
    accounted = 0
    for rows, cols, decay in _embedding_tables(spec):
        params.append(ParamGroup((rows, cols), 1, wdt, base_trainable, decay, "embedding"))
        accounted += rows * cols
    body = [m for m in linears if m.scope != "head"]
    head = [m for m in linears if m.scope == "head"]
    for m in body:
        kind = "layer" if m.scope == "layer" else "other"
        packed = kbit_compute or wdt if m.packed else wdt
        params.append(ParamGroup((m.out_features, m.in_features), m.count, packed, base_trainable, True, kind, m.name))
        accounted += m.weight_numel * m.count
        if m.bias:
            params.append(ParamGroup((m.out_features,), m.count, packed, base_trainable, False, kind))
            accounted += m.out_features * m.count
    head_params = []
    if not tied_head:
        for m in head:
            head_params.append(ParamGroup((m.out_features, m.in_features), 1, wdt, base_trainable, True, "head", m.name))
            accounted += m.weight_numel
            if m.bias:
                head_params.append(ParamGroup((m.out_features,), 1, wdt, base_trainable, False, "head"))
                accounted += m.out_features
    # What is left is the norms' weight and bias vectors, hidden_size each.
    rest = counts["total"] - accounted
    h = spec.hidden_size
    if rest > 0:
        if rest % h == 0:
            params.append(ParamGroup((h,), rest // h, wdt, base_trainable, False, "norm"))
        else:
            params.append(ParamGroup((rest,), 1, wdt, base_trainable, False, "norm"))
    params += head_params
    if lora:
        r = settings.lora_r or 8  # peft's default rank
        targets = lora_targets(spec, settings)
        for m in linears:
            if m.name not in targets or (m.scope == "head" and task == "seq-cls"):
                continue
            params.append(ParamGroup((r, m.in_features), m.count, "f32", True, True, "lora"))
            params.append(ParamGroup((m.out_features, r), m.count, "f32", True, True, "lora"))
        if task == "seq-cls":
            # peft's SEQ_CLS task wraps the classifier in ModulesToSaveWrapper: a trainable copy.
            for p in head_params or [ParamGroup((m.out_features, m.in_features), 1, wdt, False, True, "head")
                                     for m in head]:
                params.append(ParamGroup(p.shape, p.count, p.dtype, True, p.decay, "head_copy"))
            for m in head:
                if m.bias and not head_params:
                    params.append(ParamGroup((m.out_features,), 1, wdt, True, False, "head_copy"))
    return params




def param_bytes(p: ParamGroup, cuda: bool, dtype: str | None = None) -> int:
    return p.count * allocated_bytes(p.numel, DTYPE_BYTES[dtype or p.dtype], cuda)


def optimizer_tensors(params: list[ParamGroup], settings, spec) -> list:
    """The trainable tensors as `optimizers.TensorGroup`s, in `model.parameters()` order."""
    from hf_memfit.optimizers import TensorGroup

    targets = _low_rank_targets(spec, settings)
    return [TensorGroup(p.shape, p.count, DTYPE_BYTES[p.dtype], p.decay,
                        low_rank_target=len(p.shape) == 2 and p.module in targets, embedding=p.kind == "embedding")
            for p in params if p.trainable]


def _low_rank_targets(spec, settings) -> frozenset:
    """Module names whose weights GaLore / APOLLO project: `optim_target_modules` among the nn.Linear modules.

    The Trainer (`_setup_low_rank_optimizer`) takes only `nn.Linear` modules; GPT-2's
    Conv1D layers are not, so for GPT-2 only its untied heads could be targets.
    """
    if not settings.optim_target_modules:
        return frozenset()
    linears = spec.linear_modules(settings.task, settings.num_labels)
    conv1d_body = getattr(family_of(spec), "CONV1D_BODY", False)  # GPT-2: the body's projections are Conv1D
    names = {m.name for m in linears if not (conv1d_body and m.scope != "head")}
    if settings.optim_target_modules == ("all-linear",):
        return frozenset(names)
    return frozenset(names & set(settings.optim_target_modules))


def quantizable(spec, settings) -> tuple[int, int]:
    """Linear weights bitsandbytes would pack to 4 bits (`LinearModule.packed`: the rule of
    `step.quantizable_linears`), and the largest."""
    if not settings.load_in_kbit:
        return 0, 0
    mods = [m for m in spec.linear_modules(settings.task, settings.num_labels) if m.packed]
    return sum(m.weight_numel * m.count for m in mods), max((m.weight_numel for m in mods), default=0)


def unpacked_4bit(spec) -> frozenset:
    """Names of the body's linear layers bitsandbytes leaves unpacked (T5's `wo`: its `_keep_in_fp32_modules`)."""
    return frozenset(m.name for m in spec.linear_modules() if m.scope != "head" and not m.packed)


def formulas_miss(settings) -> str:
    """Why the hand-written families' formulas do not give this step ('' when they do): it is then fitted to
    traces of itself (`parametric.py`), so fast mode still equals exact mode."""
    if settings.frozen:
        return "frozen modules, which its hand-written formulas do not model"
    if settings.lora_target_regex is not None:  # the formulas know modules by their short names only
        return "LoRA targets named by a regex over full module names, which its hand-written formulas do not read"
    if settings.load_in_8bit and settings.gradient_checkpointing:
        # bitsandbytes' int8 matmul keeps its input on the autograd context (`ctx.tensors`, not saved tensors),
        # which checkpointing does not drop: the formulas' tape has no such tensor (-6.7% on a tiny Llama on
        # the CPU, -0.6% with CUDA semantics, before this).
        return "LLM.int8() layers under checkpointing, whose kept inputs its hand-written formulas do not model"
    return ""

"""The warm-up a trace runs before the steps it measures: what it is for, and why it runs no pass where it can.

The warm-up is there to leave the optimizer's states for the measured steps (`trace.trace_step`). Where the
optimizer keeps nothing but states (`warm_up_without_a_pass`), it is the optimizer step alone, on zero gradients
of the trainable parameters: the same states, a forward and backward pass fewer (a fifth to a third of a trace).
What a forward keeps on a module for the next one is then made in the first measured step rather than before it:
Qwen2-VL's `rope_deltas`, 8 bytes a row, the one such tensor in `benchmarks/trace_identity.py`'s 55
configurations. A parameter the step gives no gradient (LLaVA's last CLIP layer: its features are the
second-to-last layer's) has no states in a real run: the measured step's first forward names it
(`check_reached`, a walk of the autograd graph) and the trace starts again without its states, and the names
are cached by what decides them (`known_without_gradient`), so the next trace of that build starts right.
Otherwise the warm-up is a step of one micro-batch of rows cut to `WARM_UP_TOKENS` (`warm_up_settings`).
"""

from hf_memfit.cache import config_key, read_cache, write_cache
from hf_memfit.settings import TrainSettings
from hf_memfit.tasks import FIXED_SEQUENCE_TASKS

# The warm-up step's rows are cut to this many tokens (decoder rows too). What the warm-up leaves behind is the
# parameters' size whatever the rows' length, and a long row's tiled compute (a TiledMLP row of 400K tokens is
# 100 shards in every layer, forward and again in backward) is not run once more for nothing. Checked
# byte-identical on 55 configurations (benchmarks/trace_identity.py, docs/benchmarks.md section 17).
WARM_UP_TOKENS = 128


def warm_up_settings(settings: TrainSettings) -> TrainSettings:
    """The warm-up step's settings: the same model, optimizer and levers, rows of at most `WARM_UP_TOKENS`.

    What the warm-up has to leave for the measured step does not depend on the rows' length: the optimizer's
    states are the trainable parameters' size, and so is every gradient a backward makes.
    """
    if settings.task in FIXED_SEQUENCE_TASKS:
        return settings  # rows of pixels or audio samples; `seq_len` is their patches / frames, made from them
    short = {name: min(value, WARM_UP_TOKENS) for name in ("seq_len", "decoder_seq_len")
             if (value := getattr(settings, name)) is not None}
    return settings.replace(**short) if short else settings


def warm_up_without_a_pass(settings: TrainSettings) -> bool:
    """Whether the warm-up can be the optimizer step alone: its states are what it leaves. Not for optimizers whose
    step runs inside the backward (layerwise) or projects the gradient (GaLore, APOLLO: the projector is made from
    the first gradient)."""
    return not settings.optimizer.layerwise and not settings.optimizer.low_rank


class StatesNeedABackward(Exception):
    """The warm-up made states for other parameters than those the measured step gives a gradient: the names of the
    trainable ones it gives none."""

    def __init__(self, names: frozenset[str]):
        super().__init__(", ".join(sorted(names)))
        self.names = names


def check_reached(trainable: dict, no_gradient: frozenset, loss) -> None:
    """Raise `StatesNeedABackward` unless the parameters the loss's graph reaches are the `trainable` ones (name ->
    parameter) but `no_gradient`: a walk of the autograd graph, so that a restart wastes a forward, not a
    backward too. It sees the parameters whose graph the forward builds: checkpointing is non-reentrant in a
    trace (`step.build_model`), so its layers' parameters are in the graph, but TiledMLP's Function runs its
    MLP's forward again in its backward and only then builds their graph, so there the gradients decide, after it."""
    reached, seen, stack = set(), set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf's gradient lands here
        if variable is not None:
            reached.add(id(variable))
        stack.extend(following for following, _ in node.next_functions)
    missing = frozenset(name for name, p in trainable.items() if id(p) not in reached)
    if missing != no_gradient:
        raise StatesNeedABackward(missing)


# What decides which trainable parameters a step gives no gradient, beside the model's config at its traced depths.
_TRAINED_FIELDS = ("task", "trainer", "lora_r", "lora_target_modules", "lora_target_regex", "load_in_4bit",
                   "load_in_8bit", "frozen", "padding_free", "reference_model")
_CACHE_KIND = "no-gradient"


def _key(config: dict, settings: TrainSettings) -> str:
    return config_key(config, {name: getattr(settings, name) for name in _TRAINED_FIELDS})


def known_without_gradient(config: dict, settings: TrainSettings) -> frozenset[str] | None:
    """The trainable parameters an earlier trace of this build found without a gradient (None: no trace found
    any). A wrong entry costs the restart it would have saved: the graph walk and the gradients still check."""
    found = read_cache(_CACHE_KIND, _key(config, settings))
    return frozenset(found["names"]) if found else None


def remember_without_gradient(config: dict, settings: TrainSettings, names: frozenset[str]) -> None:
    """Cache what a trace found (`known_without_gradient`): a plan traces each depth once per fit, in children."""
    write_cache(_CACHE_KIND, _key(config, settings), {"names": sorted(names)})

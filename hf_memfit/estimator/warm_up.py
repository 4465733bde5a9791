"""The warm-up step a trace runs before the steps it measures, where it cannot be the optimizer step alone.

Most traces warm up with the optimizer step alone, on zero gradients (`trace.trace_step`). A layerwise, GaLore or
APOLLO optimizer, or a parameter whose gradient is not what the trace expected, gets this warm-up: a step of
one micro-batch of short rows. What it is for, and why its rows are short:
"""

from hf_memfit.settings import TrainSettings
from hf_memfit.tasks import MEDIA_TASKS

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
    if settings.task in MEDIA_TASKS and settings.task != "image-text-to-text":
        return settings  # rows of pixels or audio samples; `seq_len` is their patches / frames, made from them
    short = {name: min(value, WARM_UP_TOKENS) for name in ("seq_len", "decoder_seq_len")
             if (value := getattr(settings, name)) is not None}
    return settings.replace(**short) if short else settings

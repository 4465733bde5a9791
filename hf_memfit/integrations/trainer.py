"""`MemFitTrainer`: the HF Trainer that plans its memory knobs, checks the plan, and survives an OOM.

`MemFitTrainer` is the stock `Trainer` with `MemFitMixin` (mixin.py): it plans
from the live model, data and launcher (introspect.py) before the Trainer
builds its optimizer and dataloaders, writes and restores the plan, logs the
measured peak beside the prediction, and recovers from an OOM. The TRL
trainers (`MemFitSFTTrainer`, `MemFitDPOTrainer`) are in trl.py;
`MemFitSeq2SeqTrainer` is below.
"""

from dataclasses import dataclass

from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

from hf_memfit.integrations.args import MemFitArguments, MemFitFields
from hf_memfit.integrations.introspect import fixed_layout as _fixed_layout  # noqa: F401 - kept importable from here
from hf_memfit.integrations.introspect import uses_fsdp as _uses_fsdp  # noqa: F401
from hf_memfit.integrations.mixin import (STATE_FILE, MemFitMixin, MemoryCheckCallback, PeerOutOfMemoryError,  # noqa: F401
                             PlanCheckpointCallback, is_out_of_memory)


class MemFitTrainer(MemFitMixin):
    """A drop-in `Trainer` that fits the run to `args.memory_budget`.

    Accepts `MemFitArguments` or plain `TrainingArguments` (then with the
    default budget, "auto": the GPU's free memory). The plan is kept as
    `trainer.memfit_plan` and written to `<output_dir>/memfit_plan.json` when
    training starts.
    """


@dataclass
class MemFitSeq2SeqTrainingArguments(Seq2SeqTrainingArguments, MemFitFields):
    """`Seq2SeqTrainingArguments` with the memory budget fields (`MemFitArguments`' own)."""

    def __post_init__(self):
        super().__post_init__()
        self.check_memfit_fields()


class MemFitSeq2SeqTrainer(Seq2SeqTrainer, MemFitMixin):
    """`Seq2SeqTrainer` fitted to the memory budget; the decoder is planned at the labels' real length."""


__all__ = ["MemFitArguments", "MemFitSeq2SeqTrainer", "MemFitSeq2SeqTrainingArguments", "MemFitTrainer"]

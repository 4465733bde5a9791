"""Never block training: a MemFit trainer that cannot plan its run warns once and is the plain trainer.

What hf-memfit does not model (a task it has no inputs for, a forward fake tensors cannot run, a model
transformers cannot rebuild from its config, or any failure inside the estimate) must not stop a training
script that works with the plain trainer. Only the user's own request is refused: a `memory_budget` no plan
fits in, or a memfit argument that is wrong (`MemFitError`, which `CannotEstimate` is not).
"""

import logging

from hf_memfit.errors import CannotEstimate, MemFitError
from hf_memfit.integrations.args import memfit_fields

logger = logging.getLogger("hf_memfit.integrations.mixin")


def train_unplanned(trainer, error: Exception, bound: dict) -> None:
    """Re-raise the user's own errors; otherwise warn once and run `Trainer.__init__` with the user's arguments."""
    from transformers import Trainer

    if isinstance(error, MemFitError) and not isinstance(error, CannotEstimate):
        raise error
    trainer.memfit_inputs, trainer.memfit_result, trainer.memfit_plan, trainer.memfit_overrides = \
        {"notes": []}, None, None, {}
    trainer.memfit_args = memfit_fields(bound.get("args"))
    trainer.memfit_unplanned = (str(error).strip().splitlines() or [type(error).__name__])[0]
    trainer._memfit_pending_logs = {}
    Trainer.__init__(trainer, **bound)
    if trainer.args.process_index == 0:
        logger.warning("hf-memfit cannot estimate this run (%s); training with your arguments as given, "
                       "unplanned: no memory plan, no memory check, no OOM recovery", trainer.memfit_unplanned)

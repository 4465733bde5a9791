"""The one exception type a user sees.

Everything that is the user's mistake (a bad flag, an unknown model, a budget
nothing fits in) raises `MemFitError`. The CLI prints its message on one line
and exits with code 2; the Python API lets it propagate. The message names the
argument in backticks and says what would work.
"""


class MemFitError(ValueError):
    """A problem with the user's input or request, with a one-line fix."""


class NothingFits(MemFitError):
    """A valid request that no configuration fits: the budget, not the input, is what is wrong.

    `hf-memfit plan --seq-len max` tells the two apart: a length nothing fits at is a
    point of its search, a bad flag is not.
    """


def check_all(problems: list[str]) -> None:
    """Raise one `MemFitError` listing every problem found, if there are any.

    Validators collect all problems first and report them together, so a user
    fixes a command line in one go rather than one flag per run.
    """
    if problems:
        raise MemFitError("; ".join(problems))


class CannotEstimate(MemFitError):
    """hf-memfit cannot estimate this model or step (what it does not model), though the run itself may be fine.

    The MemFit trainers catch it, warn once and train as the plain trainer would; the CLI reports it in one line.
    """

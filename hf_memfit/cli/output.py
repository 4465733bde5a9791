"""Where the CLI's results go: stdout carries hf-memfit's own output and nothing else.

Libraries imported mid-run print to stdout (DeepSpeed's logger reports its accelerator there when
transformers or bitsandbytes first import it), which broke `--json` for anyone piping it into a parser.
While a command runs, everything else printed to stdout goes to stderr; `emit` writes to the stdout the
command was started with.
"""

import contextlib
import sys

_results = None


@contextlib.contextmanager
def results_on_stdout():
    """Run a command with `sys.stdout` pointed at stderr; `emit` still reaches the original stdout."""
    global _results
    previous, _results = _results, sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _results = previous


def emit(text: str) -> None:
    """One result (a table, a JSON document, a line of `cache`'s report) on the command's stdout."""
    print(text, file=_results or sys.stdout, flush=True)

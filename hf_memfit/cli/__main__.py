"""`python -m hf_memfit.cli ...`: the same as the `hf-memfit` command."""

from hf_memfit.cli.main import run

run()

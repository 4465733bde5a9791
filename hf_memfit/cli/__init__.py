"""`hf-memfit estimate | plan | explain | cache`: the command line (`main`)."""

from hf_memfit.cli.main import main, run

__all__ = ["main", "run"]

"""`python -m hf_memfit.cli ...`: the same as the `hf-memfit` command."""

import sys

from hf_memfit.cli.main import main

sys.exit(main())

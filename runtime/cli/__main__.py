"""`python -m strata_runtime.cli`: the `strata` command."""

import sys

from strata_runtime.cli.main import main

sys.exit(main())

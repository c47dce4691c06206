"""`python -m fxpar ...`: the `fxpar` command line (`fxpar.tools.cli`)."""

import sys

from fxpar.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""`python -m fxpar ...`: the `fxpar` command line (`fxpar.cli`)."""

import sys

from fxpar.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m bsmm``: the command line (:mod:`bsmm.cli.main`)."""

import sys

from bsmm.cli.main import main

if __name__ == "__main__":
    sys.exit(main())

"""`python -m blocktune.tuner.cli`: the `blocktune` command."""

import sys

from blocktune.tuner.cli import main

if __name__ == "__main__":  # worker processes started by spawn import this module too
    sys.exit(main())

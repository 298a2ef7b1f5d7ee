"""`python -m blocktune.tuner.cli`: the `blocktune` command."""

import sys

from blocktune.tuner.cli import main

sys.exit(main())

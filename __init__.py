"""blocktune: workload-adaptive block-size tuning for paged KV caches."""

import sys
from pathlib import Path

__version__ = "0.1.0"

# This folder is the package. Python started in it (`python -m`, `python -c`, `python -m
# pytest`) has it on its path, where the subpackages pass for top-level modules: `kernels`
# then shadows the Hugging Face package of that name, which transformers imports when it loads
# a tokenizer or a model. Imported as `blocktune`, the package needs no such entry: drop it.
_FOLDER = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _FOLDER]

"""Pure compute: paged attention and KV cache operations (no state, nothing of ours imported).

This folder is `blocktune.kernels`. Python started in the repository's root (`python -c`,
`python -m`, a notebook kernel) has the root on its path, where this folder passes for a
top-level package named `kernels`: the name of the Hugging Face package that transformers
imports with its models. Imported under that name, this module steps aside: it loads the
installed `kernels` from the rest of the path into its own place in `sys.modules`, so that
`import transformers` and its models work from the root. With no such package installed it
stays what it is: transformers, which imports a `kernels` it finds no metadata of to ask its
version, finds none here and counts the package as absent.
"""

import sys
from importlib.machinery import PathFinder
from importlib.util import module_from_spec
from pathlib import Path

__all__ = ["is_power_of_two"]


def is_power_of_two(value: object) -> bool:
    """Whether `value` is a positive integer power of two (1, 2, 4, ...); bools are not."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value > 0
        and not value & (value - 1)
    )


def _load_installed_kernels() -> None:
    """Put the `kernels` package found on the path without the repository root in the place
    of this module, imported as top-level `kernels` from the root (none found: leave it)."""
    root = Path(__file__).resolve().parent.parent
    path = [entry for entry in sys.path if Path(entry or ".").resolve() != root]
    spec = PathFinder.find_spec("kernels", path)
    if spec is None or spec.origin is None:
        return
    module = module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _load_installed_kernels()

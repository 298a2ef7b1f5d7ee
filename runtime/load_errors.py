"""The errors of reading a model for serving: a source, config, checkpoint or tokenizer
that cannot be loaded, or an option the model code does not implement.

A module of their own, below everything that raises them: the model code reads a
config (`ModelConfig.from_hf_dict`), the tokenizer reads its files, and the loader
(`runtime.loading`), which imports both, reads the rest.
"""

from __future__ import annotations

__all__ = ["ModelLoadError", "UnsupportedModelError"]


class ModelLoadError(ValueError):
    """A model directory or config that cannot be loaded (names the file and the problem)."""


class UnsupportedModelError(ModelLoadError):
    """A checkpoint whose architecture or option this model code does not implement
    (names the file and the key)."""

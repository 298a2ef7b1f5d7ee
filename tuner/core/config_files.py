"""Load a YAML file into a frozen pydantic model, reporting every problem at once.

`yaml.safe_load` reads the file, the model validates it (unknown keys are the
model's business: ours forbid them), and each pydantic error becomes one line
``FILE:LINE: key.path: message (got VALUE)``. The line comes from the YAML node
tree, so a problem points at the key the user has to fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

__all__ = ["ConfigError", "error_message", "format_location", "load_yaml_model"]

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A configuration file that cannot be used; `problems` holds one line per problem."""

    def __init__(self, path: Path | str, problems: Sequence[str]) -> None:
        self.path = Path(path)
        self.problems = tuple(problems)
        super().__init__("\n".join(self.problems))


def format_location(loc: Sequence[str | int]) -> str:
    """A pydantic location as a key path: ``window.capacity``, ``candidates[2]``."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text or "(top level)"


def _line_of(node: yaml.Node | None, loc: Sequence[str | int]) -> int | None:
    """The 1-based line of the deepest key (or list item) of `loc` present in the YAML tree."""
    line = None if node is None else node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            found = [(k, v) for k, v in node.value if str(k.value) == str(part)]
            if not found:
                break
            key, node = found[0]
            line = key.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if not 0 <= part < len(node.value):
                break
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def error_message(error: dict[str, Any]) -> str:
    """The message of one pydantic error (an entry of `ValidationError.errors()`), naming
    the value it got unless the message already does."""
    value_error = error["type"] == "value_error"
    message = str(error["ctx"]["error"]) if value_error else error["msg"]
    value = error.get("input")
    # Our own validators name the value in their message already.
    named = value_error or error["type"] == "missing"
    if not named and isinstance(value, str | int | float | bool):
        message += f" (got {value!r})"
    return message


def load_yaml_model(path: Path | str, model: type[M], *, context: dict | None = None) -> M:
    """Read `path` with `yaml.safe_load` and validate it as `model`; raise `ConfigError`.

    `context` reaches the model's validators as pydantic's validation context
    (for example the folder that relative paths in the file start at).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(path, [f"{path}: cannot read the file: {exc.strerror}"]) from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(path, [f"{where}: not valid YAML: {problem}"]) from None
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise ConfigError(path, [f"{path}:1: expected a mapping of keys at the top, got {kind}"])
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            line = _line_of(root, error["loc"])
            where = f"{path}:{line}" if line is not None else str(path)
            problems.append(f"{where}: {format_location(error['loc'])}: {error_message(error)}")
        raise ConfigError(path, problems) from None

"""Load a YAML file into a frozen pydantic model, reporting every problem at once.

The file must be UTF-8 text. YAML is parsed once into its node tree (which
knows each key's line) and built from it with the safe loader's types; a key
that appears twice in one mapping is a problem naming both lines, since the
last one would silently win. The model validates the data (unknown keys are
the model's business: ours forbid them), and each pydantic error becomes one
line ``FILE:LINE: key.path: message (got VALUE)`` pointing at the key the user
has to fix. At most `MAX_PROBLEMS` lines are listed, then ``... and N more``,
and the work is linear in the size of the file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

__all__ = [
    "CLIP_CHARS",
    "MAX_PROBLEMS",
    "ConfigError",
    "clip",
    "error_message",
    "format_location",
    "load_yaml_model",
]

M = TypeVar("M", bound=BaseModel)
MAX_PROBLEMS = 20
CLIP_CHARS = 80  # the most characters of a value a message echoes
MESSAGE_CHARS = 400  # the most characters of a validator's message (it may name the value)
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class ConfigError(ValueError):
    """A configuration file that cannot be used; `problems` holds one line per problem."""

    def __init__(self, path: Path | str, problems: Sequence[str]) -> None:
        self.path = Path(path)
        self.problems = tuple(problems)
        super().__init__("\n".join(self.problems))


def clip(text: str, limit: int = CLIP_CHARS) -> str:
    """`text` cut to its first `limit` characters and "… (N more)" when longer."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more)"


def format_location(loc: Sequence[str | int]) -> str:
    """A pydantic location as a key path: ``window.capacity``, ``candidates[2]`` (a long
    key cut by `clip`)."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{clip(str(part))}" if text else clip(str(part))
    return text or "(top level)"


class _NodeTree:
    """The YAML node tree of one file: the keys of every mapping (a repeated key's last
    occurrence, as in the loaded data) and the keys that repeat."""

    def __init__(self, root: yaml.Node) -> None:
        self.root = root
        self._keys: dict[int, dict[str, tuple[yaml.Node, yaml.Node]]] = {}
        self.repeats: list[tuple[list[str | int], yaml.Node, yaml.Node]] = []
        seen: set[int] = set()
        stack: list[tuple[yaml.Node, list[str | int]]] = [(root, [])]
        while stack:  # no recursion: nesting depth is bounded only by the parser
            node, loc = stack.pop()
            if id(node) in seen:  # an alias: walked where its anchor is
                continue
            seen.add(id(node))
            if isinstance(node, yaml.MappingNode):
                keys = self._keys[id(node)] = {}
                for key, value in node.value:
                    name = str(key.value)
                    if name in keys:
                        self.repeats.append(([*loc, name], keys[name][0], key))
                    keys[name] = (key, value)
                    stack.append((value, [*loc, name]))
            elif isinstance(node, yaml.SequenceNode):
                stack.extend((item, [*loc, i]) for i, item in enumerate(node.value))

    def line_of(self, loc: Sequence[str | int]) -> int:
        """The 1-based line of the deepest key (or list item) of `loc` present in the tree."""
        node = self.root
        line = node.start_mark.line + 1
        for part in loc:
            if isinstance(node, yaml.MappingNode) and str(part) in self._keys[id(node)]:
                key, node = self._keys[id(node)][str(part)]
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
    """One pydantic error as a line's message, naming the value it got (cut by `clip`)."""
    value_error = error["type"] == "value_error"
    message = str(error["ctx"]["error"]) if value_error else error["msg"]
    value = error.get("input")
    # Our own validators name the value in their message already.
    named = value_error or error["type"] == "missing"
    if not named and isinstance(value, str | int | float | bool):
        message += f" (got {clip(repr(value))})"
    return clip(message, MESSAGE_CHARS)


def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(path, [f"{path}: cannot read the file: {exc.strerror}"]) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        byte = f"byte {exc.start} is {data[exc.start]:#04x}"
        raise ConfigError(path, [f"{path}: not UTF-8 text ({byte}); save it as UTF-8"]) from None


def _parse(path: Path, text: str) -> tuple[yaml.Node | None, object]:
    """The node tree and the data built from it (None for an empty file)."""
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        return root, None if root is None else loader.construct_document(root)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(path, [f"{where}: not valid YAML: {problem}"]) from None
    except RecursionError:
        raise ConfigError(path, [f"{path}: nested too deeply to read"]) from None
    finally:
        loader.dispose()


def _capped(path: Path, problems: list[str], total: int) -> list[str]:
    if total <= MAX_PROBLEMS:
        return problems
    return [*problems[:MAX_PROBLEMS], f"{path}: ... and {total - MAX_PROBLEMS} more"]


def load_yaml_model(path: Path | str, model: type[M], *, context: dict | None = None) -> M:
    """Read `path` (UTF-8 YAML) and validate it as `model`; raise `ConfigError`.

    `context` reaches the model's validators as pydantic's validation context
    (for example the folder that relative paths in the file start at).
    """
    path = Path(path)
    root, data = _parse(path, _read_text(path))
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise ConfigError(path, [f"{path}:1: expected a mapping of keys at the top, got {kind}"])
    tree = _NodeTree(root)
    problems = [
        f"{path}:{repeat.start_mark.line + 1}: {format_location(loc)}: the key appears twice "
        f"(also at line {first.start_mark.line + 1}); keep one"
        for loc, first, repeat in tree.repeats[:MAX_PROBLEMS]
    ]
    total = len(tree.repeats)
    try:
        result = model.model_validate(data, context=context)
    except ValidationError as exc:
        total += exc.error_count()
        for error in exc.errors()[: max(0, MAX_PROBLEMS + 1 - len(problems))]:
            line = tree.line_of(error["loc"])
            where = f"{path}:{line}: {format_location(error['loc'])}"
            problems.append(f"{where}: {error_message(error)}")
    if problems:
        raise ConfigError(path, _capped(path, problems, total))
    return result

"""Functions a reader can hold: none in `tuner/` or `runtime/` is longer than 80 lines.

A function's length runs from its `def` line to its last line (decorators excluded), nested
functions counted inside their parent as well as on their own. Kernels may be longer where
splitting one would cost speed, so `kernels/` is not held to it.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80
HELD = ("tuner", "runtime")


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function in `path` longer than `limit` lines."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_the_reader_measures_a_function_from_def_to_last_line(tmp_path):
    sample = tmp_path / "sample.py"
    body = "".join(f"    x{i} = {i}\n" for i in range(4))
    sample.write_text(f"@decorator\ndef short():\n{body}\nasync def also():\n{body}")
    assert long_functions(sample, limit=5) == []
    assert long_functions(sample, limit=4) == [("short", 5), ("also", 5)]


def test_no_function_in_tuner_or_runtime_is_over_80_lines():
    found = {
        f"{path.relative_to(ROOT)}:{name}": lines
        for folder in HELD
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name, lines in long_functions(path)
    }
    assert found == {}

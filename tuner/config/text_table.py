"""Plain-text tables whose columns are as wide as their widest cell."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["text_table"]


def text_table(rows: Sequence[Sequence[str]]) -> list[str]:
    """The rows as lines: the first column left-aligned, the others right-aligned, two
    spaces between columns, each column sized to its cells."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for first, *cells in rows:
        right = "".join(f"  {c:>{w}}" for c, w in zip(cells, widths[1:], strict=True))
        lines.append(f"{first:<{widths[0]}}{right}")
    return lines

"""The canonical request table every loader and generator produces, and its error type.

Columns, one row per request, sorted by arrival:

- ``arrival_s`` (float64): seconds from the start of the trace (the first
  request of a loaded trace arrives at 0);
- ``prompt_tokens``, ``output_tokens`` (int64, 1 to `MAX_TOKENS`);
- optional ``prefix_group`` (str or None): requests of one group start with
  the same prefix;
- optional ``prefix_hashes`` (list of ints): one hash per `PREFIX_BLOCK_TOKENS`
  tokens of the prompt, from its start. Two requests whose first k hashes are
  equal share their first k * PREFIX_BLOCK_TOKENS prompt tokens (the last hash
  may cover a partial block, so cap shared tokens at the prompt length). A
  trace may list every block of the prompt, as Mooncake does, or only the
  shareable leading ones (the synthetic day does); an empty list shares nothing.
"""

from __future__ import annotations

__all__ = [
    "CANONICAL_COLUMNS",
    "MAX_TOKENS",
    "NOT_ERRORS",
    "PREFIX_BLOCK_TOKENS",
    "PREFIX_COLUMNS",
    "REASONS",
    "TraceError",
]

CANONICAL_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")
PREFIX_COLUMNS = ("prefix_group", "prefix_hashes")

MAX_TOKENS = 1 << 24
"""The longest prompt or output any blocktune input accepts (16.7M tokens, longer than any
context): every trace loader skips a longer row, the sidecar refuses a longer observation."""

PREFIX_BLOCK_TOKENS = 256
"""Prompt tokens per entry of ``prefix_hashes`` (Mooncake's 512-token hashes are split in two)."""

REASONS = {
    "malformed_json": "not a JSON object",
    "missing_value": "missing value",
    "bad_timestamp": "unparsable timestamp",
    "non_integer_length": "length is not a whole number",
    "negative_length": "negative length",
    "length_over_limit": f"length over {MAX_TOKENS:,} tokens",
    "failed_request": "failed request (0 response tokens)",
    "zero_length": "zero length",
    "bad_prefix_hashes": "prefix hashes are not a list of integers",
}
"""Why a row is skipped, in the order rows are checked: a row counts under its first reason."""

NOT_ERRORS = frozenset({"failed_request"})
"""Reasons that describe the request, not the file: dropped and counted even in strict mode."""


class TraceError(ValueError):
    """A trace that cannot be loaded as asked; the message names the file, line and column."""

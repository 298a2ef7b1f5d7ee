"""A request table prepared for the replay simulator: plain arrays, prefix keys, intervals.

`Workload.from_frame` turns a canonical trace table (see
`blocktune.traces.schema`) into numpy arrays once, so that every simulated
policy reads the same arrivals. Prefix sharing is described per request by a
chain of identifiers: ``chain[q]`` stands for the first ``q`` prefix hashes
(q x `PREFIX_BLOCK_TOKENS` prompt tokens), so two requests with equal
``chain[q]`` share those tokens. A request shares at most
``min(len(hashes) x PREFIX_BLOCK_TOKENS, prompt)`` tokens (the last hash may
cover a partial block).

`Workload.group` is the request's prefix group as the length window sees it:
the ``prefix_group`` column where present, else the first prefix hash, else
None.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from blocktune.traces.schema import CANONICAL_COLUMNS, PREFIX_BLOCK_TOKENS

__all__ = ["EmptyWorkload", "Workload"]


class EmptyWorkload(ValueError):
    """A table that cannot be replayed (no rows, or a missing column); the message says which."""


def _chain(hashes: list[int]) -> tuple[int, ...]:
    """Identifiers of the hash prefixes: element q-1 stands for the first q hashes."""
    ids, current = [], 0
    for value in hashes:
        current = hash((current, int(value)))
        ids.append(current)
    return tuple(ids)


@dataclass(frozen=True)
class Workload:
    """The arrays every simulated policy replays, in arrival order (see the module docstring)."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    group: list[Hashable | None]
    shareable_tokens: np.ndarray
    chains: dict[int, tuple[int, ...]] = field(repr=False)

    @classmethod
    def from_frame(cls, frame: pd.DataFrame) -> Workload:
        """Arrays from a canonical table (arrival_s, prompt_tokens, output_tokens, optional
        prefix_group and prefix_hashes), sorted by arrival."""
        missing = [c for c in CANONICAL_COLUMNS if c not in frame]
        if missing:
            raise EmptyWorkload(f"the request table lacks the column(s) {missing}")
        if frame.empty:
            raise EmptyWorkload("the request table has no rows")
        frame = frame.sort_values("arrival_s", kind="stable")
        prompts = frame["prompt_tokens"].to_numpy(dtype=np.int64)
        outputs = frame["output_tokens"].to_numpy(dtype=np.int64)
        if prompts.min() < 1 or outputs.min() < 1:
            raise EmptyWorkload("prompt_tokens and output_tokens must be >= 1 in every row")
        n = len(frame)
        groups: list[Hashable | None] = [None] * n
        if "prefix_group" in frame:
            groups = [None if pd.isna(g) else g for g in frame["prefix_group"]]
        shareable = np.zeros(n, dtype=np.int64)
        chains: dict[int, tuple[int, ...]] = {}
        if "prefix_hashes" in frame:
            for i, hashes in enumerate(frame["prefix_hashes"]):
                if not isinstance(hashes, list | tuple | np.ndarray) or len(hashes) == 0:
                    continue
                chains[i] = _chain(list(hashes))
                shareable[i] = min(len(hashes) * PREFIX_BLOCK_TOKENS, int(prompts[i]))
                if groups[i] is None:
                    groups[i] = int(hashes[0])
        return cls(
            arrival_s=frame["arrival_s"].to_numpy(dtype=np.float64),
            prompt_tokens=prompts,
            output_tokens=outputs,
            group=groups,
            shareable_tokens=shareable,
            chains=chains,
        )

    @classmethod
    def of_lengths(
        cls, arrival_s: np.ndarray, prompt_tokens: np.ndarray, output_tokens: np.ndarray
    ) -> Workload:
        """Requests with the given arrival times and lengths that share no prefix."""
        count = len(arrival_s)
        return cls(
            arrival_s=np.asarray(arrival_s, dtype=np.float64),
            prompt_tokens=np.asarray(prompt_tokens, dtype=np.int64),
            output_tokens=np.asarray(output_tokens, dtype=np.int64),
            group=[None] * count,
            shareable_tokens=np.zeros(count, dtype=np.int64),
            chains={},
        )

    def without_longer_than(self, tokens: int) -> Workload:
        """The requests of at most `tokens` prompt + output tokens (self if that is all)."""
        return self._where(self.total_tokens <= tokens)

    def arriving_in(self, start_s: float, end_s: float) -> Workload:
        """The requests arriving from `start_s` until before `end_s` (self if that is all)."""
        return self._where((self.arrival_s >= start_s) & (self.arrival_s < end_s))

    def _where(self, keep: np.ndarray) -> Workload:
        """The rows where `keep` is true, in order, with their prefix chains renumbered."""
        if keep.all():
            return self
        row = np.cumsum(keep) - 1
        return Workload(
            arrival_s=self.arrival_s[keep],
            prompt_tokens=self.prompt_tokens[keep],
            output_tokens=self.output_tokens[keep],
            group=[g for g, k in zip(self.group, keep.tolist(), strict=True) if k],
            shareable_tokens=self.shareable_tokens[keep],
            chains={int(row[i]): chain for i, chain in self.chains.items() if keep[i]},
        )

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def total_tokens(self) -> np.ndarray:
        return self.prompt_tokens + self.output_tokens

    def prefix_keys(self, request: int, blocks: int, block_size: int) -> list[tuple[int, int]]:
        """Cache keys of the request's first `blocks` blocks of `block_size` tokens: block i
        is identified by its index and the hash prefix covering its last token."""
        chain = self.chains[request]
        return [
            (i, chain[-(-(i + 1) * block_size // PREFIX_BLOCK_TOKENS) - 1]) for i in range(blocks)
        ]

    def shared_blocks(self, request: int, held_tokens: int, block_size: int) -> int:
        """Leading full blocks the request can take from (or give to) the prefix cache when it
        is admitted holding `held_tokens`: never the block of its last token, and only within
        its hashed prefix."""
        return min(
            (held_tokens - 1) // block_size, int(self.shareable_tokens[request]) // block_size
        )

    def repeats_prefix(self) -> np.ndarray:
        """True for each request whose prefix group appeared in an earlier request."""
        keyed = pd.Series([g if g is not None else np.nan for g in self.group], dtype=object)
        return (keyed.notna() & keyed.duplicated()).to_numpy()

    def interval_index(self, interval_s: float) -> np.ndarray:
        """The decision interval each request arrives in: floor(arrival / interval)."""
        return np.floor(self.arrival_s / interval_s).astype(np.int64)

"""Serve a workload on the live engine with a virtual clock: what `blocktune validate` measures.

The clock starts at 0 and advances by the time of each `Engine.step()` as
`timer` measures it (wall time by default; `STEP_CLOCKS` has the choices), or
by a constant `step_s` for a deterministic run; while the engine is idle
it jumps to the next arrival. Before every step, the requests whose arrival the
clock has reached are added, in arrival order. A request's first token and its
finish take the clock's time at the end of the step that produced them, as in
the simulator.

Each request is greedy, ignores EOS and generates exactly its output tokens.
Its prompt is seeded random token ids of its length, except that the tokens
covered by its prefix hashes (`Workload.chains`) come from those hashes, so two
requests that share hashes share tokens and the engine's prefix cache reuses
what the simulator reuses.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from blocktune.traces.schema import PREFIX_BLOCK_TOKENS
from blocktune.tuner.core.workload import Workload

if TYPE_CHECKING:
    from blocktune.runtime.engine import Engine

__all__ = ["LiveRun", "prompt_ids", "serve_live"]


@dataclass(frozen=True)
class LiveRun:
    """What the engine did on a workload: per-request times (s of virtual time, per
    workload row) and counters. `busy_s` sums the step times."""

    block_size: int
    first_token_s: np.ndarray
    finish_s: np.ndarray
    generated: np.ndarray
    steps: int
    preemptions: int
    peak_blocks: int
    busy_s: float


def prompt_ids(workload: Workload, row: int, vocab_size: int, seed: int) -> list[int]:
    """The prompt of workload row `row` (see the module docstring)."""
    length = int(workload.prompt_tokens[row])
    shared = int(workload.shareable_tokens[row])
    hashes = -(-shared // PREFIX_BLOCK_TOKENS)
    prefix = [
        np.random.default_rng([seed, chain % 2**64]).integers(0, vocab_size, PREFIX_BLOCK_TOKENS)
        for chain in workload.chains.get(row, ())[:hashes]
    ]
    own = np.random.default_rng([seed, 2**64 - 1, row]).integers(0, vocab_size, length - shared)
    return np.concatenate([*prefix, np.zeros(0, np.int64)])[:shared].tolist() + own.tolist()


def serve_live(
    engine: Engine,
    workload: Workload,
    *,
    step_s: float | None = None,
    timer: Callable[[], float] = time.perf_counter,
    seed: int = 0,
) -> LiveRun:
    """Serve every request of `workload` on `engine` (see the module docstring)."""
    from blocktune.runtime.engine import SamplingParams

    n, arrivals = len(workload), workload.arrival_s
    first, finish = np.full(n, np.nan), np.full(n, np.nan)
    generated = np.zeros(n, dtype=np.int64)
    vocab = engine.model.config.vocab_size
    rows: dict[int, int] = {}
    clock = busy = 0.0
    arrived = steps = 0
    while arrived < n or engine.has_unfinished():
        while arrived < n and arrivals[arrived] <= clock:
            outputs = int(workload.output_tokens[arrived])
            params = SamplingParams(max_tokens=outputs, ignore_eos=True)
            rows[engine.add_request(prompt_ids(workload, arrived, vocab, seed), params)] = arrived
            arrived += 1
        if not engine.has_unfinished():
            clock = float(arrivals[arrived])
            continue
        begin = timer()
        outputs = engine.step()
        elapsed = timer() - begin if step_s is None else step_s
        clock += elapsed
        busy += elapsed
        steps += 1
        for output in outputs:
            row = rows[output.request_id]
            if np.isnan(first[row]):
                first[row] = clock
            if output.finished:
                finish[row] = clock
                generated[row] = len(output.token_ids)
    return LiveRun(
        block_size=engine.block_size,
        first_token_s=first,
        finish_s=finish,
        generated=generated,
        steps=steps,
        preemptions=engine.preemptions,
        peak_blocks=engine.peak_blocks_used,
        busy_s=busy,
    )

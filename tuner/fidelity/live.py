"""Serve a workload on the live engine with a virtual clock: what `blocktune validate` measures.

The clock starts at 0 and advances by the time of each `Engine.step()` as
`timer` measures it (wall time by default; `STEP_CLOCKS` has the choices), or
by a constant `step_s` for a deterministic run; while the engine is idle
it jumps to the next arrival. Before every step, the requests whose arrival the
clock has reached are added, in arrival order. A request's first token and its
finish take the clock's time at the end of the step that produced them, as in
the simulator. `between`, if given, is called after every step, outside its
timing, with the fraction of the workload's output tokens generated so far
(`blocktune validate` times its calibration's grid points there).

Each request is greedy, ignores EOS and generates exactly its output tokens.
Its prompt is seeded random token ids of its length, except that the tokens
covered by its prefix hashes (`Workload.chains`) come from those hashes, so two
requests that share hashes share tokens and the engine's prefix cache reuses
what the simulator reuses.

The result is the simulator's own record, `Run`: the engine's pool use is
integrated over the steps as the simulator integrates it (slots held and used
per step, KV bytes held over time), and a live run makes no swaps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from blocktune.traces.schema import PREFIX_BLOCK_TOKENS
from blocktune.tuner.sim.simulator import Run
from blocktune.tuner.sim.workload import Workload

if TYPE_CHECKING:
    from blocktune.runtime.engine import Engine

__all__ = ["prompt_ids", "serve_live"]


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
    between: Callable[[float], None] | None = None,
) -> Run:
    """Serve every request of `workload` on `engine` (see the module docstring)."""
    from blocktune.runtime.sampling import SamplingParams

    n, arrivals = len(workload), workload.arrival_s
    first, finish = np.full(n, np.nan), np.full(n, np.nan)
    generated = np.zeros(n, dtype=np.int64)
    vocab = engine.model.config.vocab_size
    rows: dict[int, int] = {}
    clock = busy = kv_byte_s = 0.0
    arrived = steps = allocated_slot_steps = used_slot_steps = 0
    slot_bytes = engine.kv.nbytes // engine.kv.num_slots
    total_outputs, generated_so_far = max(1, int(workload.output_tokens.sum())), 0
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
        stats = engine.stats()
        held = int(stats["blocks_used"]) * engine.block_size
        allocated_slot_steps += held
        used_slot_steps += held - int(stats["padding_slots"])
        kv_byte_s += held * slot_bytes * elapsed
        for output in outputs:
            row = rows[output.request_id]
            if np.isnan(first[row]):
                first[row] = clock
            if output.finished:
                finish[row] = clock
                generated[row] = len(output.token_ids)
        generated_so_far += len(outputs)
        if between is not None:
            between(min(1.0, generated_so_far / total_outputs))
    return Run(
        block_size=engine.block_size,
        first_token_s=first,
        finish_s=finish,
        generated=generated,
        steps=steps,
        preemptions=engine.preemptions,
        swaps=0,
        swap_pause_s=0.0,
        peak_kv_bytes=engine.peak_blocks_used * engine.block_size * slot_bytes,
        peak_blocks=engine.peak_blocks_used,
        kv_byte_s=kv_byte_s,
        allocated_slot_steps=allocated_slot_steps,
        used_slot_steps=used_slot_steps,
        busy_s=busy,
        switches=[],
        prefix_hit_tokens=engine.prefix_hit_tokens,
    )

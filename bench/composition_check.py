"""Do live batches cost what the grid's fit prices them at? Both timed alternately.

`blocktune validate` prices a live run's steps with a fit of grid steps timed minutes
before; on a machine whose speed moves, the step model's error and the drift cannot be
told apart. This first serves the trace live once (one torch thread, CPU clock) only to
record the decode batches it formed: each decode-only step's context lengths. It then
draws `--batches` of them (evenly over their batch sizes) and times, alternating point by
point in one engine per role, the trace's calibration grid (what validate measures) and
those batches rebuilt on a fresh engine (their requests admitted one by one, settled,
then `REPEATS` decode steps timed). The grid's steps are fitted (`fit_steps`) and the
rebuilt batches priced by the fit (`STEP_FORM` on their features, counted as the grid
counts them): measured / priced per batch size. The alternation lets drift touch both sides
alike on average; a grid point and a rebuilt batch are still seconds apart, and on a 2-core
machine whose speed moves within seconds one configuration repeated to about +-0.2
(bench/results/2026-12-03-calibration-fidelity.md).

With `--one-chunk` the torch decode attention reads every batch as one chunk padded to its
longest context (its grouping constants set huge for the run), which is what the step
form's padded term describes.

    python bench/composition_check.py TRACE [--format azure] [--batches 40] [--one-chunk]
"""

from __future__ import annotations

import argparse
import collections
import os

import numpy as np
from trace_setup import TraceSetup, add_trace_arguments

from blocktune.kernels import paged_attention
from blocktune.runtime.block_manager import blocks_for
from blocktune.runtime.engine import Engine
from blocktune.tuner.fidelity.live import serve_live
from blocktune.tuner.fidelity.validation import _engine as live_engine
from blocktune.tuner.measure import engine_measure
from blocktune.tuner.measure.step_fit import TimedStep, fit_steps, predict_step_s
from blocktune.tuner.sim.step_cost import StepCostModel

CLOCK = engine_measure.STEP_CLOCKS["cpu"]
REPEATS = 5
"""Decode steps timed per rebuilt batch (after `engine_measure.SETTLE_STEPS` untimed)."""


class BatchRecorder(Engine):
    """The engine, keeping the context lengths of every decode-only step's batch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[tuple[int, ...]] = []

    def _forward(self, decoding, chunks):
        if decoding and not chunks:
            self.batches.append(tuple(self.blocks.num_tokens(r.id) for r in decoding))
        return super()._forward(decoding, chunks)


def drawn(batches: list[tuple[int, ...]], count: int, rng: np.random.Generator) -> list:
    """`count` batches, drawn evenly over the batch sizes that occur."""
    by_size = collections.defaultdict(list)
    for batch in batches:
        by_size[len(batch)].append(batch)
    sizes = sorted(by_size)
    picks = [sizes[i % len(sizes)] for i in range(count)]
    return [by_size[n][rng.integers(len(by_size[n]))] for n in picks]


def rebuilt_steps(engine: Engine, contexts: tuple[int, ...], rng) -> list[TimedStep]:
    """Admit requests holding `contexts` tokens one by one, settle, time `REPEATS` decodes."""
    admitted = len(contexts) + engine_measure.SETTLE_STEPS
    ids = []
    for context in contexts:  # each decodes while the later ones are admitted
        prompt = max(1, context - (admitted - len(ids)))
        ids += engine_measure._start(engine, rng, 1, prompt, admitted + REPEATS + 2)
    for _ in range(engine_measure.SETTLE_STEPS):
        engine.step()
    steps = []
    for _ in range(REPEATS):
        lens = [engine.blocks.num_tokens(i) + 1 for i in ids]  # K/V held in the step
        seconds = engine_measure._timed_step(engine, CLOCK)
        size = engine.block_size
        steps.append(
            TimedStep(
                size,
                len(lens),
                sum(lens),
                sum(blocks_for(n, size) for n in lens),
                0,
                seconds,
                padded_tokens=len(lens) * max(lens),
            )
        )
    for request_id in ids:
        engine.cancel(request_id)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_trace_arguments(parser)
    parser.add_argument("--batches", type=int, default=40, help="rebuilt batches (default: 40)")
    parser.add_argument("--one-chunk", action="store_true", help="decode attention unchunked")
    parser.add_argument("--seed", type=int, default=0, help="default: 0")
    args = parser.parse_args()
    if args.one_chunk:
        paged_attention.PAD_RATIO = paged_attention.PAD_TOKENS = 1 << 40
        paged_attention.GATHER_BYTES_PER_THREAD = 1 << 40
    setup = TraceSetup.of(args, seed=args.seed)
    model, workload, size = setup.model, setup.workload, args.block_size
    served, calibration, grid = setup.served, setup.calibration, setup.grid
    server = StepCostModel(served, calibration)
    recorder = BatchRecorder(model, live_engine(model, server, size, workload).config)
    serve_live(recorder, workload, timer=CLOCK, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    batches = drawn(recorder.batches, args.batches, rng)
    del recorder
    longest = max(max(batch) for batch in batches)
    grid_engine = engine_measure._engine(model, grid, size, "torch")
    most = max(map(len, batches))
    # A pool and positions for the largest batch: a rebuilt request may ask for up to its
    # context + the batch's admissions + REPEATS + 2 tokens (`rebuilt_steps`).
    batch_grid = engine_measure.EngineGrid(
        (size,), (most,), (longest,), (longest,), repeats=REPEATS + most
    )
    batch_engine = engine_measure._engine(model, batch_grid, size, "torch")
    for engine in (grid_engine, batch_engine):
        engine_measure._warm_up(engine, rng)
    points = engine_measure._points(grid)
    grid_steps: list[TimedStep] = []
    rebuilt: list[TimedStep] = []
    for i in range(max(len(points), len(batches))):  # alternate: drift touches both alike
        if i < len(points):
            grid_steps += points[i](grid_engine, grid, rng, CLOCK)
        if i < len(batches):
            rebuilt += rebuilt_steps(batch_engine, batches[i], rng)
    coefficients = fit_steps(grid_steps).coefficients[size]
    print(
        f"{args.trace}: {len(workload)} requests, {args.model}, B={size}, "
        f"{'one chunk' if args.one_chunk else 'default layout'}, load {os.getloadavg()}"
    )
    print(f"{len(batches)} rebuilt batches, {len(grid_steps)} grid steps")
    print("| rebuilt batches | steps | measured / priced |")
    print("| --- | --- | --- |")
    groups = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for step in rebuilt:
        label = "1-4" if step.sequences <= 4 else "5-16" if step.sequences <= 16 else "17+"
        for key in (f"{label} requests", "all"):
            groups[key][0] += 1
            groups[key][1] += step.seconds
            groups[key][2] += predict_step_s(coefficients, step)
    for key, (count, measured, priced) in sorted(groups.items()):
        print(f"| {key} | {count} | {measured / priced:.2f} |")


if __name__ == "__main__":
    main()

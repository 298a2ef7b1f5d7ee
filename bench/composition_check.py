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

`--backend` sets the attention backend of every engine (default: torch, whose chunked
layout the modes below vary; the engine's own default on a CPU is cpu, which reads every
sequence in place and has no chunks).

With `--one-chunk` the torch decode attention reads every batch as one chunk padded to its
longest context (its grouping constants set huge for the run), which is what the step
form's padded term describes.

With `--against-one-chunk` every drawn batch is timed twice back to back in a random order,
read in the default chunks and as one chunk, and the paired ratio (default over one chunk)
printed the same way.

With `--against-uniform` every drawn batch is also rebuilt with all its requests at the
batch's mean context (the same requests and about the same tokens, one length: one chunk,
nothing padded), the two versions timed back to back in a random order on one engine.
Their paired ratio (as drawn over uniform, per batch) measures what mixed lengths cost at
equal work, free of the drift between runs that separate runs of the two leave in.

    python bench/composition_check.py TRACE [--format azure] [--batches 40] [--one-chunk]
        [--against-uniform | --against-one-chunk] [--backend torch|cpu]
"""

from __future__ import annotations

import argparse
import collections
import os
from dataclasses import replace

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


def rebuilt_steps(engine: Engine, contexts: tuple[int, ...], timing) -> list[TimedStep]:
    """Admit requests holding `contexts` tokens one by one, settle, time `REPEATS` decodes."""
    admitted = len(contexts) + engine_measure.SETTLE_STEPS
    ids = []
    for context in contexts:  # each decodes while the later ones are admitted
        prompt = max(1, context - (admitted - len(ids)))
        ids += engine_measure._start(engine, timing, 1, prompt, admitted + REPEATS + 2)
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


def uniform(contexts: tuple[int, ...]) -> tuple[int, ...]:
    """The batch with every request at its mean context (rounded)."""
    return (round(sum(contexts) / len(contexts)),) * len(contexts)


ONE_CHUNK = (1 << 40, 1 << 40, 1 << 40)
"""Grouping constants under which the torch decode attention reads any batch as one chunk."""


def set_layout(constants: tuple[int, int, int]) -> None:
    """Set the torch decode attention's grouping constants (PAD_RATIO, PAD_TOKENS,
    GATHER_BYTES_PER_THREAD) for the steps that follow."""
    (
        paged_attention.PAD_RATIO,
        paged_attention.PAD_TOKENS,
        paged_attention.GATHER_BYTES_PER_THREAD,
    ) = constants


def group_of(sequences: int) -> str:
    """The batch-size group a table row counts a step in."""
    return "1-4" if sequences <= 4 else "5-16" if sequences <= 16 else "17+"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_trace_arguments(parser)
    parser.add_argument("--batches", type=int, default=40, help="rebuilt batches (default: 40)")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--one-chunk", action="store_true", help="decode attention unchunked")
    modes.add_argument(
        "--against-uniform",
        action="store_true",
        help="also time each batch with every request at its mean context, back to back",
    )
    modes.add_argument(
        "--against-one-chunk",
        action="store_true",
        help="also time each batch read as one chunk, back to back",
    )
    parser.add_argument("--seed", type=int, default=0, help="default: 0")
    parser.add_argument(
        "--backend", choices=("torch", "cpu"), default="torch", help="default: %(default)s"
    )
    args = parser.parse_args()
    default_layout = (
        paged_attention.PAD_RATIO,
        paged_attention.PAD_TOKENS,
        paged_attention.GATHER_BYTES_PER_THREAD,
    )
    if args.one_chunk:
        set_layout(ONE_CHUNK)
    setup = TraceSetup.of(args, seed=args.seed)
    model, workload, size = setup.model, setup.workload, args.block_size
    served, calibration, grid = setup.served, setup.calibration, setup.grid
    server = StepCostModel(served, calibration)
    live_config = live_engine(model, server, size, workload).config
    recorder = BatchRecorder(model, replace(live_config, attention_backend=args.backend))
    serve_live(recorder, workload, timer=CLOCK, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    batches = drawn(recorder.batches, args.batches, rng)
    timing = engine_measure._Timing(rng, CLOCK)
    del recorder
    longest = max(max(batch) for batch in batches)
    grid_engine = engine_measure._engine(model, grid, size, args.backend)
    most = max(map(len, batches))
    # A pool and positions for the largest batch: a rebuilt request may ask for up to its
    # context + the batch's admissions + REPEATS + 2 tokens (`rebuilt_steps`).
    batch_grid = engine_measure.EngineGrid(
        (size,), (most,), (longest,), (longest,), repeats=REPEATS + most
    )
    batch_engine = engine_measure._engine(model, batch_grid, size, args.backend)
    for engine in (grid_engine, batch_engine):
        engine_measure._warm_up(engine, timing)
    points = engine_measure._points(grid)
    grid_steps: list[TimedStep] = []
    rebuilt: list[TimedStep] = []
    flat: list[TimedStep] = []  # the second versions (uniform, or read as one chunk)
    pairs: list[tuple[int, float]] = []  # batch size, as drawn over second (mean step)
    for i in range(max(len(points), len(batches))):  # alternate: drift touches both alike
        if i < len(points):
            grid_steps += points[i](grid_engine, grid, timing)
        if i >= len(batches):
            continue
        if not (args.against_uniform or args.against_one_chunk):
            rebuilt += rebuilt_steps(batch_engine, batches[i], timing)
            continue
        versions = [batches[i], batches[i] if args.against_one_chunk else uniform(batches[i])]
        layouts = [default_layout, ONE_CHUNK if args.against_one_chunk else default_layout]
        order = rng.permutation(2)
        timed = [[], []]
        for which in order:
            set_layout(layouts[which])
            timed[which] = rebuilt_steps(batch_engine, versions[which], timing)
        set_layout(default_layout)
        rebuilt += timed[0]
        flat += timed[1]
        means = [np.mean([step.seconds for step in steps]) for steps in timed]
        pairs.append((len(batches[i]), means[0] / means[1]))
    coefficients = fit_steps(grid_steps).coefficients[size]
    print(
        f"{args.trace}: {len(workload)} requests, {args.model}, B={size}, "
        f"{args.backend} backend, {'one chunk' if args.one_chunk else 'default layout'}, "
        f"load {os.getloadavg()}"
    )
    print(f"{len(batches)} rebuilt batches, {len(grid_steps)} grid steps")
    second = "as one chunk" if args.against_one_chunk else "uniform"
    for title, steps in (("as drawn", rebuilt), (second, flat)):
        if not steps:
            continue
        print(f"| rebuilt batches, {title} | steps | measured / priced |")
        print("| --- | --- | --- |")
        groups = collections.defaultdict(lambda: [0, 0.0, 0.0])
        for step in steps:
            for key in (f"{group_of(step.sequences)} requests", "all"):
                groups[key][0] += 1
                groups[key][1] += step.seconds
                groups[key][2] += predict_step_s(coefficients, step)
        for key, (count, measured, priced) in sorted(groups.items()):
            print(f"| {key} | {count} | {measured / priced:.2f} |")
    if pairs:
        print(f"| batches | pairs | as drawn / {second}: median | quartiles |")
        print("| --- | --- | --- | --- |")
        by_group = collections.defaultdict(list)
        for sequences, ratio in pairs:
            by_group[f"{group_of(sequences)} requests"].append(ratio)
            by_group["all"].append(ratio)
        for key, ratios in sorted(by_group.items()):
            low, mid, high = np.percentile(ratios, [25, 50, 75])
            print(f"| {key} | {len(ratios)} | {mid:.2f} | {low:.2f}-{high:.2f} |")


if __name__ == "__main__":
    main()

"""The machine's speed or the step model? Calibrations and live runs alternated, with a probe.

`blocktune validate` fits the engine's steps on a grid timed in a few seconds, then serves
the trace live for a minute or more per block size, and reports the prediction's error.
Both sides are timed on a machine whose speed may move between them. This alternates, in one
process and one torch thread, CPU clock: an engine calibration on the trace's grid (what
validate measures first) and the prediction it gives for the trace at `--block-size`, then a
live run of the trace at that size, `--rounds` times, and a last calibration. Beside every
grid and every live run it times a **speed probe**: the model's cache-less forward pass of
`PROBE_TOKENS` tokens, a fixed amount of the same kind of work as a step. The live runs
take `PROBE_REPEATS` probes every `--probe-every` steps (outside the steps' time); a grid is
bracketed by `PROBE_BURST` probes before and after it. TPOT p50 over the probe's median
then compares the step model's prediction with the live runs in units of the machine's
speed at the time (which follows the machine only in part: see
bench/results/2026-12-03-calibration-fidelity.md).

Every live step is also priced by the calibration just before it (`STEP_FORM` on the step's
features, counted as the grid counts them), and the measured / priced ratio is printed per
kind of step: decode-only or with prompt work, by batch size, over all rounds.

    python bench/calibration_drift.py TRACE --format azure [--requests 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from dataclasses import replace

import torch
from trace_setup import TraceSetup, add_trace_arguments

from blocktune.runtime.block_manager import blocks_for
from blocktune.runtime.engine import Engine
from blocktune.tuner.config.calibration import prefill_pairs
from blocktune.tuner.fidelity.live import serve_live
from blocktune.tuner.fidelity.validation import _engine
from blocktune.tuner.measure.engine_measure import (
    STEP_CLOCKS,
    measure_engine,
)
from blocktune.tuner.measure.step_fit import TimedStep, predict_step_s
from blocktune.tuner.sim.served import ServedMetrics
from blocktune.tuner.sim.simulator import simulate
from blocktune.tuner.sim.step_cost import StepCostModel

PROBE_TOKENS = 64
PROBE_REPEATS = 3
PROBE_BURST = 20
CLOCK = STEP_CLOCKS["cpu"]


class SpeedProbe:
    """Times the model's forward pass over a fixed prompt; keeps the samples."""

    def __init__(self, model) -> None:
        self.model = model
        self.ids = torch.arange(PROBE_TOKENS) % model.config.vocab_size
        self.samples: list[float] = []

    def take(self, count: int) -> None:
        for _ in range(count):
            begin = CLOCK()
            self.model.forward_dense(self.ids)
            self.samples.append(CLOCK() - begin)

    def median_since(self, start: int) -> float:
        return statistics.median(self.samples[start:])

    def probing_timer(self, every: int):
        """A step timer for `serve_live` that takes probes before every `every`-th step."""
        calls = 0

        def timer() -> float:
            nonlocal calls
            if calls % (2 * every) == 0:  # serve_live reads the clock twice a step
                self.take(PROBE_REPEATS)
            calls += 1
            return CLOCK()

        return timer


class RecordingEngine(Engine):
    """The engine, keeping every step's features (as the grid counts them) and CPU time."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.timed: list[TimedStep] = []
        self._features: dict | None = None

    def _forward(self, decoding, chunks):
        lens = [self.blocks.num_tokens(r.id) for r in decoding]
        held = [len(r.tokens) - r.prefill_left + n for r, n in chunks]  # after the chunk
        pairs = [prefill_pairs(h - n, n) for h, (_, n) in zip(held, chunks, strict=True)]
        self._features = dict(
            sequences=len(decoding) + len(chunks),
            context_tokens=sum(lens) + sum(held),
            context_blocks=sum(blocks_for(n, self.block_size) for n in lens + held),
            prefill_tokens=sum(n for _, n in chunks),
            padded_tokens=len(decoding) * max(lens, default=0),
            prefill_pairs=sum(pairs),
            prompt_chunks=len(chunks),
        )
        return super()._forward(decoding, chunks)

    def step(self):
        self._features = None
        begin = CLOCK()
        outputs = super().step()
        seconds = CLOCK() - begin
        if self._features is not None:
            self.timed.append(TimedStep(self.block_size, seconds=seconds, **self._features))
        return outputs


def kind(step: TimedStep) -> str:
    """A live step's kind for the pricing table."""
    work = "with prompt work" if step.prefill_tokens else "decode only"
    batch = "1-4" if step.sequences <= 4 else "5-16" if step.sequences <= 16 else "17+"
    return f"{work}, {batch} sequences"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_trace_arguments(parser)
    parser.add_argument("--rounds", type=int, default=3, help="live runs (default: 3)")
    parser.add_argument("--probe-every", type=int, default=20, help="live steps (default: 20)")
    parser.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        help="the grid's decode batch sizes instead of validate's (default: its 1 8 32)",
    )
    args = parser.parse_args()
    setup = TraceSetup.of(args)
    model, name, workload, size = setup.model, args.model, setup.workload, args.block_size
    served, calibration, grid = setup.served, setup.calibration, setup.grid
    if args.batch_sizes:
        grid = replace(grid, batch_sizes=tuple(sorted(args.batch_sizes)))
    probe = SpeedProbe(model)
    probe.take(PROBE_BURST)  # warm-up
    print(f"{args.trace}: {len(workload)} requests, {name}, B={size}, load {os.getloadavg()}")
    print(f"grid: batches {list(grid.batch_sizes)}, contexts {list(grid.context_lens)}")
    print("| time | side | TPOT p50 | steps | busy | probe p50 | TPOT p50 / probe |")
    print("| --- | --- | --- | --- | --- | --- | --- |")

    def report(side: str, metrics: ServedMetrics, steps: int, busy: float, probed: float):
        print(
            f"| {time.strftime('%H:%M:%S')} | {side} | {metrics.tpot_p50_s * 1e3:.2f} ms | "
            f"{steps} | {busy:.1f} s | {probed * 1e3:.3f} ms | "
            f"{metrics.tpot_p50_s / probed:.2f} |",
            flush=True,
        )

    priced = collections.defaultdict(lambda: [0, 0.0, 0.0])  # steps, measured, priced
    for round_ in range(args.rounds + 1):
        start = len(probe.samples)
        probe.take(PROBE_BURST)
        engine_calibration = measure_engine(model, name, grid, "torch", clock="cpu")
        probe.take(PROBE_BURST)
        server = StepCostModel(served, calibration.with_engine(engine_calibration))
        run = simulate(workload, server, size)
        metrics = ServedMetrics.of(run, workload)
        report("predicted", metrics, run.steps, run.busy_s, probe.median_since(start))
        if round_ == args.rounds:
            break
        start = len(probe.samples)
        config = _engine(model, server, size, workload).config
        engine = RecordingEngine(model, config)
        live = serve_live(engine, workload, timer=probe.probing_timer(args.probe_every))
        metrics = ServedMetrics.of(live, workload)
        report("live", metrics, live.steps, live.busy_s, probe.median_since(start))
        coefficients = engine_calibration.steps[size]
        for step in engine.timed:
            for key in (kind(step), "all steps"):
                priced[key][0] += 1
                priced[key][1] += step.seconds
                priced[key][2] += predict_step_s(coefficients, step)
        del engine
    print("\n| live steps | steps | CPU time | measured / priced |")
    print("| --- | --- | --- | --- |")
    for key, (count, measured, price) in sorted(priced.items()):
        print(f"| {key} | {count} | {measured:.1f} s | {measured / price:.2f} |")


if __name__ == "__main__":
    main()

"""Time whole engine steps of a model and fit the simulator's step form (`calibrate --engine`).

For each block size B a fresh `Engine` with the model serves steps of known
shape, each timed by the wall clock around `Engine.step()`:

- decode steps: n requests at context c for every (n, c) of the grid, the
  mean of `repeats` consecutive steps (the context grows by one a step) after
  `SETTLE_STEPS` untimed ones;
- prefill steps: one prompt of k tokens for every chunk size k, alone and
  next to a decode batch (the grid's middle n and c), mean of `repeats`.

The mean, not the median: the simulator adds step times up, and the expected
value of a sum is the sum of the expected values, slow outliers included.

A step is timed by `STEP_CLOCKS[clock]`: the wall clock, or the calling
thread's CPU time ("cpu", for one torch thread on a CPU), which leaves out the
time the process waits while other processes hold the cores.

Each becomes a `TimedStep` with the features the simulator prices (requests,
context tokens and blocks held, prompt tokens computed), and `fit_steps` fits
`STEP_FORM` per block size. Prompts are seeded random token ids; the requests
of a decode batch share one prompt, so with prefix caching their untimed
admission computes it once; the first steps of every engine are run untimed
(allocation and warm-up).

torch is imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from blocktune.tuner.config.calibration import (
    STEP_FORM,
    Calibration,
    EngineCalibration,
    EngineModel,
    prefill_pairs,
)
from blocktune.tuner.config.policy import ModelShape
from blocktune.tuner.measure.measure import default_grid, measure_calibration, measured_provenance
from blocktune.tuner.measure.step_fit import TimedStep, fit_steps

if TYPE_CHECKING:
    from blocktune.runtime.engine import Engine
    from blocktune.runtime.model import LlamaModel

__all__ = [
    "STEP_CLOCKS",
    "EngineGrid",
    "default_engine_grid",
    "engine_model",
    "measure_engine",
    "measure_engine_calibration",
    "model_shape",
]

WARMUP_STEPS = 3
SETTLE_STEPS = 5
"""Untimed decode steps after a batch is admitted: the first steps after an admission run
10-30% slower than the steady ones (measured on tiny-random, one CPU thread), and the
decodes a simulator prices are mostly steady ones."""
STEP_CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
"""How a step is timed: wall time, or the calling thread's CPU time."""


@dataclass(frozen=True)
class EngineGrid:
    """What `measure_engine` times: block sizes, decode batches x contexts, prefill chunks."""

    block_sizes: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    context_lens: tuple[int, ...]
    prefill_chunks: tuple[int, ...]
    repeats: int

    @property
    def longest(self) -> int:
        """The most tokens a request of the grid holds."""
        mixed_steps = len(self.prefill_chunks) * self.repeats
        decode_steps = SETTLE_STEPS + self.repeats
        return max(*self.context_lens, *self.prefill_chunks) + mixed_steps + decode_steps + 2


def default_engine_grid(*, quick: bool, block_sizes: tuple[int, ...]) -> EngineGrid:
    """The grid of `calibrate --engine` (about a minute for tiny-random on two CPU cores), or
    a tiny one (`quick`) for smoke runs."""
    if quick:
        return EngineGrid(block_sizes, (1, 4), (16, 96), (16, 64), repeats=2)
    return EngineGrid(
        block_sizes, (1, 8, 32), (32, 256, 1024, 2048), (32, 128, 512, 1024), repeats=5
    )


def engine_model(model: LlamaModel, name: str) -> EngineModel:
    """The name and shape of a runtime model, as an engine calibration records it."""
    c = model.config
    return EngineModel(
        name=name,
        num_layers=c.num_layers,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        vocab_size=c.vocab_size,
        dtype=str(model.dtype).removeprefix("torch."),
    )


def model_shape(model: LlamaModel) -> ModelShape:
    """A runtime model as a policy's `model` section (its parameters counted)."""
    c = model.config
    return ModelShape(
        num_layers=c.num_layers,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype=str(model.dtype).removeprefix("torch."),
        num_params=float(sum(p.numel() for p in model.parameters())),
    )


def measure_engine(
    model: LlamaModel,
    name: str,
    grid: EngineGrid,
    backend: str,
    *,
    clock: str = "wall",
    seed: int = 0,
    progress: Callable[[str], None] = lambda _: None,
) -> EngineCalibration:
    """Time the grid's steps of `model` (on its device, with `backend`) and fit them."""
    import torch

    check_clock(clock, model)
    limit = model.config.max_position_embeddings
    if grid.longest > limit:
        raise ValueError(
            f"the grid's requests hold up to {grid.longest} tokens, more than the model's "
            f"{limit} positions: use shorter context_lens and prefill_chunks"
        )
    rng = np.random.default_rng(seed)
    steps: list[TimedStep] = []
    for block_size in grid.block_sizes:
        progress(f"engine steps at block size {block_size}")
        engine = _engine(model, grid, block_size, backend)
        _warm_up(engine, rng)
        timer = STEP_CLOCKS[clock]
        steps += _decode_steps(engine, grid, rng, timer)
        steps += _prefill_steps(engine, grid, rng, timer)
    coefficients, residuals = fit_steps(steps)
    return EngineCalibration(
        provenance=measured_provenance(
            model.device.type,
            backend,
            grid,
            "measured by `blocktune calibrate --engine`; fitted per block size by "
            f"non-negative least squares of the relative error: {STEP_FORM}",
        ),
        model=engine_model(model, name),
        threads=torch.get_num_threads(),
        clock=clock,
        steps=coefficients,
        residuals=residuals,
    )


def check_clock(clock: str, model: LlamaModel) -> None:
    """Raise `ValueError` unless `clock` can time `model`'s steps: "wall" always, "cpu"
    only on a CPU with one torch thread (the timing thread does all the work)."""
    import torch

    if clock not in STEP_CLOCKS:
        raise ValueError(f"clock must be one of {sorted(STEP_CLOCKS)}, got {clock!r}")
    if clock == "cpu" and (model.device.type != "cpu" or torch.get_num_threads() != 1):
        raise ValueError(
            "the cpu clock times the calling thread: it needs a model on the CPU and one "
            f"torch thread (here {model.device.type}, {torch.get_num_threads()} threads)"
        )


def measure_engine_calibration(
    model: LlamaModel,
    name: str,
    grid: EngineGrid,
    *,
    quick: bool,
    clock: str = "wall",
    seed: int = 0,
    progress: Callable[[str], None] = lambda _: None,
) -> Calibration:
    """What `calibrate --engine` writes: the kernel calibration (its `quick` grid or the full
    one) on the model's device for its attention shape and dtype, with the model's engine
    steps timed over `grid` and fitted."""
    from dataclasses import replace

    check_clock(clock, model)
    device = model.device.type
    shape = engine_model(model, name)
    kernel_grid = replace(
        default_grid(device, quick=quick, block_sizes=grid.block_sizes),
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        dtype=shape.dtype,
    )
    calibration = measure_calibration(kernel_grid, device, progress=progress)
    backend = calibration.provenance.backend
    engine = measure_engine(model, name, grid, backend, clock=clock, seed=seed, progress=progress)
    for block_size, fit in engine.residuals.items():
        progress(
            f"step fit at B={block_size}: {fit.points} points, relative residual rms "
            f"{fit.rms_relative:.1%}, max {fit.max_relative:.1%}"
        )
    return calibration.with_engine(engine)


def _engine(model: LlamaModel, grid: EngineGrid, block_size: int, backend: str) -> Engine:
    from blocktune.runtime.engine import Engine, EngineConfig

    rows = max(grid.batch_sizes) + 2
    return Engine(
        model,
        EngineConfig(
            block_size=block_size,
            num_blocks=rows * (-(-grid.longest // block_size) + 1),
            max_num_seqs=rows,
            max_model_len=grid.longest + 1,
            attention_backend=backend,
            enable_prefix_caching=True,
            candidate_block_sizes=(block_size,),
        ),
    )


def _prompt(engine: Engine, rng: np.random.Generator, length: int) -> list[int]:
    return rng.integers(0, engine.model.config.vocab_size, length).tolist()


def _start(engine: Engine, rng: np.random.Generator, count: int, context: int, steps: int):
    """Admit `count` requests of one `context`-token prompt that decode `steps` more steps."""
    from blocktune.runtime.engine import SamplingParams

    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    prompt = _prompt(engine, rng, context)
    ids = [engine.add_request(prompt, params) for _ in range(count)]
    engine.step()
    return ids


def _timed_step(engine: Engine, timer: Callable[[], float]) -> float:
    begin = timer()
    engine.step()
    return timer() - begin


def _warm_up(engine: Engine, rng: np.random.Generator) -> None:
    ids = _start(engine, rng, 2, 8, WARMUP_STEPS)
    for _ in range(WARMUP_STEPS):
        engine.step()
    for request_id in ids:
        engine.cancel(request_id)


def _decode_steps(
    engine: Engine, grid: EngineGrid, rng: np.random.Generator, timer: Callable[[], float]
) -> list[TimedStep]:
    """Decode batches of one context each, and batches whose first half holds the grid's
    shortest context (padded to the longest by a gathering attention)."""
    size, middle = engine.block_size, SETTLE_STEPS + (grid.repeats + 1) // 2
    shortest, lifetime = min(grid.context_lens), SETTLE_STEPS + grid.repeats
    steps = []
    for batch in grid.batch_sizes:
        for context in grid.context_lens:
            mixes = [(0, batch)]
            if batch > 1 and context > shortest:
                mixes.append((batch // 2, batch - batch // 2))
            for short, long in mixes:
                ids = _start(engine, rng, short, shortest, lifetime + 1) if short else []
                ids += _start(engine, rng, long, context, lifetime)
                for _ in range(SETTLE_STEPS):
                    engine.step()
                seconds = float(np.mean([_timed_step(engine, timer) for _ in range(grid.repeats)]))
                low, high = shortest + middle, context + middle  # the middle step's contexts
                tokens = short * low + long * high
                blocks = short * -(-low // size) + long * -(-high // size)
                steps.append(
                    TimedStep(size, batch, tokens, blocks, 0, seconds, padded_tokens=batch * high)
                )
                for request_id in ids:
                    engine.cancel(request_id)
    return steps


def _prefill_steps(
    engine: Engine, grid: EngineGrid, rng: np.random.Generator, timer: Callable[[], float]
) -> list[TimedStep]:
    """Prefill steps of each chunk size, alone and beside the grid's middle decode batch."""
    from blocktune.runtime.engine import SamplingParams

    size, middle = engine.block_size, (grid.repeats + 1) // 2
    batch = grid.batch_sizes[len(grid.batch_sizes) // 2]
    context = grid.context_lens[len(grid.context_lens) // 2]
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    steps = []
    for decoding in (0, batch):
        mixed_steps = len(grid.prefill_chunks) * grid.repeats
        ids = _start(engine, rng, decoding, context, mixed_steps) if decoding else []
        for i, chunk in enumerate(grid.prefill_chunks):
            times = []
            for _ in range(grid.repeats):
                engine.add_request(_prompt(engine, rng, chunk), one)
                times.append(_timed_step(engine, timer))
            held = context + i * grid.repeats + middle  # the decodes' context, middle step
            tokens = decoding * held + chunk
            blocks = decoding * -(-held // size) + -(-chunk // size)
            seconds = float(np.mean(times))
            steps.append(
                TimedStep(
                    size,
                    decoding + 1,
                    tokens,
                    blocks,
                    chunk,
                    seconds,
                    padded_tokens=decoding * held,
                    prefill_pairs=prefill_pairs(0, chunk),
                )
            )
        for request_id in ids:
            engine.cancel(request_id)
    return steps

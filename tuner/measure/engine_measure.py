"""Time whole engine steps of a model and fit the simulator's step form (`calibrate --engine`).

One `Engine` with the model per block size B serves steps of known shape. The
grid's points are timed round-robin: each point at every B (the order of the
sizes rotating from point to point) before the next point, so a machine that
drifts slows every size alike instead of one size more than another. A point is

- a decode batch: n requests at context c for every (n, c) of the grid (and the
  batch with its first half at the shortest context), `repeats` consecutive
  steps each timed (the context grows by one a step) after `SETTLE_STEPS`
  untimed ones;
- an admission step: m prompts of about k tokens admitted together, for every
  chunk size k and every m of `admissions` with m * k within the largest chunk,
  alone and next to a decode batch (the grid's middle n and c), `repeats` times:
  every other step at a token count the process never computed before, the others
  at the count of the step before (`_Timing`).

Every timed step is a row of its own (the fit keeps their mean, and the rows'
spread is the calibration's step spread). A step is timed by
`STEP_CLOCKS[clock]`: the wall clock, or the calling thread's CPU time ("cpu",
for one torch thread on a CPU), which leaves out the time the process waits
while other processes hold the cores.

Each becomes a `TimedStep` with the features the simulator prices, and
`fit_steps` fits `STEP_FORM` jointly across the block sizes. Prompts are
seeded random token ids, one of its own for every request: requests that share
a prompt share its blocks (prefix caching), and a decode step that reads the
same blocks for every request finds them in the CPU's caches, where served
requests each read their own (24 requests at 1000 tokens, one thread: about
5-8 ms a step shared, 10-11 ms each with its own). The first steps of every
engine are run untimed (allocation and warm-up). A decode point prefills its
prompts, though only its decode steps are timed: its timed steps, 6-10 steps
after that prefill, are in the state a busy server's decodes are in after
admissions. Admitting the requests with random K/V instead made SmolLM2's grid
twice as fast, but left tiny-random's predicted TPOT p99 on the Azure lengths
21-36% low in three runs, where the prefilled grid's was 7-20% off in four
(bench/results/2026-12-07-calibration-fidelity.md).

`grid_for_lengths` fits a grid to a workload: prefill chunks up to its longest
prompt and decode contexts up to its longest request (within the model's
positions), as `blocktune validate` and `calibrate --trace` choose it.

torch is imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from blocktune.runtime.block_manager import blocks_for
from blocktune.tuner.config.calibration import (
    STEP_FORM,
    Calibration,
    EngineCalibration,
    prefill_pairs,
)
from blocktune.tuner.config.policy import ModelShape
from blocktune.tuner.measure.measure import default_grid, measure_calibration, measured_provenance
from blocktune.tuner.measure.processes import map_in_processes
from blocktune.tuner.measure.step_fit import StepFit, TimedStep, fit_steps

if TYPE_CHECKING:
    from blocktune.runtime.engine import Engine
    from blocktune.runtime.model import LlamaModel

__all__ = [
    "GRID_POINT_KV_BYTES",
    "STEP_CLOCKS",
    "EngineGrid",
    "GridTimer",
    "check_grid",
    "default_engine_grid",
    "describe_fit",
    "fitted_engine_calibration",
    "grid_for_lengths",
    "grid_for_pool",
    "measure_engine",
    "measure_engine_calibration",
    "measure_model_kernels",
    "model_shape",
    "warm_up_model",
]

WARMUP_STEPS = 3
WARMUP_BLOCK_SIZE = 16
"""The block size of `warm_up_model`'s engine (any size the backends take)."""
SETTLE_STEPS = 5
"""Untimed decode steps after a batch is admitted: the first steps after an admission run
10-30% slower than the steady ones (measured on tiny-random, one CPU thread), and the
decodes a simulator prices are mostly steady ones."""
STEP_CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
"""How a step is timed: wall time, or the calling thread's CPU time."""
DEFAULT_ADMISSIONS = (1, 4)
"""Prompts admitted together in the grid's admission steps."""
GRID_POINTS = 4
"""Prefill chunks and decode contexts of a grid fitted to a workload (`grid_for_lengths`)."""
GRID_POINT_KV_BYTES = 2**30
"""The most K/V a grid point's requests hold together where the pool the steps are priced for
holds less (`grid_for_pool`): the fit still sees large batches at long contexts, which steady
its terms (SmolLM2's grid held to a 16 MiB pool's 364 tokens kept 9 of 26 points, and
validate missed TPOT p50 by 11.6% where the whole grid's fit missed by 4.6%), and two worker
processes still fit a small machine (SmolLM2's grid fitted to the Azure lengths held 6 GB of
K/V at its largest point, and the system killed a worker)."""


@dataclass(frozen=True)
class EngineGrid:
    """What `measure_engine` times: block sizes, decode batches x contexts, prefill chunks
    and how many prompts an admission step admits together. With `held_tokens`, the points
    whose requests would hold more tokens together are left out, and a decode batch cut
    short that way is timed at the context where it holds that many instead
    (`grid_for_pool`)."""

    block_sizes: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    context_lens: tuple[int, ...]
    prefill_chunks: tuple[int, ...]
    repeats: int
    admissions: tuple[int, ...] = DEFAULT_ADMISSIONS
    held_tokens: int | None = None

    @property
    def growth(self) -> int:
        """The most tokens a request gains beyond its prompt at a point of the grid."""
        return SETTLE_STEPS + self.repeats + 2

    @property
    def longest(self) -> int:
        """The most tokens a request of the grid holds."""
        return max(*self.context_lens, *self.prefill_chunks) + self.growth

    def holds(self, tokens: int) -> bool:
        """Whether requests holding `tokens` tokens together stay within `held_tokens`."""
        return self.held_tokens is None or tokens <= self.held_tokens

    @property
    def num_points(self) -> int:
        """How many points the grid times (each at every block size)."""
        return len(_points(self))

    @property
    def admission_points(self) -> list[tuple[int, int]]:
        """(prompts admitted together, their tokens each) per admission point."""
        largest = max(self.prefill_chunks)
        return [(m, k) for k in self.prefill_chunks for m in self.admissions if m * k <= largest]


def default_engine_grid(*, quick: bool, block_sizes: tuple[int, ...]) -> EngineGrid:
    """The grid of `calibrate --engine` (about a minute for tiny-random on two CPU cores), or
    a tiny one (`quick`) for smoke runs."""
    if quick:
        return EngineGrid(block_sizes, (1, 4), (16, 96), (16, 64), repeats=2)
    return EngineGrid(
        block_sizes, (1, 8, 32), (32, 256, 1024, 2048), (32, 128, 512, 1024), repeats=5
    )


def grid_for_lengths(
    grid: EngineGrid, prompt_tokens: np.ndarray, total_tokens: np.ndarray, max_tokens: int
) -> EngineGrid:
    """`grid` with prefill chunks reaching the longest prompt and decode contexts reaching the
    longest request (`GRID_POINTS` each, geometric from the grid's shortest), every request
    of the grid within `max_tokens` tokens (the model's positions, or a smaller pool).

    Requests of more than `max_tokens` tokens are never served (the engine refuses them,
    `blocktune validate` leaves them out), so they do not stretch the grid: timing prompts
    longer than any served one only moves the fit away from the steps it prices."""
    room = max_tokens - 1 - grid.growth
    served = total_tokens <= max_tokens
    if served.any():
        prompt_tokens, total_tokens = prompt_tokens[served], total_tokens[served]

    def reaching(longest: int, shortest: int) -> tuple[int, ...]:
        top = max(shortest, min(int(longest), room))
        points = np.geomspace(min(shortest, top), top, GRID_POINTS)
        return tuple(sorted({int(round(x)) for x in points}))

    return replace(
        grid,
        prefill_chunks=reaching(np.max(prompt_tokens), min(grid.prefill_chunks)),
        context_lens=reaching(np.max(total_tokens), min(grid.context_lens)),
    )


def grid_for_pool(grid: EngineGrid, model: LlamaModel, pool_tokens: int) -> EngineGrid:
    """`grid` for steps served from a pool of `pool_tokens` slots: its points hold at most the
    pool's tokens or `GRID_POINT_KV_BYTES` of `model`'s K/V, whichever is more, and its decode
    batches reach down to the most requests the pool holds at the grid's shortest context."""
    per_token = model_shape(model).kv_bytes_per_token
    pool_batch = pool_tokens // (min(grid.context_lens) + grid.growth)
    batches = set(grid.batch_sizes)
    if 1 < pool_batch < max(batches):
        batches.add(pool_batch)
    return replace(
        grid,
        batch_sizes=tuple(sorted(batches)),
        held_tokens=max(pool_tokens, GRID_POINT_KV_BYTES // per_token),
    )


def model_shape(model: LlamaModel, name: str | None = None) -> ModelShape:
    """A runtime model's shape (its `ModelConfig`, dtype and counted parameters), named
    `name`: a policy's `model` section, and the model an engine calibration records."""
    c = model.config
    return ModelShape(
        name=name,
        num_layers=c.num_layers,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        vocab_size=c.vocab_size,
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
    jobs: int = 1,
    progress: Callable[[str], None] = lambda _: None,
) -> EngineCalibration:
    """Time the grid's steps of `model` (on its device, with `backend`) and fit them; with
    `jobs` above 1, the points are shared out to that many processes (`map_in_processes`)."""
    import torch

    check_grid(grid, model, clock)
    count = grid.num_points
    if jobs == 1:
        steps = _time_points(model, grid, backend, clock, seed, (0, range(count)), progress)
    else:
        sizes = list(grid.block_sizes)
        progress(f"engine steps: {count} points at block sizes {sizes} in {jobs} processes")
        shares = [(worker, range(worker, count, jobs)) for worker in range(jobs)]
        timed = map_in_processes(
            partial(_time_points, model, grid, backend, clock, seed),
            shares,
            jobs=jobs,
            threads=torch.get_num_threads(),
            done=lambda finished, total: progress(f"engine steps: {finished} of {total} timed"),
        )
        steps = [step for share in timed for step in share]
    return fitted_engine_calibration(
        model,
        name,
        grid,
        backend,
        fit_steps(steps),
        clock=clock,
        how=f"by `blocktune calibrate --engine`, in {jobs} process(es) at once",
    )


def check_grid(grid: EngineGrid, model: LlamaModel, clock: str) -> None:
    """Raise `ValueError` unless `model`'s steps over `grid` can be timed by `clock`."""
    check_clock(clock, model)
    limit = model.config.max_position_embeddings
    if grid.longest >= limit:
        raise ValueError(
            f"the grid's requests hold up to {grid.longest} tokens, the model has {limit} "
            "positions (one more is needed): use shorter context_lens and prefill_chunks"
        )


def fitted_engine_calibration(
    model: LlamaModel,
    name: str,
    grid: EngineGrid,
    backend: str,
    fit: StepFit,
    *,
    clock: str,
    how: str,
) -> EngineCalibration:
    """The engine calibration holding `fit` (`fit_steps` of the steps timed over `grid`;
    `how` says by what, when and where, for the provenance)."""
    import torch

    return fit.engine_calibration(
        measured_provenance(
            model.device.type,
            backend,
            grid,
            f"measured {how} (grid points round-robin over the block sizes); fitted jointly "
            "by non-negative least squares of the relative error, scaled so that measured / "
            f"fitted is 1 on average: {STEP_FORM}",
        ),
        model_shape(model, name),
        threads=torch.get_num_threads(),
        clock=clock,
    )


class GridTimer:
    """Times a share of a grid's points, one at a time when asked: each point at every block
    size, round-robin (the order of the sizes rotating from point to point), on one warmed-up
    engine per size. `blocktune validate` times its points between a live run's steps, so the
    calibration sees the machine as the live runs do; `_time_points` times them in a row."""

    def __init__(
        self,
        model: LlamaModel,
        grid: EngineGrid,
        backend: str,
        clock: str,
        seed: int,
        share: tuple[int, Sequence[int]],
    ) -> None:
        worker, indices = share
        self.grid = grid
        self.steps: list[TimedStep] = []
        self._timing = _Timing(np.random.default_rng([seed, worker]), STEP_CLOCKS[clock])
        self._points = _points(grid)
        self._pending = list(indices)
        self._count = len(self._pending)
        self._engines = {b: _engine(model, grid, b, backend) for b in grid.block_sizes}
        for engine in self._engines.values():
            _warm_up(engine, self._timing)

    @property
    def timed(self) -> int:
        """Points of the share timed so far."""
        return self._count - len(self._pending)

    def time_until(self, fraction: float) -> None:
        """Time points until at least `fraction` (0 to 1) of the share is timed."""
        while self._pending and self.timed < fraction * self._count:
            self.time_next()

    def time_next(self) -> None:
        """Time the share's next point at every block size."""
        index = self._pending.pop(0)
        sizes = list(self.grid.block_sizes)
        turn = index % len(sizes)  # rotate which size goes first
        for block_size in sizes[turn:] + sizes[:turn]:
            engine = self._engines[block_size]
            timed = self._points[index](engine, self.grid, self._timing)
            self.steps += [replace(step, moment=index) for step in timed]

    def close(self) -> list[TimedStep]:
        """Time what is left of the share, free the engines; the timed steps."""
        self.time_until(1.0)
        self._engines.clear()
        return self.steps


def _time_points(
    model: LlamaModel,
    grid: EngineGrid,
    backend: str,
    clock: str,
    seed: int,
    share: tuple[int, Sequence[int]],
    progress: Callable[[str], None] = lambda _: None,
) -> list[TimedStep]:
    """Time the grid's points of `share` (a worker's number and the indices of its points)
    in a row (`GridTimer`)."""
    timer = GridTimer(model, grid, backend, clock, seed, share)
    total, sizes = grid.num_points, list(grid.block_sizes)
    for n, index in enumerate(share[1]):
        if n % 10 == 0:
            progress(f"engine steps: point {index + 1} of {total} at block sizes {sizes}")
        timer.time_next()
    return timer.close()


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
    jobs: int = 1,
    progress: Callable[[str], None] = lambda _: None,
) -> Calibration:
    """What `calibrate --engine` writes: the kernel calibration (its `quick` grid or the full
    one) on the model's device for its attention shape and dtype, with the model's engine
    steps timed over `grid` and fitted (in `jobs` processes)."""
    check_clock(clock, model)
    calibration = measure_model_kernels(model, name, grid, quick=quick, progress=progress)
    engine = measure_engine(
        model,
        name,
        grid,
        calibration.provenance.backend,
        clock=clock,
        seed=seed,
        jobs=jobs,
        progress=progress,
    )
    for line in describe_fit(engine):
        progress(line)
    return calibration.with_engine(engine)


def measure_model_kernels(
    model: LlamaModel,
    name: str,
    grid: EngineGrid,
    *,
    quick: bool,
    progress: Callable[[str], None] = lambda _: None,
) -> Calibration:
    """The kernel calibration (its `quick` grid or the full one) on `model`'s device for its
    attention shape and dtype, at `grid`'s block sizes: an engine calibration's first part."""
    device = model.device.type
    shape = model_shape(model, name)
    kernel_grid = replace(
        default_grid(device, quick=quick, block_sizes=grid.block_sizes),
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        dtype=shape.dtype,
    )
    return measure_calibration(kernel_grid, device, progress=progress)


def describe_fit(engine: EngineCalibration) -> list[str]:
    """The fit in words: per block size its residuals, per-size terms with their standard
    errors and its scale (where the sizes have their own), the shared terms with theirs
    (before the scales), and whether the step time depends on B."""
    from blocktune.tuner.config.calibration import PER_SIZE_TERMS, StepCoefficients

    errors = engine.standard_errors or {}
    lines = []
    for block_size, fit in engine.residuals.items():
        own = ", ".join(
            _with_error(term, engine.steps[block_size], errors.get(block_size))
            for term in PER_SIZE_TERMS
        )
        if engine.size_scales is not None:
            own += f", scale {engine.size_scales[block_size]:.3f}"
        lines.append(
            f"step fit at B={block_size}: {fit.points} steps, relative residual rms "
            f"{fit.rms_relative:.1%}, max {fit.max_relative:.1%}; {own}"
        )
    first = min(engine.steps)
    shared = [t for t in StepCoefficients.model_fields if t not in PER_SIZE_TERMS]
    unscaled = 1 / (engine.size_scales or {first: 1.0})[first]
    terms = ", ".join(
        _with_error(t, engine.steps[first], errors.get(first), unscaled) for t in shared
    )
    where = "" if engine.size_scales is None else " (before each size's scale)"
    lines.append(f"shared terms{where}: {terms}")
    if engine.step_spread:
        q = engine.step_spread
        lines.append(
            f"step spread (measured / fitted, mean 1): min {q[0]:.2f}, median "
            f"{q[len(q) // 2]:.2f}, max {q[-1]:.2f}"
        )
    lines.append(engine.block_size_verdict())
    return lines


def _with_error(term: str, values, errors, factor: float = 1.0) -> str:
    value = getattr(values, term) * factor
    if errors is None:
        return f"{term} {value:.3g}"
    return f"{term} {value:.3g} ± {getattr(errors, term) * factor:.2g}"


def _engine(model: LlamaModel, grid: EngineGrid, block_size: int, backend: str) -> Engine:
    from blocktune.runtime.engine import Engine
    from blocktune.tuner.config.engine_settings import engine_settings

    rows = max(grid.batch_sizes) + max(grid.admissions) + 2
    blocks = rows * (-(-grid.longest // block_size) + 1)
    if grid.held_tokens is not None:  # no point holds more (`_points`), nor the pool more
        blocks = min(blocks, -(-grid.held_tokens // block_size) + 2 * rows)
    settings = engine_settings(
        None,
        num_blocks=blocks,
        block_size=block_size,
        candidates=(block_size,),
        max_num_seqs=rows,
        max_model_len=grid.longest + 1,
        attention_backend=backend,
        enable_prefix_caching=True,
    )
    return Engine(model, settings.engine_config())


def _prompt(engine: Engine, rng: np.random.Generator, length: int) -> list[int]:
    return rng.integers(0, engine.model.config.vocab_size, length).tolist()


def _start(
    engine: Engine, timing: _Timing, count: int, context: int, steps: int, *, beside: int = 0
):
    """Admit `count` requests of `context`-token prompts, each its own (no shared blocks),
    that decode `steps` more steps, in a step beside `beside` decodes."""
    from blocktune.runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    ids = [engine.add_request(_prompt(engine, timing.rng, context), params) for _ in range(count)]
    engine.step()
    timing.step_tokens.add(beside + count * context)
    return ids


def _timed_step(engine: Engine, timer: Callable[[], float]) -> float:
    begin = timer()
    engine.step()
    return timer() - begin


def warm_up_model(model: LlamaModel, backend: str) -> None:
    """Serve a few steps of two short requests on a small throwaway engine for `model`, so
    that what a process pays once (its weights packed for oneDNN by their first product:
    0.6 s of SmolLM2's first step on one thread here, 12 ms of tiny-random's) is paid before
    anything is timed. The simulator prices a warm engine, as a server is after its start."""
    from blocktune.runtime.engine import Engine
    from blocktune.tuner.config.engine_settings import engine_settings

    size = WARMUP_BLOCK_SIZE
    settings = engine_settings(
        None,
        num_blocks=4,
        block_size=size,
        candidates=(size,),
        max_num_seqs=2,
        max_model_len=size,
        attention_backend=backend,
        enable_prefix_caching=False,
    )
    engine = Engine(model, settings.engine_config())
    _warm_up(engine, _Timing(np.random.default_rng(0), time.perf_counter))


def _warm_up(engine: Engine, timing: _Timing) -> None:
    ids = _start(engine, timing, 2, 8, WARMUP_STEPS)
    for _ in range(WARMUP_STEPS):
        engine.step()
    for request_id in ids:
        engine.cancel(request_id)


@dataclass
class _Timing:
    """What the points one process times share: the seeded source of their prompts, the
    clock, and the token counts its engines' steps computed (the decode points' prefills
    and batches, the admission steps).

    A step of a token count the process has not computed before costs more than one that
    repeats it (the CPU's matrix kernels are prepared and cached per shape): tiny-random's
    one-prompt step took 5-10 ms at a new count and 3-7 ms at one just computed, two
    prompts of new lengths but the count of the step before as little as a repeat;
    SmolLM2's 300-1,600 ms steps showed no difference beyond the machine's noise. Whether
    a served step pays it depends on the workload (prompts of a few dozen lengths repeat
    their counts; the Azure conversation lengths seldom do), so the grid times both: every
    other admission step at a count of its own (`fresh_lengths`, `new_count` 1), the
    others repeating the step before, and the fit prices a new count on its own
    (`STEP_FORM`), which the simulator charges where its run meets a count first."""

    rng: np.random.Generator
    clock: Callable[[], float]
    step_tokens: set[int] = field(default_factory=set)

    def fresh_lengths(self, prompts: int, tokens: int, decoding: int) -> list[int]:
        """Lengths of `prompts` prompts of `tokens` tokens admitted beside `decoding`
        decodes, the last moved by as few tokens as it takes (up first) for the step's
        token count to be one this process has not computed; recorded as computed."""
        base = decoding + prompts * tokens
        shifts = itertools.chain.from_iterable((k, -k) if k else (0,) for k in itertools.count())
        shift = next(d for d in shifts if tokens + d > 0 and base + d not in self.step_tokens)
        self.step_tokens.add(base + shift)
        return [tokens] * (prompts - 1) + [tokens + shift]


Point = Callable[["Engine", EngineGrid, _Timing], list[TimedStep]]


def _points(grid: EngineGrid) -> list[Point]:
    """The grid's points (see the module doc), each timed at one engine by calling it."""
    shortest = min(grid.context_lens)
    points: list[Point] = []
    for batch in grid.batch_sizes:
        for context in _contexts(grid, batch):
            points.append(partial(_decode_point, short=0, long=batch, context=context))
            if batch > 1 and context > shortest:
                half = batch // 2
                points.append(
                    partial(_decode_point, short=half, long=batch - half, context=context)
                )
    middle = grid.batch_sizes[len(grid.batch_sizes) // 2]
    held = middle * (grid.context_lens[len(grid.context_lens) // 2] + grid.growth)
    for decoding in (0, middle):
        for prompts, tokens in grid.admission_points:
            if decoding and not grid.holds(held + prompts * tokens):
                continue
            points.append(
                partial(_admission_point, decoding=decoding, prompts=prompts, tokens=tokens)
            )
    return points


def _contexts(grid: EngineGrid, batch: int) -> list[int]:
    """The decode contexts a batch of `batch` requests is timed at: the grid's within its
    `held_tokens` and, where that stops the batch short of the longest, the longest context
    within it instead."""
    fitting = [c for c in grid.context_lens if grid.holds(batch * (c + grid.growth))]
    if grid.held_tokens is not None and len(fitting) < len(grid.context_lens):
        filling = grid.held_tokens // batch - grid.growth
        if filling > max(fitting, default=0):
            fitting.append(filling)
    return fitting


def _decode_point(
    engine: Engine,
    grid: EngineGrid,
    timing: _Timing,
    *,
    short: int,
    long: int,
    context: int,
) -> list[TimedStep]:
    """A decode batch of `long` requests at `context` and `short` at the grid's shortest."""
    size, shortest = engine.block_size, min(grid.context_lens)
    lifetime = SETTLE_STEPS + grid.repeats
    ids = _start(engine, timing, short, shortest, lifetime + 1) if short else []
    ids += _start(engine, timing, long, context, lifetime, beside=short)
    for _ in range(SETTLE_STEPS):
        engine.step()
    timing.step_tokens.add(short + long)
    steps = []
    for j in range(grid.repeats):
        grown = SETTLE_STEPS + 1 + j  # tokens each request gained since its admission
        low, high = shortest + grown + 1, context + grown  # the short ones started a step early
        tokens = short * low + long * high
        blocks = short * blocks_for(low, size) + long * blocks_for(high, size)
        seconds = _timed_step(engine, timing.clock)
        steps.append(
            TimedStep(
                size, short + long, tokens, blocks, 0, seconds, padded_tokens=(short + long) * high
            )
        )
    for request_id in ids:
        engine.cancel(request_id)
    return steps


def _admission_point(
    engine: Engine,
    grid: EngineGrid,
    timing: _Timing,
    *,
    decoding: int,
    prompts: int,
    tokens: int,
) -> list[TimedStep]:
    """Steps that admit `prompts` prompts of about `tokens` tokens each (they finish in the
    step), beside `decoding` requests at the grid's middle context: the first, third...
    at a token count new to the process, each other one at the count of the step before
    (`_Timing`)."""
    from blocktune.runtime.sampling import SamplingParams

    size = engine.block_size
    context = grid.context_lens[len(grid.context_lens) // 2]
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    lifetime = SETTLE_STEPS + grid.repeats
    ids = _start(engine, timing, decoding, context, lifetime) if decoding else []
    for _ in range(SETTLE_STEPS if decoding else 0):
        engine.step()
    timing.step_tokens.add(decoding)
    steps = []
    for j in range(grid.repeats):
        held = context + SETTLE_STEPS + 1 + j  # the decodes' context in this step
        new_count = j % 2 == 0  # a count of its own, then the same again
        if new_count:
            lengths = timing.fresh_lengths(prompts, tokens, decoding)
        for length in lengths:
            engine.add_request(_prompt(engine, timing.rng, length), one)
        seconds = _timed_step(engine, timing.clock)
        steps.append(
            TimedStep(
                size,
                decoding + prompts,
                decoding * held + sum(lengths),
                decoding * blocks_for(held, size) + sum(blocks_for(n, size) for n in lengths),
                sum(lengths),
                seconds,
                padded_tokens=decoding * held,
                prefill_pairs=sum(prefill_pairs(0, n) for n in lengths),
                prompt_chunks=prompts,
                new_count=int(new_count),
            )
        )
    for request_id in ids:
        engine.cancel(request_id)
    return steps

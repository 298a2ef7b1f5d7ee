"""`blocktune validate`: the simulator's predictions against the live engine, per block size.

Serves the first `--requests` requests of TRACE (default: the embedded
customer-service day) on the live engine with a virtual clock, `--runs` times
per block size, and replays them on the simulator with an engine calibration
(`--calibration FILE`, or one timed between the live runs' steps on a grid fitted
to the trace's lengths: prefill chunks up to its longest prompt, decode contexts
up to its longest request). On a CPU device it times steps by the timing thread's
CPU time with one torch thread unless told otherwise. Prints the predicted and
measured metrics with their relative errors, the run-to-run noise and, by
tokens/s, TPOT p50 and TTFT p99, how many pairs of block sizes beyond the
noise (a t-test at 95% on the runs' pooled deviation) both order alike;
`--json FILE` writes the same as JSON (``-`` prints it instead of the table).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from blocktune.tuner.cli.arguments import block_size_arg, positive_int
from blocktune.tuner.cli.day_args import add_day_arguments
from blocktune.tuner.cli.measure_args import add_measurement_arguments
from blocktune.tuner.cli.model_args import add_model_arguments
from blocktune.tuner.cli.policy_args import add_calibration_argument, add_policy_argument
from blocktune.tuner.cli.trace_args import add_load_arguments
from blocktune.tuner.measure.processes import DEFAULT_JOBS, WorkerProcessLost, default_jobs

if TYPE_CHECKING:
    from blocktune.runtime.model import LlamaModel
    from blocktune.tuner.config.calibration import Calibration
    from blocktune.tuner.config.policy import Policy
    from blocktune.tuner.fidelity.validation import InterleavedGrid, Validation
    from blocktune.tuner.sim.workload import Workload

__all__ = ["register"]

DEFAULT_REQUESTS = 300
DEFAULT_RUNS = 2


def run_validate(args: argparse.Namespace) -> int:
    """Serve a trace on the live engine (a virtual clock advanced by each step's measured
    time) and on the simulator, for each block size; print predicted and measured tokens/s,
    TTFT and TPOT p50/p99, peak KV blocks and preemptions with their relative errors, and
    how both rank the block sizes by tokens/s, TPOT p50 and TTFT p99. Without --calibration
    an engine calibration is measured between the live runs' steps (each run times a share of
    its grid as it goes, so both see the machine alike), its prefill grid reaching the trace's
    longest prompt; on a CPU, steps are timed by the CPU clock with one thread by default. With
    --engine vllm the live side is a vLLM server per block size, sent the requests at their
    arrival times, and --calibration must be one `calibrate --engine vllm` wrote."""
    if args.engine == "vllm":
        return run_vllm_validate(args)
    from blocktune.tuner.cli.day_args import load_trace_or_day
    from blocktune.tuner.cli.measure_args import measurement_defaults
    from blocktune.tuner.cli.model_args import load_shaped_model_from_args
    from blocktune.tuner.cli.policy_args import load_policy_and_calibration
    from blocktune.tuner.fidelity.validation import validate
    from blocktune.tuner.sim.workload import Workload

    def progress(message: str) -> None:
        from tqdm import tqdm

        tqdm.write(f"validate: {message}", file=sys.stderr)  # above the live runs' bar

    try:
        measurement_defaults(args, args.device)
        policy, calibration = load_policy_and_calibration(args.policy, args.calibration)
        frame, label = load_trace_or_day(args)
        workload = Workload.from_frame(frame.sort_values("arrival_s").head(args.requests))
        model, name = load_shaped_model_from_args(args, device=args.device)
        block_sizes = tuple(args.block_sizes or policy.candidates)
        calibration, interleave = _engine_calibration(
            args, policy, calibration, model, name, block_sizes, workload, progress
        )
        clock = calibration.engine.clock if interleave is None else interleave.clock
        if clock == "wall" and args.device == "cpu":
            print(
                "warning: the wall clock times the steps on a CPU: the load of other processes "
                "shows as step time; read the errors against the run-to-run noise printed with "
                "them (`--clock cpu --threads 1` leaves that load out)",
                file=sys.stderr,
            )
        if args.json != "-":
            print(f"trace: {label}, first {len(workload)} requests")
            print(f"model: {name}; policy: {policy.deployment}, KV budget {policy.kv_budget}")
        validation = validate(
            workload,
            policy,
            model,
            calibration,
            block_sizes,
            runs=args.runs,
            seed=args.seed,
            jobs=args.jobs,
            interleave=interleave,
            progress=progress,
        )
    except ValueError as error:  # every bad input: policy, trace, model, calibration
        print(f"error: {error}", file=sys.stderr)
        return 2
    except WorkerProcessLost as error:
        print(
            f"error: {error}; --jobs 1 does the work in this process, one point or live run "
            "at a time (less memory at once), and fewer --requests make shorter runs",
            file=sys.stderr,
        )
        return 1
    setup = validation.setup
    calibration_lines = (
        f"calibration: {setup['calibration']}",
        f"calibration: {setup['block_size_effect']}",
    )
    return _report(validation, label, args, preface=calibration_lines)


def run_vllm_validate(args: argparse.Namespace) -> int:
    """`validate --engine vllm` (see `tuner.fidelity.vllm_validation`)."""
    import httpx

    from blocktune.tuner.cli.day_args import load_trace_or_day
    from blocktune.tuner.cli.policy_args import load_policy_and_calibration
    from blocktune.tuner.cli.vllm_engine import vllm_setup
    from blocktune.tuner.fidelity.vllm_validation import validate_vllm
    from blocktune.tuner.measure.vllm_server import VllmStartError
    from blocktune.tuner.sim.workload import Workload

    def progress(message: str) -> None:
        print(f"validate (vllm): {message}", file=sys.stderr, flush=True)

    if args.calibration is None:
        print(
            "error: --engine vllm needs --calibration FILE (`blocktune calibrate --engine vllm` "
            "writes one)",
            file=sys.stderr,
        )
        return 2
    try:
        policy, calibration = load_policy_and_calibration(args.policy, args.calibration)
        frame, label = load_trace_or_day(args)
        workload = Workload.from_frame(frame.sort_values("arrival_s").head(args.requests))
        template, _model, logs = vllm_setup(args)
        block_sizes = tuple(args.block_sizes or policy.candidates)
        if args.json != "-":
            print(f"trace: {label}, first {len(workload)} requests")
            print(f"policy: {policy.deployment}, KV budget {policy.kv_budget}")
            print(f"calibration: {calibration.describe()}", flush=True)
        progress(f"servers' output in {logs}")
        validation = validate_vllm(
            workload,
            policy,
            calibration,
            block_sizes,
            template,
            logs,
            runs=args.runs,
            start_timeout_s=args.vllm_start_timeout,
            seed=args.seed,
            progress=progress,
        )
    except (ValueError, VllmStartError, httpx.HTTPError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    pools = validation.setup["pool_blocks"]
    served = validation.setup["vllm_pool_blocks"]
    blocks = "KV blocks per size, simulated / vLLM's: " + ", ".join(
        f"B={b}: {pools[b]} / {served.get(b)}" for b in pools
    )
    return _report(validation, label, args, preface=(blocks,))


def _report(
    validation: Validation, label: str, args: argparse.Namespace, preface: tuple[str, ...] = ()
) -> int:
    """Print `validation` as JSON (`--json -`) or as the table, after `preface`'s lines, and
    write `--json FILE`; 0."""
    from blocktune.tuner.fidelity.validation_report import (
        format_left_out,
        format_validation_table,
        validation_dict,
        write_validation,
    )

    validation.trace["label"] = label
    if args.json == "-":
        print(json.dumps(validation_dict(validation), indent=2, allow_nan=False))
        return 0
    left_out = format_left_out(validation.trace)
    if left_out is not None:
        print(left_out)
    for line in preface:
        print(line)
    print(format_validation_table(validation))
    if args.json is not None:
        write_validation(validation, Path(args.json))
        print(f"wrote {args.json}")
    return 0


def _engine_calibration(
    args: argparse.Namespace,
    policy: Policy,
    calibration: Calibration,
    model: LlamaModel,
    name: str,
    block_sizes: tuple[int, ...],
    workload: Workload,
    progress: Callable[[str], None],
) -> tuple[Calibration, InterleavedGrid | None]:
    """The calibration given (it must have an engine section) and None; or a kernel
    calibration measured now and the grid of its engine section, for `validate` to time
    between the live runs' steps: the default grid fitted to the workload's lengths (those
    the policy's pool holds) and to the pool (`grid_for_pool`). torch uses the
    calibration's threads unless --threads says otherwise."""
    from blocktune.tuner.cli.measure_args import set_threads
    from blocktune.tuner.config.calibration import CalibrationError
    from blocktune.tuner.fidelity.validation import InterleavedGrid, pool_slots
    from blocktune.tuner.measure.engine_measure import (
        default_engine_grid,
        grid_for_lengths,
        grid_for_pool,
        measure_model_kernels,
    )

    if args.calibration is not None:
        if calibration.engine is None:
            raise CalibrationError(
                f"{args.calibration} has no engine section: write one with "
                "`blocktune calibrate --engine`"
            )
        set_threads(args.threads or calibration.engine.threads)
        grid = calibration.engine.provenance.grid or {}
        reach, longest = max(grid.get("prefill_chunks") or [0]), int(workload.prompt_tokens.max())
        if reach < longest:
            print(
                f"warning: {args.calibration} times prefills of up to {reach} tokens, the "
                f"trace's longest prompt has {longest}: longer prompts are extrapolated "
                "(`blocktune calibrate --engine --trace` fits the grid to a trace)",
                file=sys.stderr,
            )
        return calibration, None
    set_threads(args.threads)
    pool = pool_slots(policy, model, calibration, block_sizes)
    grid = grid_for_lengths(
        default_engine_grid(quick=False, block_sizes=block_sizes),
        workload.prompt_tokens,
        workload.total_tokens,
        min(model.config.max_position_embeddings, pool),
    )
    grid = grid_for_pool(grid, model, pool)
    progress(
        f"an engine calibration measured between the live runs' steps ({args.clock} clock, "
        f"prefill chunks {list(grid.prefill_chunks)}, contexts {list(grid.context_lens)})"
    )
    # The comparison prices steps by the engine section alone: the kernel part's quick grid.
    kernels = measure_model_kernels(model, name, grid, quick=True, progress=progress)
    return kernels, InterleavedGrid(grid, name, args.clock)


def register(commands: argparse._SubParsersAction) -> None:
    """Add `validate` to the command line."""
    from blocktune.tuner.cli.vllm_engine import add_vllm_arguments

    parser = commands.add_parser(
        "validate",
        help="compare the simulator's predictions with the live engine, per block size",
        description=run_validate.__doc__,
    )
    add_load_arguments(
        parser,
        trace_help="trace file (default, or 'synthetic': the embedded customer-service day)",
        trace_optional=True,
        seed_help="seed of the embedded day, of --rate arrivals, of random weights and of the "
        "prompts' token ids (default: 0)",
    )
    add_day_arguments(parser)
    add_policy_argument(
        parser, "the KV budget and candidates (its model section is replaced by the live model's)"
    )
    add_model_arguments(parser)
    parser.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    add_calibration_argument(parser)
    parser.add_argument(
        "--requests",
        type=positive_int,
        default=DEFAULT_REQUESTS,
        help="serve the first N requests of the trace (default: %(default)s)",
    )
    parser.add_argument(
        "--block-sizes",
        type=block_size_arg,
        nargs="+",
        metavar="B",
        help="block sizes to compare (default: the policy's candidates)",
    )
    parser.add_argument(
        "--runs",
        type=positive_int,
        default=DEFAULT_RUNS,
        help="live runs per block size, for the run-to-run noise (default: %(default)s)",
    )
    parser.add_argument(
        "--json",
        metavar="FILE",
        help="write the comparison as JSON to FILE ('-': print it instead of the table)",
    )
    add_measurement_arguments(parser, shared_cpu=True)
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=default_jobs(),
        metavar="N",
        help="worker processes that time the calibration's points and serve the live runs at "
        "once, each with --threads torch threads (default: %(default)s, the machine's cores "
        f"up to {DEFAULT_JOBS}; 1: all in this process)",
    )
    parser.add_argument(
        "--engine",
        choices=("blocktune", "vllm"),
        default="blocktune",
        help="the live side: blocktune's engine, or a vLLM server per block size (--model: "
        "its Hugging Face folder; see the --engine vllm options) (default: %(default)s)",
    )
    add_vllm_arguments(parser)
    parser.set_defaults(handler=run_validate)

"""What the calibration benches share: a trace served as `blocktune validate` serves it.

`add_trace_arguments` adds the trace, its format, how many of its first requests, the
policy, the model and the block size; `TraceSetup.of` loads them (one torch thread, the
model on the CPU) with the policy's model section replaced by the model's shape and its
candidates by the block size, and the calibration grid validate fits to the trace.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from blocktune.tuner.cli import build_parser
from blocktune.tuner.cli.day_args import load_trace_or_day
from blocktune.tuner.cli.policy_args import load_policy_and_calibration
from blocktune.tuner.config.calibration import Calibration
from blocktune.tuner.config.policy import Policy
from blocktune.tuner.measure.engine_measure import (
    EngineGrid,
    default_engine_grid,
    grid_for_lengths,
    model_shape,
)
from blocktune.tuner.sim.workload import Workload


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """The trace, its first requests, the policy, the model and the block size."""
    parser.add_argument("trace", help="a trace file")
    parser.add_argument("--format", default="azure", help="its format (default: azure)")
    parser.add_argument("--requests", type=int, default=300, help="first requests (300)")
    parser.add_argument("--policy", default="customer_service_llama8b", help="policy (default)")
    parser.add_argument("--model", default="tiny-random", help="default: tiny-random")
    parser.add_argument("--block-size", type=int, default=16, help="default: 16")


@dataclass(frozen=True)
class TraceSetup:
    """A model, the trace's first requests it can hold, the policy served at one block size
    (`served`), its calibration and the calibration grid fitted to the trace."""

    model: object
    workload: Workload
    served: Policy
    calibration: Calibration
    grid: EngineGrid

    @classmethod
    def of(cls, args: argparse.Namespace, seed: int = 0) -> TraceSetup:
        from blocktune.runtime.loading import load_weights

        torch.set_num_threads(1)
        model = load_weights(args.model, seed=seed, device="cpu")
        # The trace and the policy as `blocktune validate` reads them.
        validate_args = build_parser().parse_args(
            ["validate", args.trace, "--format", args.format, "--policy", args.policy]
        )
        frame, _ = load_trace_or_day(validate_args)
        workload = Workload.from_frame(frame.sort_values("arrival_s").head(args.requests))
        workload = workload.without_longer_than(model.config.max_position_embeddings)
        policy, calibration = load_policy_and_calibration(args.policy)
        served = Policy.model_validate(
            {**dict(policy), "model": model_shape(model), "candidates": (args.block_size,)}
        )
        grid = grid_for_lengths(
            default_engine_grid(quick=False, block_sizes=(args.block_size,)),
            workload.prompt_tokens,
            workload.total_tokens,
            model.config.max_position_embeddings,
        )
        return cls(model, workload, served, calibration, grid)

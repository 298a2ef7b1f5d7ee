"""`blocktune recommend`: price every candidate block size for a trace under a policy.

The trace's requests (all of them, or the last `--last N`) fill a length
window; the selector prices each candidate with the policy's calibration and
prints every cost term, the choice, the principled prior and the source
article's sqrt rule, or the same as JSON with `--json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from blocktune.tuner.cli.arguments import positive_int
from blocktune.tuner.cli.policy_args import add_policy_argument, load_policy_and_calibration
from blocktune.tuner.cli.trace_args import add_load_arguments, load_from_args, report_skipped
from blocktune.tuner.config.defaults import DEFAULT_BLOCK_SIZE, SYNTHETIC_TRACE
from blocktune.tuner.config.text_table import text_table

if TYPE_CHECKING:
    import pandas as pd

    from blocktune.tuner.core.selector import Decision
    from blocktune.tuner.sim.window import WindowSnapshot

__all__ = ["register"]


def _kib(value: float) -> str:
    return f"{value / 1024:.1f}"


def _forecast_columns() -> tuple:
    from blocktune.tuner.sim.served import ServedMetrics

    return (
        ("capacity", "x load", lambda f: f"{f.capacity:.3g}"),
        (
            "interval",
            "x load",
            lambda f: f"{f.capacity_interval[0]:.3g}-{f.capacity_interval[1]:.3g}",
        ),
        ("saturated", "tok/s", lambda f: f"{f.sustained_tokens_per_s:.4g}"),
        *ServedMetrics.columns(lambda f: f.observed),
        ("preempt", "", lambda f: str(f.observed.preemptions)),
        ("TTFT p99", "@headroom", lambda f: f"{f.headroom.ttft_p99_s:.3f}"),
    )


_COST_COLUMNS = (
    ("padding", "%", lambda c: f"{c.padding_ratio:.1%}"),
    ("pad/req", "KiB", lambda c: _kib(c.padding_bytes_per_request)),
    ("slots", "tokens", lambda c: f"{c.capacity_tokens:.0f}"),
    ("running", "requests", lambda c: f"{c.concurrent_requests:.1f}"),
    ("weights", "us/tok", lambda c: f"{c.weights_s_per_token * 1e6:.3f}"),
    ("k.table", "us/tok", lambda c: f"{c.kernel_translation_s_per_token * 1e6:.3f}"),
    ("k.read", "us/tok", lambda c: f"{c.kernel_bandwidth_s_per_token * 1e6:.3f}"),
    ("host", "us/tok", lambda c: f"{c.host_s_per_token * 1e6:.3f}"),
    ("prefix", "us/tok", lambda c: f"{c.prefix_loss_s_per_token * 1e6:.3f}"),
    ("J total", "us/tok", lambda c: f"{c.objective_s_per_token * 1e6:.3f}"),
)


def _rows(columns: tuple, items: list, chosen: int) -> list[list[str]]:
    rows = [["B", *(t for t, _, _ in columns)], ["tokens", *(u for _, u, _ in columns)]]
    for item in items:
        mark = "*" if item.block_size == chosen else " "
        rows.append([f"{mark} {item.block_size}", *(cell(item) for _, _, cell in columns)])
    return rows


def format_decision_table(decision: Decision, snapshot: WindowSnapshot) -> str:
    """The predicted service of every candidate, its cost terms, and the decision in words."""
    lines = []
    if decision.forecasts:
        lines.append(
            "predicted service on the window at the observed load (capacity: the load "
            "multiple served within the SLO, with its interval over bootstrap resamples; "
            "saturated: tokens/s when saturated):"
        )
        lines += text_table(_rows(_forecast_columns(), decision.forecasts, decision.block_size))
    lines.append("cost terms (J: time per generated token with the KV budget full):")
    lines += text_table(_rows(_COST_COLUMNS, decision.candidates, decision.block_size))
    total = snapshot.total
    lines.insert(
        0,
        f"window: {snapshot.count} requests, prompt+output tokens median {total.median:.0f}, "
        f"p90 {total.p90:.0f}, p99 {total.p99:.0f}; {snapshot.shared_prefixes} reuse a prefix",
    )
    lines.append(
        f"recommended: B={decision.recommended_block_size} ("
        + (
            "the choice matters"
            if decision.material
            else "no other size is better beyond the forecast's noise"
        )
        + f"; * marks it; ranked on {decision.ranked_by})"
    )
    if decision.principled_block_tokens is not None:
        lines.append(
            f"prior: B* = sqrt(2 c_block l / c_pad) = {decision.principled_block_tokens:.1f} "
            f"tokens -> {decision.prior_block_size}"
        )
    article = decision.article_heuristic
    if article is not None:
        lines.append(
            f"article's rule: sqrt({article.length_tokens:.0f} x {article.bytes_per_token} B) = "
            f"{article.value_sqrt_token_bytes:.0f} sqrt(token*byte) -> {article.tokens:.3f} "
            f"tokens -> {article.block_size} (clamped to the candidates)"
        )
    if decision.forecasts:
        low, high = decision.gain_interval
        lines.append(
            f"gain of the best other size on {decision.ranked_by}: {decision.gain:+.1%}, "
            f"{low:+.1%} to {high:+.1%} over the window's bootstrap resamples (interval: "
            "the 10th-90th percentile; a switch needs its low end above min_gain)"
        )
    lines.append(f"against the current B={decision.current_block_size}: {decision.reason}")
    return "\n".join(lines)


def to_json(decision: Decision, snapshot: WindowSnapshot, **extra: object) -> str:
    """The decision's JSON (`Decision.to_dict`) with the window summary and `extra`."""
    from blocktune.tuner.config.jsonable import to_jsonable

    payload = {**decision.to_dict(), "window": to_jsonable(snapshot.summary()), **extra}
    return json.dumps(payload, indent=2, allow_nan=False)


def _load_frame(args: argparse.Namespace) -> tuple[pd.DataFrame, str]:
    from blocktune.tuner.core.recommendation import RecommendError

    if args.trace == SYNTHETIC_TRACE:
        from blocktune.traces.synth import customer_service_day

        frame = customer_service_day(args.seed)
        label = f"synthetic customer-service day (seed {args.seed})"
    else:
        loaded = load_from_args(args)
        report_skipped(loaded)
        frame, label = loaded.frame, f"{args.trace} (format {loaded.format})"
    if args.phase is not None:
        if "phase" not in frame:
            raise RecommendError(f"{label} has no 'phase' column to select {args.phase!r} from")
        phases = sorted(frame["phase"].unique())
        if args.phase not in phases:
            raise RecommendError(f"{label} has no phase {args.phase!r}; it has {phases}")
        frame = frame[frame["phase"] == args.phase]
        label += f", phase {args.phase}"
    return frame, label


def run_recommend(args: argparse.Namespace) -> int:
    """Price every candidate block size for a trace under a policy and print the choice."""
    from blocktune.traces.schema import TraceError
    from blocktune.tuner.config.calibration import CalibrationError, device_mismatch
    from blocktune.tuner.config.config_files import ConfigError
    from blocktune.tuner.core.recommendation import RecommendError, recommend

    try:
        policy, calibration = load_policy_and_calibration(args.policy)
        frame, label = _load_frame(args)
        decision, snapshot, left_out = recommend(
            frame, policy, calibration, current_block_size=args.current, last=args.last
        )
    except (ConfigError, TraceError, CalibrationError, RecommendError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    warnings = list(filter(None, [device_mismatch(policy, calibration)]))
    if args.json:
        print(
            to_json(
                decision,
                snapshot,
                trace=label,
                policy={"file": str(args.policy), "deployment": policy.deployment},
                calibration=calibration.describe(),
                left_out_longer_than_the_pool=left_out,
                warnings=warnings,
            )
        )
        return 0
    budget_gib = int(policy.kv_budget) / 2**30
    print(f"trace: {label}")
    print(
        f"policy: {policy.deployment} ({args.policy}): {policy.model.num_layers} layers, "
        f"{policy.model.num_kv_heads} KV heads x {policy.model.head_dim}, "
        f"{policy.model.dtype}, KV budget {budget_gib:.1f} GiB"
    )
    print(f"calibration: {calibration.describe()}")
    for warning in warnings:
        print(f"warning: {warning}")
    if left_out:
        print(f"left out {left_out} requests longer than the KV pool: they can never run")
    print(format_decision_table(decision, snapshot))
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    """Add `recommend` to the command line."""
    parser = commands.add_parser(
        "recommend",
        help="price every candidate block size for a trace and recommend one",
        description=run_recommend.__doc__,
    )
    add_load_arguments(
        parser,
        trace_help=f"trace file, or '{SYNTHETIC_TRACE}' for the synthetic customer-service day",
        seed_help="seed of the synthetic day or of --rate arrivals (default: 0)",
    )
    add_policy_argument(parser, "KV budget, candidates, SLO and min_gain")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--current",
        type=positive_int,
        default=DEFAULT_BLOCK_SIZE,
        metavar="B",
        help="the block size in force now, for the switch decision (default: %(default)s)",
    )
    parser.add_argument(
        "--last",
        type=positive_int,
        default=None,
        metavar="N",
        help="use only the last N requests, like the online window (default: all)",
    )
    parser.add_argument(
        "--phase", default=None, help="keep one phase of the synthetic day (day, promo, ...)"
    )
    parser.set_defaults(handler=run_recommend)

"""How fast the replay simulator is on a large trace.

Generates the synthetic customer-service day scaled to about `--requests`
requests (default one million) and replays it under every policy of
`--policy` (static sizes, adaptive, oracle) exactly as `blocktune replay`
does. Prints the time to build the trace, the wall-clock time of each
policy's simulation with microseconds per request and simulated engine steps
per second, and the policy table.

    python bench/replay.py [--requests 1000000] [--policy policies/default.yaml] [--seed 0]
"""

from __future__ import annotations

import time

from result_file import ResultFile, bench_parser

from blocktune.traces.synth import CUSTOMER_SERVICE_PHASES, customer_service_day
from blocktune.tuner.config.calibration import calibration_for
from blocktune.tuner.config.defaults import DEFAULT_POLICY
from blocktune.tuner.config.policy import load_policy, policy_path
from blocktune.tuner.replay.report import format_replay_table
from blocktune.tuner.replay.runner import replay


def requests_per_day() -> float:
    """Expected requests of the default day at rate scale 1 (each phase's mean rate x span)."""
    return sum(p.rate_per_s * (p.end_h - p.start_h) * 3600 for p in CUSTOMER_SERVICE_PHASES)


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=1_000_000, help="about this many")
    parser.add_argument("--policy", default=DEFAULT_POLICY, help="policy YAML file or name")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic day")
    args = parser.parse_args()
    out = ResultFile(__file__, __doc__, args.results, preformatted=True)
    policy = load_policy(args.policy)
    calibration = calibration_for(policy, policy_path(args.policy).parent)
    scale = args.requests / requests_per_day()
    start = time.perf_counter()
    day = customer_service_day(args.seed, rate_scale=scale)
    built = time.perf_counter() - start
    out.print(
        f"trace: synthetic customer-service day, seed {args.seed}, rate scale {scale:.3f}: "
        f"{len(day)} requests, {int(day.output_tokens.sum())} output tokens "
        f"(built in {built:.1f} s)"
    )
    out.print(f"policy: {policy.deployment} ({args.policy}); {calibration.describe()}")
    start = time.perf_counter()
    report = replay(day, policy, calibration, label="benchmark day", progress=True)
    total = time.perf_counter() - start
    out.print(f"{'policy':<11}{'replay s':>10}{'us/request':>12}{'steps':>10}{'steps/s':>11}")
    for result in report.results:
        steps = report.runs[result.policy].steps
        out.print(
            f"{result.policy:<11}{result.replay_s:>10.1f}"
            f"{result.replay_s / len(day) * 1e6:>12.1f}{steps:>10}{steps / result.replay_s:>11.0f}"
        )
    simulated = sum(r.replay_s for r in report.results)
    out.print(f"all policies: {total:.1f} s ({total - simulated:.1f} s outside the simulations)")
    out.print(format_replay_table(report))
    out.write()


if __name__ == "__main__":
    main()

"""Whether the decision agrees with hindsight, on traffic nobody tuned for (a benchmark).

For every case (a trace x a KV budget x a rate scale) it replays the trace
under `--policy` (every static size, the adaptive tuner and the oracle, as
`blocktune replay` does) and asks for one recommendation on the whole trace
(as `blocktune recommend` does, from the size in force 16). One row per case:

- fills: whether static-16's peak KV reaches 95% of the budget;
- spread: the best static size over the worst on the goal (SLO goodput), or
  on tokens/s where the replay compares tokens/s (marked ``tok/s``: a static
  size serves no request within the SLO, or none serves a tenth of them,
  `objective.OVERLOAD_SHARE`);
- best: the hindsight-best static size, and its gain over static-16;
- adaptive over the best static size, over static-16 and over the oracle;
- swaps of the adaptive tuner; the recommended size, `material` and the
  low end of its `gain_interval`;
- agree: `material` is true exactly when the best static size beats static-16
  by `min_gain` in the replay;
- replay: the seconds the replay took.

Traces: the Azure LLM inference conversation trace (one hour) and the
ShareGPT lengths (the first `--sharegpt-requests`, Poisson arrivals at 1
request/s) from `--traces`, the embedded customer-service day, and a
synthetic mix (the day's phases compressed into one hour at a fifth of the
rate, seed 1). A rate scale k divides every arrival time by k. `GRID` holds
each trace's budgets (one that fills the pool, one that does not) and rate
scales. The acceptance figures follow the table.

    python bench/decision_quality.py [--traces ../shared/traces]
        [--budgets 4GiB ...] [--rates 0.5 1 ...] [--only azure-conv sharegpt ...]
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from pydantic import ByteSize, TypeAdapter
from result_file import ResultFile, bench_parser

from blocktune.traces.loaders import load_trace
from blocktune.traces.synth import customer_service_day
from blocktune.tuner.config.calibration import calibration_for
from blocktune.tuner.config.policy import load_policy, policy_path
from blocktune.tuner.core.recommendation import recommend
from blocktune.tuner.replay.report import comparisons
from blocktune.tuner.replay.runner import ADAPTIVE, ORACLE, TOKENS_PER_S, replay, static_name

ROOT = Path(__file__).resolve().parents[1]
SHARED_TRACES = ROOT.parent / "shared" / "traces"
GRID = {
    "azure-conv": (("4GiB", "32GiB"), (0.25, 0.5, 1.0)),
    "sharegpt": (("2GiB", "32GiB"), (0.5, 1.0, 2.0)),
    "embedded-day": (("128MiB", "4GiB"), (1.0, 4.0)),
    "synthetic-mix": (("128MiB", "4GiB"), (0.5, 1.0, 2.0)),
}
"""Per trace: KV budgets (the first fills the pool, the second does not) and rate scales."""

AGREEMENT_TOLERANCE = 0.01
"""The recommended size counts as the hindsight-best static size within this share of it."""


def traces(folder: Path, sharegpt_requests: int) -> dict[str, pd.DataFrame]:
    """The cases' traces by name (those of `folder` only where present)."""
    out = {}
    azure = folder / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
    if azure.exists():
        out["azure-conv"] = load_trace(azure, "azure").frame
    sharegpt = folder / "sharegpt_lengths" / "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
    if sharegpt.exists():
        frame = load_trace(sharegpt, "lengths", rate=1.0, seed=0).frame
        out["sharegpt"] = frame.head(sharegpt_requests).reset_index(drop=True)
    out["embedded-day"] = customer_service_day(0)
    out["synthetic-mix"] = customer_service_day(1, duration_s=3600.0, rate_scale=0.2)
    return out


@dataclass(frozen=True)
class Case:
    """One replay and one recommendation, summarised."""

    trace: str
    budget: str
    rate: float
    fills: bool
    on: str
    spread: float
    best: int
    best_gain: float
    vs_best: float
    vs_16: float
    vs_oracle: float
    oracle_vs_best: float
    swaps: int
    recommended: int
    recommended_vs_best: float
    material: bool
    gain_low: float
    min_gain: float
    seconds: float

    @property
    def matters(self) -> bool:
        """In hindsight, the best static size beats static-16 by min_gain."""
        return self.best_gain >= self.min_gain

    @property
    def agrees(self) -> bool:
        return self.material == self.matters


def run_case(name: str, frame: pd.DataFrame, base, budget: str, rate: float) -> Case:
    """Replay and recommend one case."""
    policy = base.model_copy(update={"kv_budget": TypeAdapter(ByteSize).validate_python(budget)})
    calibration = calibration_for(policy, policy_path("default").parent)
    scaled = frame.assign(arrival_s=frame.arrival_s / rate)
    start = time.perf_counter()
    report = replay(scaled, policy, calibration, label=name)
    seconds = time.perf_counter() - start
    decision, _, _ = recommend(scaled, policy, calibration, current_block_size=16)
    ratios = comparisons(report)
    on = report.compared_on

    def value(policy_name: str) -> float:
        result = report.result(policy_name)
        return result.tokens_per_s if on == TOKENS_PER_S else result.goal_value

    statics = {size: value(static_name(size)) for size in policy.candidates}
    best = max(statics, key=lambda size: (statics[size], -size))
    static16 = report.result(static_name(16))
    return Case(
        trace=name,
        budget=budget,
        rate=rate,
        fills=static16.peak_kv_bytes >= 0.95 * int(policy.kv_budget),
        on=on,
        spread=ratios["static_spread_goal"] - 1,
        best=best,
        best_gain=statics[best] / statics[16] - 1,
        vs_best=ratios["adaptive_vs_best_static_goal"],
        vs_16=ratios["adaptive_vs_static16_goal"],
        vs_oracle=ratios["adaptive_vs_oracle_goal"],
        oracle_vs_best=value(ORACLE) / statics[best],
        swaps=report.result(ADAPTIVE).swaps,
        recommended=decision.recommended_block_size,
        recommended_vs_best=statics[decision.recommended_block_size] / statics[best],
        material=decision.material,
        gain_low=decision.gain_interval[0],
        min_gain=policy.min_gain,
        seconds=seconds,
    )


def table(cases: list[Case]) -> list[str]:
    """The cases as a markdown table."""
    head = (
        "| trace | KV budget | rate | fills | spread | best (vs 16) | adaptive/best | "
        "adaptive/16 | adaptive/oracle | swaps | recommended (vs best) | material "
        "(gain low) | replay says | agree | replay s |"
    )
    lines = [head, "|" + " --- |" * 15]
    for c in cases:
        spread = f"{c.spread:.2%}" + (" tok/s" if c.on == TOKENS_PER_S else "")
        lines.append(
            f"| {c.trace} | {c.budget} | {c.rate:g}x | {'yes' if c.fills else 'no'} | {spread} "
            f"| {c.best} ({c.best_gain:+.2%}) | {c.vs_best:.4f} | {c.vs_16:.4f} | "
            f"{c.vs_oracle:.4f} | {c.swaps} | {c.recommended} ({c.recommended_vs_best:.4f}) | "
            f"{str(c.material).lower()} ({c.gain_low:+.2%}) | "
            f"{'matters' if c.matters else 'within min_gain'} | {'yes' if c.agrees else 'NO'} | "
            f"{c.seconds:.1f} |"
        )
    return lines


def totals(cases: list[Case]) -> list[str]:
    """The acceptance figures over `cases`."""
    n = len(cases)
    agree = sum(c.agrees for c in cases)
    close = sum(c.vs_best >= 0.98 for c in cases)
    flat = [c for c in cases if c.spread < 0.01]
    flat_ok = sum(c.swaps <= 1 for c in flat)
    matters = [c for c in cases if c.matters]
    picked = sum(c.recommended_vs_best >= 1 - AGREEMENT_TOLERANCE for c in matters)
    oracle = sum(c.oracle_vs_best >= 1 for c in cases)
    worst = min(cases, key=lambda c: c.vs_best)
    return [
        f"- `material` agrees with the replay: {agree} of {n} ({agree / n:.0%}; wanted >= 90%)",
        f"- adaptive >= 0.98x the best static size: {close} of {n} ({close / n:.0%}; wanted >= "
        f"95%); worst {worst.vs_best:.4f} ({worst.trace}, {worst.budget}, {worst.rate:g}x)",
        f"- at most 1 swap where the static spread is under 1%: {flat_ok} of {len(flat)} cases "
        f"(most swaps in one: {max((c.swaps for c in flat), default=0)})",
        f"- recommended = hindsight-best static size within {AGREEMENT_TOLERANCE:.0%} where it "
        f"matters: {picked} of {len(matters)}",
        f"- oracle >= the best static size: {oracle} of {n}",
        f"- total swaps: {sum(c.swaps for c in cases)}; replays took "
        f"{sum(c.seconds for c in cases):.0f} s",
    ]


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--traces", type=Path, default=SHARED_TRACES, help="shared traces folder")
    parser.add_argument("--policy", default="default", help="policy file or name")
    parser.add_argument("--budgets", nargs="+", default=None, help="KV budgets (None: GRID's)")
    parser.add_argument(
        "--rates", type=float, nargs="+", default=None, help="rate scales (None: GRID's)"
    )
    parser.add_argument(
        "--sharegpt-requests", type=int, default=3000, help="first requests of ShareGPT"
    )
    parser.add_argument("--only", nargs="+", default=None, help="run only these traces (None: all)")
    args = parser.parse_args()
    out = ResultFile(__file__, __doc__, args.results)
    base = load_policy(args.policy)
    start = time.perf_counter()
    cases = []
    for name, frame in traces(args.traces, args.sharegpt_requests).items():
        if args.only is not None and name not in args.only:
            continue
        budgets, rates = GRID[name]
        for budget in args.budgets or budgets:
            for rate in args.rates or rates:
                case = run_case(name, frame, base, budget, rate)
                print(table([case])[-1], flush=True)
                cases.append(case)
    elapsed = time.perf_counter() - start
    lines = [
        f"Policy `{args.policy}` ({base.deployment}, candidates {list(base.candidates)}, "
        f"interval {base.interval.total_seconds():g} s, min_dwell "
        f"{base.min_dwell.total_seconds():g} s, min_gain {base.min_gain:.0%}); "
        f"{elapsed:.0f} s in all.",
        "",
        *table(cases),
        "",
        *totals(cases),
    ]
    for line in lines:
        out.print(line)
    out.write()


if __name__ == "__main__":
    main()

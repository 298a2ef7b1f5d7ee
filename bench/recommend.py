"""Latency of one block-size decision on a full window.

Fills a 1000-request window from the embedded customer-service day (one phase,
with its arrival times) and times `Selector.decide` several times: the
forecast of every candidate through the serving simulator, capacity search
included. Prints p50/p99 per policy budget. The sidecar serves
`GET /v1/recommendation` from the last decision, so this is the time of the
scheduled decision run, not of a request.

    python bench/recommend.py [--runs 20] [--phase day|promo] [--budgets 3.5GiB 96MiB]
"""

from __future__ import annotations

import time

import numpy as np
from pydantic import ByteSize, TypeAdapter
from result_file import ResultFile, bench_parser

from blocktune.traces.synth import customer_service_day
from blocktune.tuner.config.calibration import calibration_for
from blocktune.tuner.config.policy import load_policy
from blocktune.tuner.core.selector import Selector
from blocktune.tuner.sim.window import LengthWindow


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--runs", type=int, default=20, help="decisions timed")
    parser.add_argument("--phase", default="day", help="phase of the embedded day")
    parser.add_argument("--policy", default="customer_service_llama8b", help="policy file or name")
    parser.add_argument("--budgets", nargs="+", default=["3.5GiB", "96MiB"], help="KV budgets")
    args = parser.parse_args()
    out = ResultFile(__file__, __doc__, args.results, preformatted=True)
    base = load_policy(args.policy)
    day = customer_service_day(0)
    rows = day[day.phase == args.phase].tail(1000)
    window = LengthWindow(1000)
    window.observe_many(
        rows.prompt_tokens.to_numpy(),
        rows.output_tokens.to_numpy(),
        timestamps=rows.arrival_s.to_numpy(),
    )
    snapshot = window.snapshot()
    out.print(f"window: {snapshot.count} requests of the {args.phase} phase; {args.runs} decisions")
    out.print(f"{'KV budget':>10}  {'p50 ms':>8}  {'p99 ms':>8}  material  recommended")
    for budget in args.budgets:
        policy = base.model_copy(
            update={"kv_budget": TypeAdapter(ByteSize).validate_python(budget)}
        )
        selector = Selector(policy, calibration_for(policy, "."))
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            decision = selector.decide(snapshot, 16, now=0.0)
            times.append(time.perf_counter() - start)
        p50, p99 = np.percentile(np.array(times) * 1e3, [50, 99])
        out.print(
            f"{budget:>10}  {p50:>8.1f}  {p99:>8.1f}  {str(decision.material):>8}  "
            f"B={decision.recommended_block_size}"
        )
    out.write()


if __name__ == "__main__":
    main()

"""How a sweep's wall-clock time falls with Dask workers.

Sweeps the embedded customer-service day at `--rate-scale` (default 1: about
163,000 requests) under `--policy` at each KV budget of `--budgets` (every
static size, adaptive and oracle), once on a LocalCluster of each worker
count in `--workers`, as `blocktune sweep` does. Prints the wall-clock time of
each sweep (cluster start and stop included), the speed-up over the first,
the seconds the plays took together (on a machine others load, plays slow
down as they share the cores) with the load average before, and whether the
result tables are equal.

    python bench/sweep.py [--rate-scale 1] [--budgets 2GiB 3.5GiB 8GiB] [--workers 1 2]
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import yaml
from result_file import ResultFile, bench_parser

from blocktune.tuner.sweep.executor import dask_client
from blocktune.tuner.sweep.runner import run_sweep
from blocktune.tuner.sweep.spec import load_sweep

WALL_CLOCK_COLUMNS = ("replay_s",)
"""Result columns that time the replay itself, so differ from run to run."""


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--rate-scale", type=float, default=1.0, help="embedded day's rate")
    parser.add_argument("--policy", default="customer_service_llama8b", help="file or name")
    parser.add_argument(
        "--budgets", nargs="+", default=["2GiB", "3.5GiB", "8GiB"], help="KV budgets"
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts")
    args = parser.parse_args()
    out = ResultFile(__file__, __doc__, args.results, preformatted=True)
    spec = {
        "traces": [{"path": "synthetic", "rate_scale": args.rate_scale}],
        "policies": [args.policy],
        "grid": {"kv_budget": args.budgets},
    }
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "sweep.yaml"
        path.write_text(yaml.safe_dump(spec), encoding="utf-8")
        points = load_sweep(path)
    out.print(f"sweep: {points[0].trace}, policy {args.policy}, budgets {' '.join(args.budgets)}")
    tables, seconds = [], []
    for workers in args.workers:
        load = os.getloadavg()[0]
        start = time.perf_counter()
        with dask_client(workers=workers) as client:
            result = run_sweep(client, points)
        seconds.append(time.perf_counter() - start)
        assert not result.failures, result.failures
        plays = float(result.rows.replay_s.sum())
        tables.append(result.rows.drop(columns=list(WALL_CLOCK_COLUMNS)))
        out.print(
            f"{workers} workers: {seconds[-1]:.1f} s wall clock, speed-up "
            f"{seconds[0] / seconds[-1]:.2f}x over {args.workers[0]} workers; the plays took "
            f"{plays:.1f} s together; load average {load:.1f} before",
        )
    same = all(table.equals(tables[0]) for table in tables[1:])
    out.print(f"result tables equal across worker counts: {same}")
    out.write()


if __name__ == "__main__":
    main()

"""End to end: a worker and a sidecar as two real processes on loopback, traffic that shifts."""

import pytest

from blocktune.tuner.config.policy import Policy
from blocktune.tuner.demo.closed_loop import demo_policy, demo_workload, run_closed_loop

pytestmark = pytest.mark.slow


def test_the_sidecar_swaps_the_worker_both_ways_and_no_token_changes():
    lines: list[str] = []
    report = run_closed_loop(
        duration_s=60, interval_s=3, rate_per_s=4, restart_sidecar_at_s=9, out=lines.append
    )
    done = [
        (s["old_block_size"], s["new_block_size"]) for s in report.swaps if s["status"] == "done"
    ]
    assert any(new < old for old, new in done), lines
    assert any(new > old for old, new in done), lines
    assert report.failed == 0 and len(report.completions) == report.requests
    assert report.identical == report.requests, "a swap changed a completion"
    assert report.ok
    assert report.idle_blocks_used == 0
    # The restarted sidecar restored its window from the state file.
    assert report.restart is not None and report.restart["before"] > 0
    assert report.restart["after"] >= report.restart["before"]
    assert any("identical to the run without swaps" in line for line in lines)


def test_demo_workload_shifts_lengths_and_the_policy_is_valid():
    day = demo_workload(seed=1, duration_s=30, rate_per_s=4)
    thirds = [day[(day.arrival_s >= a) & (day.arrival_s < a + 10)] for a in (0, 10, 20)]
    medians = [float((t.prompt_tokens + t.output_tokens).median()) for t in thirds]
    assert medians[1] < medians[0] / 2 and medians[1] < medians[2] / 2
    assert len(thirds[1]) > 2 * len(thirds[0])
    assert all(len(ids) == n for ids, n in zip(day.prompt_ids, day.prompt_tokens, strict=True))
    policy = Policy.model_validate(demo_policy("http://127.0.0.1:8000", 3))
    assert policy.mode == "enforce" and policy.actuator.kind == "http"

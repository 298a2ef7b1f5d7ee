"""The length window: ring buffer order, bounded memory, statistics, threads, bad input."""

import threading
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blocktune.tuner.sim.window import InvalidWindowInput, LengthWindow, prefix_key


def test_snapshot_keeps_order_and_summarises_lengths():
    rng = np.random.default_rng(1)
    prompts = rng.integers(1, 3000, 400)
    outputs = rng.integers(0, 500, 400)
    window = LengthWindow(capacity=1000)
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        window.observe(int(p), int(o), timestamp=float(i))
    snap = window.snapshot()
    assert snap.count == 400 and snap.observed_total == 400
    np.testing.assert_array_equal(snap.prompt_tokens, prompts)
    np.testing.assert_array_equal(snap.output_tokens, outputs)
    np.testing.assert_array_equal(snap.timestamps, np.arange(400.0))
    totals = prompts + outputs
    assert snap.total.mean == pytest.approx(totals.mean())
    assert snap.total.median == pytest.approx(np.median(totals))
    assert snap.total.p90 == pytest.approx(np.percentile(totals, 90))
    assert snap.total.p99 == pytest.approx(np.percentile(totals, 99))
    assert snap.prompt.median == pytest.approx(np.median(prompts))
    # Log-spaced bins: a constant ratio between edges, every request counted once.
    ratios = snap.histogram_edges[1:] / snap.histogram_edges[:-1]
    np.testing.assert_allclose(ratios, ratios[0])
    assert snap.histogram_counts.sum() == 400
    in_first_bins = ((totals >= 1) & (totals < snap.histogram_edges[4])).sum()
    assert snap.histogram_counts[:4].sum() == in_first_bins


def test_memory_is_bounded_and_the_oldest_requests_are_dropped():
    window = LengthWindow(capacity=5)
    for i in range(12):
        window.observe(i + 1, i, timestamp=i)
    snap = window.snapshot()
    assert len(window) == 5 and snap.observed_total == 12
    np.testing.assert_array_equal(snap.prompt_tokens, [8, 9, 10, 11, 12])
    window.observe_many(np.arange(100, 120), np.zeros(20, dtype=int), timestamps=np.arange(20.0))
    snap = window.snapshot()
    np.testing.assert_array_equal(snap.prompt_tokens, np.arange(115, 120))
    assert snap.observed_total == 32


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 9),
    batches=st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=12), max_size=8),
)
def test_any_mix_of_observe_and_observe_many_matches_a_reference(capacity, batches):
    window = LengthWindow(capacity=capacity)
    reference: deque[int] = deque(maxlen=capacity)
    for number, batch in enumerate(batches):
        if number % 2:
            window.observe_many(batch, [1] * len(batch), timestamps=[0.0] * len(batch))
        else:
            for value in batch:
                window.observe(value, 1, timestamp=0.0)
        reference.extend(batch)
    np.testing.assert_array_equal(window.snapshot().prompt_tokens, list(reference))


def test_concurrent_observers_never_tear_a_row():
    window = LengthWindow(capacity=256)

    def worker(offset: int) -> None:
        for i in range(2000):
            prompt = offset + i + 1
            window.observe(prompt, 2 * prompt, timestamp=float(prompt), prefix_group=prompt)

    threads = [threading.Thread(target=worker, args=(k * 10_000,)) for k in range(4)]
    for thread in threads:
        thread.start()
    snapshots = [window.snapshot() for _ in range(50)]
    for thread in threads:
        thread.join()
    final = window.snapshot()
    assert final.observed_total == 8000 and final.count == 256
    for snap in [*snapshots, final]:
        np.testing.assert_array_equal(snap.output_tokens, 2 * snap.prompt_tokens)
        np.testing.assert_array_equal(snap.timestamps, snap.prompt_tokens)
        np.testing.assert_array_equal(snap.prefix_keys, snap.prompt_tokens)


def test_prefix_groups_count_the_requests_that_can_reuse_a_prefix():
    window = LengthWindow(capacity=10)
    for group in ["doc-1", "doc-2", None, "doc-1", "doc-1", 7, 7, None]:
        window.observe(100, 10, timestamp=0.0, prefix_group=group)
    snap = window.snapshot()
    # doc-1 three times, doc-2 once, 7 twice: 2 + 0 + 1 requests reuse an earlier prefix.
    assert snap.shared_prefixes == 3
    assert prefix_key("doc-1") == prefix_key("doc-1") != prefix_key("doc-2")
    assert prefix_key(7) == 7


def test_output_rate_comes_from_the_timestamps():
    window = LengthWindow(capacity=10)
    window.observe_many([10, 10, 10], [30, 30, 40], timestamps=[0.0, 5.0, 10.0])
    assert window.snapshot().generated_tokens_per_s() == pytest.approx(100 / 10)
    single = LengthWindow(capacity=10)
    single.observe(10, 5, timestamp=3.0)
    assert single.snapshot().generated_tokens_per_s() is None


def test_one_stray_timestamp_does_not_stretch_the_output_rate():
    window = LengthWindow(capacity=200)
    window.observe_many([10] * 100, [50] * 100, timestamps=[1000.0 + i for i in range(100)])
    steady = window.snapshot().generated_tokens_per_s()
    window.observe(10, 50, timestamp=0.0)  # a client whose clock says 1970
    assert window.snapshot().generated_tokens_per_s() == pytest.approx(steady, rel=0.05)
    assert steady == pytest.approx(50, rel=0.05)


@pytest.mark.parametrize(
    ("prompt", "output", "needle"),
    [
        (0, 5, "prompt_tokens"),
        (5, -1, "output_tokens"),
        (True, 5, "prompt_tokens"),
        (2.5, 1, "got 2.5"),
    ],
)
def test_bad_observations_are_rejected_with_the_field_named(prompt, output, needle):
    window = LengthWindow(capacity=4)
    with pytest.raises(InvalidWindowInput, match=needle):
        window.observe(prompt, output)
    assert len(window) == 0


def test_bad_batches_and_capacities_are_rejected():
    window = LengthWindow(capacity=4)
    with pytest.raises(InvalidWindowInput, match="shapes"):
        window.observe_many([1, 2, 3], [1, 2])
    with pytest.raises(InvalidWindowInput, match="prompt_tokens"):
        window.observe_many([1, 0], [1, 2])
    with pytest.raises(InvalidWindowInput, match="timestamps"):
        window.observe_many([1, 2], [1, 2], timestamps=[0.0])
    with pytest.raises(InvalidWindowInput, match="capacity"):
        LengthWindow(capacity=0)
    assert len(window) == 0

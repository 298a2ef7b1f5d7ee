"""The engine loop gathers a burst that reaches an idle engine into one first step."""

from __future__ import annotations

import threading
import time

import pytest

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.defaults import GATHER_LIMIT_S
from blocktune.runtime.engine import Engine
from blocktune.runtime.engine_loop import EngineLoop
from blocktune.runtime.loading import load_weights
from blocktune.runtime.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def model():
    return load_weights("tiny-random", seed=0)


class FirstTokens:
    """Records, per job, the engine step that gave its first output and when."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop = loop
        self.steps: dict[int, int] = {}
        self.times: dict[int, float] = {}
        self.done = threading.Semaphore(0)

    def submit(self, index: int, prompt: list[int]) -> None:
        def emit(output) -> None:
            assert not isinstance(output, Exception), output
            if index not in self.steps:
                self.steps[index] = self.loop.engine.steps
                self.times[index] = time.monotonic()
            if output.finished:
                self.done.release()

        self.loop.submit(prompt, PARAMS, emit)

    def wait(self, count: int) -> None:
        for _ in range(count):
            assert self.done.acquire(timeout=30)


def _loop(model, gather_s: float) -> EngineLoop:
    loop = EngineLoop(Engine(model, EngineConfig(block_size=8, num_blocks=64)), gather_s=gather_s)
    loop.start()
    return loop


def _burst(loop: EngineLoop) -> FirstTokens:
    """Four requests 10 ms apart; the engine step of each one's first output."""
    first = FirstTokens(loop)
    try:
        for i in range(4):
            first.submit(i, [1 + i, 2, 3, 4, 5])
            time.sleep(0.01)
        first.wait(4)
    finally:
        loop.stop()
    return first


def test_a_burst_reaching_an_idle_engine_is_prefilled_in_one_step(model):
    first = _burst(_loop(model, gather_s=0.045))  # waits 45 ms for each next request
    assert len(set(first.steps.values())) == 1, first.steps


def test_without_gathering_the_first_request_of_a_burst_is_stepped_alone(model):
    first = _burst(_loop(model, gather_s=0.0))
    assert first.steps[0] < first.steps[3], first.steps


def test_a_lone_request_waits_the_gather_gap_before_its_step(model):
    loop = _loop(model, gather_s=0.03)
    try:
        first = FirstTokens(loop)
        start = time.monotonic()
        first.submit(0, [1, 2, 3])
        first.wait(1)
    finally:
        loop.stop()
    assert first.times[0] - start >= 0.03


def test_gathering_stops_at_its_limit_while_requests_keep_coming(model):
    loop = _loop(model, gather_s=0.045)
    try:
        first = FirstTokens(loop)
        count, gap = 40, 0.005  # 200 ms of requests 5 ms apart: four times the limit
        for i in range(count):
            first.submit(i, [1 + i % 7, 2, 3])
            time.sleep(gap)
        submitted = time.monotonic()
        first.wait(count)
    finally:
        loop.stop()
    assert count * gap / 2 > GATHER_LIMIT_S
    assert first.times[0] < submitted  # the first step started before the last arrival
    assert len(set(first.steps.values())) > 1


def test_a_negative_gather_is_refused(model):
    with pytest.raises(ValueError, match="gather_s"):
        EngineLoop(Engine(model, EngineConfig(block_size=8, num_blocks=64)), gather_s=-0.001)

"""`blocktune validate --engine vllm`: the simulator's predictions against a real vLLM server.

For every block size B a vLLM server is started from the command template
(`VllmServer`, one start per size), warmed up with one request, and sent the
workload's requests at their arrival times (`runs` times, each run with fresh
random prompt token ids, so no run reuses another's prefix cache), every
request streaming exactly its trace's output tokens (EOS ignored). A request's
first-token and finish times are its streamed tokens' arrival times, on the
trace's clock from the run's start; a thread scrapes `/metrics` meanwhile for
the peak KV blocks in use (`vllm:kv_cache_usage_perc` times the pool's
`num_gpu_blocks`) and the preemptions (`vllm:num_preemptions_total`).

The simulator replays the same workload with the policy's KV budget (its pool
at B is printed beside vLLM's own, which `VLLM_CPU_KVCACHE_SPACE` or
`--kv-cache-memory-bytes` sets), vLLM's batch limits and the calibration,
whose engine section must be for the served model (`calibrate --engine vllm`).
The result is the `Validation` of `tuner.fidelity.validation`: the same table,
errors, noise and rankings as for blocktune's engine.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from blocktune.tuner.config.calibration import Calibration, CalibrationError
from blocktune.tuner.config.policy import Policy
from blocktune.tuner.fidelity.served_metrics import mean_of, predict, prediction_method
from blocktune.tuner.fidelity.validation import (
    POOL_LIMIT,
    BlockSizeCheck,
    Validation,
    left_out,
    step_sensitivity,
)
from blocktune.tuner.measure.vllm_measure import VllmClient
from blocktune.tuner.measure.vllm_server import VllmServer
from blocktune.tuner.sim.served import ServedMetrics
from blocktune.tuner.sim.step_cost import StepCostModel
from blocktune.tuner.sim.workload import Workload

__all__ = ["VllmPool", "validate_vllm"]

SCRAPE_S = 0.25
"""How often a run scrapes the server's /metrics for the KV blocks in use."""
CACHE_INFO = "vllm:cache_config_info"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions_total"


class VllmPool:
    """A vLLM server's pool as its /metrics tells it: blocks, blocks in use, preemptions;
    `watch` scrapes in a thread and keeps the peak. Scrapes share one HTTP client (a new
    one costs tens of milliseconds of CPU, taken from the server being measured); `close`
    ends it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._client = httpx.Client(timeout=5)
        self.num_blocks: int | None = None
        self.peak_blocks = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def scrape(self) -> tuple[float, float]:
        """(blocks in use, preemptions so far); the pool's size is read on the way."""
        text = self._client.get(f"{self.url}/metrics").text
        usage = preemptions = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == CACHE_INFO and "num_gpu_blocks" in sample.labels:
                    self.num_blocks = int(float(sample.labels["num_gpu_blocks"]))
                elif sample.name == KV_USAGE:
                    usage = max(usage, sample.value)
                elif sample.name == PREEMPTIONS:
                    preemptions += sample.value
        return usage * (self.num_blocks or 0), preemptions

    def watch(self) -> None:
        self.peak_blocks = 0.0
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="vllm-pool", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(httpx.HTTPError, ValueError):  # a scrape missed
                self.peak_blocks = max(self.peak_blocks, self.scrape()[0])
            self._stop.wait(SCRAPE_S)

    def stop(self) -> float:
        """Stop watching; the peak blocks in use."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.peak_blocks

    def close(self) -> None:
        """Stop watching and close the HTTP client."""
        self.stop()
        self._client.close()


def replay(
    client: VllmClient, pool: VllmPool, workload: Workload, block_bytes: int
) -> ServedMetrics:
    """Send the workload at its arrival times (from now) and measure how it was served (its
    peak KV in bytes from the blocks in use, `block_bytes` each)."""
    _, preempted_before = pool.scrape()
    offsets = workload.arrival_s - workload.arrival_s[0]
    prompts = [client.prompt(int(n)) for n in workload.prompt_tokens]
    pool.watch()
    start = time.monotonic() + 0.5  # every thread is waiting before the first arrival
    with ThreadPoolExecutor(len(workload)) as threads:
        streams = list(
            threads.map(
                lambda i: client.stream(
                    prompts[i], int(workload.output_tokens[i]), at_s=start + offsets[i]
                ),
                range(len(workload)),
            )
        )
    peak = pool.stop()
    _, preempted_after = pool.scrape()
    origin = float(workload.arrival_s[0])
    return ServedMetrics.of_times(
        workload,
        np.array([origin + s.first_token_s - start for s in streams]),
        np.array([origin + s.finish_s - start for s in streams]),
        np.array([len(s.token_s) for s in streams]),
        peak_kv_bytes=peak * block_bytes,
        peak_kv_blocks=peak,
        preemptions=preempted_after - preempted_before,
    )


def validate_vllm(
    workload: Workload,
    policy: Policy,
    calibration: Calibration,
    block_sizes: tuple[int, ...],
    template: str,
    log_folder: Path,
    *,
    runs: int = 1,
    start_timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
    seed: int = 0,
    progress: Callable[[str], None] = lambda _: None,
) -> Validation:
    """Serve `workload` on vLLM `runs` times and simulate it once per block size (module
    doc). Requests longer than the smallest simulated pool are left out of both sides.
    Raises `CalibrationError` for a calibration without an engine section or block size,
    `VllmStartError` when a server does not come up."""
    if runs < 1:
        raise ValueError(f"need runs >= 1, got {runs}")
    if calibration.engine is None:
        raise CalibrationError(
            "validate --engine vllm needs a calibration with an engine section: write one "
            "with `blocktune calibrate --engine vllm`"
        )
    calibration.require(block_sizes)
    served = Policy.model_validate(
        {
            **dict(policy),
            "engine": "vllm",
            "model": calibration.engine.model,
            "candidates": block_sizes,
        }
    )
    server = StepCostModel(served, calibration)
    limit = min(server.capacity_slots(b) for b in block_sizes)
    kept = workload.without_longer_than(limit)
    kept = Workload.of_lengths(kept.arrival_s, kept.prompt_tokens, kept.output_tokens)
    checks, vllm_blocks = [], {}
    for block_size in served.candidates:
        progress(f"B={block_size}: simulating")
        predicted = predict(kept, server, block_size, seed=seed)
        progress(f"B={block_size}: starting vLLM")
        log_file = log_folder / f"vllm-validate-b{block_size}.log"
        measured, block_bytes = [], block_size * server.kv_bytes_per_slot
        with VllmServer(
            template, block_size, log_file, start_timeout_s=start_timeout_s, env=env
        ) as vllm:
            client = VllmClient(vllm.url, calibration.engine.model.vocab_size, seed=seed)
            pool = VllmPool(vllm.url)
            try:
                client.stream(client.prompt(16), 4)  # warm-up
                for i in range(runs):
                    progress(f"B={block_size}: run {i + 1} of {runs} ({len(kept)} requests)")
                    measured.append(replay(client, pool, kept, block_bytes))
            finally:
                client.close()
                pool.close()
            vllm_blocks[block_size] = pool.num_blocks
        mean = mean_of(tuple(measured))
        sensitivity = step_sensitivity(kept, server, block_size, predicted, mean)
        checks.append(BlockSizeCheck(block_size, predicted, tuple(measured), sensitivity))
    trace = left_out(workload, kept, limit, POOL_LIMIT)
    setup = {
        "kv_budget_bytes": int(served.kv_budget),
        "pool_blocks": {b: server.num_blocks(b) for b in served.candidates},
        "vllm_pool_blocks": vllm_blocks,
        "calibration": calibration.describe(),
        "block_size_effect": calibration.engine.block_size_verdict(),
        "runs": runs,
        "prediction": prediction_method(server, seed),
        "engine": "vllm",
    }
    return Validation(trace=trace, setup=setup, checks=checks)

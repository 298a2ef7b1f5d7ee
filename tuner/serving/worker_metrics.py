"""The worker's Prometheus metrics: vLLM's V1 metrics under vLLM's names, and blocktune's own.

The `vllm:` families carry vLLM's exact names, types, labels (`model_name`,
`engine`), units and histogram buckets, so a dashboard, alert or tool made
for vLLM (the sidecar's vLLM source included) reads this worker unchanged.
Request metrics (token counters, time to first token, inter-token latency,
time per output token, end-to-end latency, lengths, `max_tokens`, successes
by reason) are updated as tokens arrive; the engine's gauges and counters
(running and waiting requests, KV usage, preemptions, `cache_config_info`
with the block size in force) are read at scrape time. What vLLM has no name
for (the block size, KV blocks, padding, swaps and their pause, cancelled and
rejected requests, the sidecar backlog) is `blocktune_worker_*`.

promtool's lint warns that metric names "should not contain ':'"; vLLM's own
exposition gets the same warning, and it is the price of vLLM's names.
docs/serving.md lists every family.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from blocktune.runtime.engine_loop import EngineLoop

__all__ = ["FINISH_REASONS", "WorkerMetrics", "one_two_five_buckets"]

VLLM = "vllm:"
OWN = "blocktune_worker_"
ENGINE = "0"  # vLLM's `engine` label: this worker runs one engine
LABELS = ["model_name", "engine"]
# vLLM's FinishReason values that this worker produces ("error": the request failed in the
# engine); vLLM's "repetition" ends no request here.
FINISH_REASONS = ("stop", "length", "abort", "error")
# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's buckets for token counts)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class WorkerMetrics:
    """A registry of the worker's own: request metrics updated as tokens arrive and
    engine gauges read from the `EngineLoop` at scrape time."""

    def __init__(self, model_name: str, loop: EngineLoop, pusher=None) -> None:
        self.registry = CollectorRegistry()
        self._labels = (model_name, ENGINE)
        lengths = one_two_five_buckets(loop.engine.config.max_model_len)
        self.prompt_tokens = self._counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = self._counter(
            "generation_tokens", "Number of generation tokens processed."
        )
        self._ttft = self._histogram(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self._itl = self._histogram(
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            TOKEN_LATENCY_BUCKETS,
        )
        self._tpot = self._histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self._e2e = self._histogram(
            "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._prompt_lengths = self._histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", lengths
        )
        self._output_lengths = self._histogram(
            "request_generation_tokens", "Number of generation tokens processed.", lengths
        )
        self._max_tokens = self._histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", lengths
        )
        success = Counter(
            VLLM + "request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=self.registry,
        )
        self._success = {reason: success.labels(*self._labels, reason) for reason in FINISH_REASONS}
        self.registry.register(_EngineState(self._labels, loop, pusher))

    def _counter(self, name: str, help_text: str):
        counter = Counter(VLLM + name, help_text, LABELS, registry=self.registry)
        return counter.labels(*self._labels)

    def _histogram(self, name: str, help_text: str, buckets: tuple[float, ...]):
        histogram = Histogram(
            VLLM + name, help_text, LABELS, buckets=buckets, registry=self.registry
        )
        return histogram.labels(*self._labels)

    def token(self, *, since_s: float, first: bool, prompt_tokens: int) -> None:
        """One generated token, `since_s` after the request arrived (first) or after its
        previous token."""
        self.generation_tokens.inc()
        if first:
            self.prompt_tokens.inc(prompt_tokens)
            self._ttft.observe(since_s)
        else:
            self._itl.observe(since_s)

    def finished(
        self,
        *,
        reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        latency_s: float,
        decode_s: float,
        max_tokens: int,
    ) -> None:
        """A request that ended with `reason` (one of `FINISH_REASONS`); `decode_s` is the
        time from its first token to its last."""
        self._success[reason].inc()
        self._e2e.observe(latency_s)
        self._prompt_lengths.observe(prompt_tokens)
        self._output_lengths.observe(generation_tokens)
        self._max_tokens.observe(max_tokens)
        if generation_tokens > 1:
            self._tpot.observe(decode_s / (generation_tokens - 1))

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)


class _EngineState:
    """A prometheus_client collector reading the engine loop's state at scrape time."""

    VLLM_GAUGES = {
        "num_requests_running": ("running", "Number of requests in model execution batches."),
        "num_requests_waiting": ("waiting", "Number of requests waiting to be processed."),
    }
    OWN_GAUGES = {
        "block_size": ("block_size", "KV block size in tokens"),
        "blocks_used": ("blocks_used", "KV blocks in use"),
        "blocks_free": ("blocks_free", "KV blocks free (including evictable cached blocks)"),
        "padding_slots": ("padding_slots", "allocated but unused KV slots"),
        "last_swap_pause_seconds": ("last_swap_pause_s", "pause of the last block-size swap"),
    }
    OWN_COUNTERS = {
        "cancelled": ("cancelled", "requests cancelled because their client went away"),
        "rejected": ("rejected", "requests the engine refused as invalid"),
        "swap_moved_bytes": ("swap_bytes_moved", "bytes copied by block-size swaps"),
    }

    def __init__(self, labels: tuple[str, str], loop: EngineLoop, pusher) -> None:
        self._labels = labels
        self._loop = loop
        self._pusher = pusher

    def _family(self, kind, name: str, help_text: str, value: float):
        family = kind(name, help_text, labels=LABELS)
        family.add_metric(list(self._labels), value)
        return family

    def collect(self):
        state = self._loop.state()
        for name, (key, help_text) in self.VLLM_GAUGES.items():
            yield self._family(GaugeMetricFamily, VLLM + name, help_text, state[key])
        yield self._family(
            GaugeMetricFamily,
            VLLM + "kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            state["blocks_used"] / state["blocks_total"],
        )
        yield self._family(
            CounterMetricFamily,
            VLLM + "num_preemptions",
            "Cumulative number of preemption from the engine.",
            state["preemptions"],
        )
        info = GaugeMetricFamily(
            VLLM + "cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks", "engine"],
        )
        info.add_metric([str(state["block_size"]), str(state["blocks_total"]), ENGINE], 1)
        yield info
        for name, (key, help_text) in self.OWN_GAUGES.items():
            yield self._family(GaugeMetricFamily, OWN + name, help_text, state[key])
        for name, (key, help_text) in self.OWN_COUNTERS.items():
            yield self._family(CounterMetricFamily, OWN + name, help_text, state[key])
        swaps = CounterMetricFamily(
            OWN + "swaps", "block-size swaps by outcome", labels=[*LABELS, "status"]
        )
        for status in ("done", "rejected", "rolled_back"):
            swaps.add_metric([*self._labels, status], state[f"swaps_{status}"])
        yield swaps
        if self._pusher is not None:
            yield self._family(
                CounterMetricFamily,
                OWN + "lengths_dropped",
                "finished lengths dropped because the sidecar backlog was full",
                self._pusher.dropped,
            )
            yield self._family(
                GaugeMetricFamily,
                OWN + "lengths_backlog",
                "finished lengths waiting to be pushed to the sidecar",
                self._pusher.backlog(),
            )

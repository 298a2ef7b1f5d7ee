"""The YAML policy of one deployment: model shape, KV budget, candidates and timing.

A policy file is read with `yaml.safe_load` and validated as `Policy`: unknown
keys are rejected, every problem is reported together with its file, line and
key path, and the result is frozen. Sizes take units ("40GiB", "512MiB",
"40GB"), durations a number and a unit ("30s", "5m", "1h30m").

Each section is a `Section` (extra keys forbidden, frozen). A later section,
such as the sidecar's sources, server, auth or actuator, is one more optional
`Section` field on `Policy` with a default, so existing files stay valid.

The engine's settings (the pool from `kv_budget`, the starting size from
`server.initial_block_size`, the candidates, and `batch`: its limits and prefix
cache) are decided in one place, `tuner.config.engine_settings`, which the
worker and the simulator both read, so the simulator prices the engine the
worker runs. The prefix cache is one field, `batch.enable_prefix_caching`: by
default it is on wherever the engine keeps one (vLLM, as vLLM does by default;
blocktune's engine unless it chunks prefill, which it cannot combine with the
cache), in the worker as in the simulator, which reuses prefix blocks only
where it is on; `false` turns it off for both.

Example::

    deployment: support-bot
    model: {num_layers: 32, num_heads: 32, num_kv_heads: 8, head_dim: 128,
            dtype: bfloat16, num_params: 8.03e9}
    kv_budget: 4GiB
    candidates: [8, 16, 32, 64, 128]
    window: {capacity: 1000, min_samples: 200}
    interval: 5m
    min_dwell: 30m
    safety_factor: 2
    goal: capacity            # or ttft_p99; slo, headroom, min_gain, engine: see below
    batch: {max_num_seqs: 64, max_num_batched_tokens: 512, enable_prefix_caching: false}
    mode: recommend
    calibration: default
    # the sidecar (`blocktune serve`); every section below is optional
    sources:                  # where request lengths come from (several at once)
      push: true              # POST /v1/observations
      vllm_metrics: {url: "http://127.0.0.1:8000/metrics", interval: 15s}
      jsonl_log: {path: requests.jsonl, prompt_field: usage.prompt_tokens,
                  output_field: usage.completion_tokens}
    server: {host: 127.0.0.1, port: 8787, state_file: blocktune-state.json,
             read_timeout: 10s, keep_alive: 5s, max_connections: 512,
             allowed_hosts: []}   # Host names served beside loopback (a proxy's)
    auth: {token_env: BLOCKTUNE_TOKEN}      # bearer token of the mutating endpoints
    actuator: {kind: none}    # or {kind: http, url: "http://127.0.0.1:8000"}: a worker
    # engine: vllm, vllm_backend: CPU_ATTN and a vLLM the sidecar restarts with a new size:
    # actuator: {kind: vllm_process, url: "http://127.0.0.1:8000",
    #            command: [python, -m, vllm.entrypoints.openai.api_server, --model, m,
    #                      --port, "8000", --block-size, "{block_size}"]}
    # or a script of yours: {kind: command, command: [./restart-vllm.sh, "{block_size}"]}
"""

from __future__ import annotations

import ipaddress
import math
import re
from datetime import timedelta
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    model_validator,
)

from blocktune.kernels import is_power_of_two
from blocktune.runtime.defaults import ENGINE_DTYPE_BYTES
from blocktune.tuner.config.config_files import ConfigError, load_yaml_model
from blocktune.tuner.config.defaults import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CANDIDATES,
    DEFAULT_POLICY,
    DEFAULT_TOKEN_ENV,
)
from blocktune.tuner.config.vllm_backends import (
    DEFAULT_VLLM_BACKEND,
    VLLM_BACKENDS,
    VllmBackend,
    VllmBackendName,
)

__all__ = [
    "DTYPE_BYTES",
    "MAX_BLOCK_SIZE",
    "BLOCK_SIZE_PLACEHOLDER",
    "DEFAULT_REFUSAL_TTL",
    "ActuatorSettings",
    "AuthSettings",
    "BatchSettings",
    "BlockSize",
    "DTypeName",
    "JsonlLogSettings",
    "KVShape",
    "ModelShape",
    "Policy",
    "Section",
    "ServerSettings",
    "SloSettings",
    "Sources",
    "VllmMetricsSettings",
    "WindowSettings",
    "bundled_policies",
    "load_policy",
    "nearest_power_of_two",
    "policy_path",
    "parse_duration",
]

DTYPE_BYTES = {**ENGINE_DTYPE_BYTES, "float8": 1}
"""Bytes of one element of each dtype a K/V cache is priced in: the engine's, and vLLM's fp8
cache."""
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
# Upper bounds: larger values are mistakes, and some would exhaust memory or overflow.
MAX_DURATION = timedelta(days=365)
MAX_BLOCK_SIZE = 1 << 16
MAX_KV_BUDGET = 1 << 50  # 1 PiB
MAX_WINDOW_CAPACITY = 1_000_000  # rows of the length window, allocated at start
MAX_ALLOWED_HOSTS = 64
MAX_URL_CHARS = 2048
_HOST_NAME = re.compile(r"[a-z0-9._~!$&'()*+,;=-]{1,253}|\[[0-9a-f:.]{2,45}\]")


def parse_duration(value: object) -> object:
    """'5m', '30s', '1h30m', '250ms' or a number of seconds -> `timedelta` (at most
    `MAX_DURATION`). Anything else is passed on unchanged for pydantic to reject.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return _duration(value, value)
    if not isinstance(value, str):
        return value
    text = value.strip().lower()
    parts = list(_DURATION_PART.finditer(text))
    if not parts or "".join(p.group(0) for p in parts).replace(" ", "") != text.replace(" ", ""):
        raise ValueError(
            f"expected a duration such as '30s', '5m', '1h30m' or '250ms', got {value!r}"
        )
    return _duration(sum(float(p.group(1)) * _UNIT_SECONDS[p.group(2)] for p in parts), value)


def _duration(seconds: float, given: object) -> timedelta:
    if not abs(seconds) <= MAX_DURATION.total_seconds():  # NaN and infinities fail too
        raise ValueError(f"durations are at most {MAX_DURATION.days} days, got {given!r}")
    return timedelta(seconds=seconds)


def _positive_duration(value: timedelta) -> timedelta:
    if value <= timedelta(0):
        raise ValueError(f"must be longer than zero, got {value.total_seconds()} s")
    return value


def _non_negative_duration(value: timedelta) -> timedelta:
    if value < timedelta(0):
        raise ValueError(f"must not be negative, got {value.total_seconds()} s")
    return value


def _power_of_two(value: int) -> int:
    if not is_power_of_two(value):
        raise ValueError(f"block sizes must be powers of two, got {value}")
    return value


def _distinct_sorted(values: tuple[int, ...]) -> tuple[int, ...]:
    if len(set(values)) != len(values):
        raise ValueError(f"candidates are listed twice: {sorted(values)}")
    return tuple(sorted(values))


def _http_url(value: str) -> str:
    if len(value) > MAX_URL_CHARS:
        raise ValueError(f"URLs are at most {MAX_URL_CHARS} characters, got {len(value)}")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http:// or https:// URL with a host, got {value!r}")
    return value


def _host_name(value: str) -> str:
    """A host name or address as the Host header names it (lower case, no port)."""
    name = value.strip().lower()
    if not _HOST_NAME.fullmatch(name):
        raise ValueError(
            f"expected a host name such as 'blocktune.internal' or an address such as "
            f"'10.0.0.5' or '[fd00::1]', without scheme or port, got {value[:80]!r}"
        )
    if name.startswith("["):
        try:
            return str(ipaddress.IPv6Address(name[1:-1]))
        except ValueError:
            raise ValueError(f"{value!r} is not an IPv6 address in brackets") from None
    return name


def _field_path(value: str) -> str:
    if not value or any(not part for part in value.split(".")):
        raise ValueError(
            f"expected a field name or a dotted path such as 'usage.prompt_tokens', got {value!r}"
        )
    return value


Duration = Annotated[timedelta, BeforeValidator(parse_duration), AfterValidator(_positive_duration)]
DwellDuration = Annotated[
    timedelta, BeforeValidator(parse_duration), AfterValidator(_non_negative_duration)
]
BlockSize = Annotated[int, Field(strict=True, le=MAX_BLOCK_SIZE), AfterValidator(_power_of_two)]
HttpUrl = Annotated[str, AfterValidator(_http_url)]
FieldPath = Annotated[str, AfterValidator(_field_path)]
HostName = Annotated[str, Field(strict=True, max_length=260), AfterValidator(_host_name)]


class Section(BaseModel):
    """Base of every policy section: unknown keys are errors and the values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


DTypeName = Literal[tuple(DTYPE_BYTES)]
"""The dtypes a K/V cache is priced in (the keys of `DTYPE_BYTES`)."""


class KVShape(Section):
    """The K/V of one token in one layer: heads, head size and dtype."""

    num_kv_heads: int = Field(
        gt=0, le=4096, description="K/V heads (fewer than num_heads with GQA)"
    )
    head_dim: int = Field(gt=0, le=4096)
    dtype: DTypeName

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """Bytes of K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes


class ModelShape(KVShape):
    """The model: attention shape, KV dtype and weight count, and where known its name and
    the rest of its (Llama) architecture, which an engine calibration records of the model
    it timed and from which the weight count follows where `num_params` is not given."""

    num_layers: int = Field(gt=0, le=4096)
    num_heads: int = Field(gt=0, le=4096, description="query heads")
    num_params: float | None = Field(
        default=None,
        gt=0,
        le=1e15,
        description="weights, for the per-step weight read time (none: counted from "
        "hidden_size, intermediate_size and vocab_size)",
    )
    name: str | None = Field(default=None, min_length=1, max_length=1024)
    hidden_size: int | None = Field(default=None, gt=0, le=1 << 20)
    intermediate_size: int | None = Field(default=None, gt=0, le=1 << 22)
    vocab_size: int | None = Field(default=None, gt=0, le=1 << 24)

    @model_validator(mode="after")
    def _gqa_groups(self) -> ModelShape:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        architecture = (self.hidden_size, self.intermediate_size, self.vocab_size)
        if self.num_params is None and None in architecture:
            raise ValueError(
                "num_params is needed where hidden_size, intermediate_size and vocab_size "
                "are not all given"
            )
        return self

    @property
    def weight_count(self) -> float:
        """`num_params`, or where it is not given the weights of a Llama of this shape: the
        embeddings and each layer's attention and MLP projections."""
        if self.num_params is not None:
            return self.num_params
        heads = 2 * self.num_heads + 2 * self.num_kv_heads
        attention = self.hidden_size * self.head_dim * heads
        mlp = 3 * self.hidden_size * self.intermediate_size
        return float(self.vocab_size * self.hidden_size + self.num_layers * (attention + mlp))

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token across all layers (one KV slot)."""
        return self.num_layers * self.kv_bytes_per_token_layer

    @property
    def weight_bytes(self) -> float:
        return self.weight_count * self.dtype_bytes


class WindowSettings(Section):
    """How many finished requests the length window keeps and how many a decision needs."""

    capacity: int = Field(default=1000, gt=0, le=MAX_WINDOW_CAPACITY)
    min_samples: int = Field(default=100, gt=0)

    @model_validator(mode="after")
    def _fits(self) -> WindowSettings:
        if self.min_samples > self.capacity:
            raise ValueError(
                f"min_samples ({self.min_samples}) exceeds capacity ({self.capacity}): "
                "the window could never hold enough requests"
            )
        return self


class VllmMetricsSettings(Section):
    """Scrape a vLLM server's Prometheus `/metrics` for its request-length histograms."""

    url: HttpUrl
    interval: Duration = timedelta(seconds=15)
    timeout: Duration = timedelta(seconds=5)


class JsonlLogSettings(Section):
    """Follow a JSONL request log (one finished request per line) through rotation.

    Field names may be dotted paths into nested objects (`usage.prompt_tokens`);
    a line without the timestamp or prefix field is observed now / without a group.
    """

    path: str = Field(min_length=1)
    interval: Duration = timedelta(seconds=1)
    prompt_field: FieldPath = "prompt_tokens"
    output_field: FieldPath = "output_tokens"
    timestamp_field: FieldPath | None = "timestamp"
    prefix_field: FieldPath | None = "prefix_group"
    start_at: Literal["end", "beginning"] = Field(
        default="end", description="where to start in a file that exists at start-up"
    )


class Sources(Section):
    """Where the sidecar's request lengths come from; several may be on at once."""

    push: bool = Field(default=True, description="accept POST /v1/observations")
    vllm_metrics: VllmMetricsSettings | None = None
    jsonl_log: JsonlLogSettings | None = None

    @model_validator(mode="after")
    def _at_least_one(self) -> Sources:
        if not self.push and self.vllm_metrics is None and self.jsonl_log is None:
            raise ValueError(
                "no source is on: set push: true or configure vllm_metrics or jsonl_log"
            )
        return self


class ServerSettings(Section):
    """Where `blocktune serve` listens, where it keeps its state, and the starting size;
    the connection limits hold for `blocktune worker --policy` too."""

    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=8787, ge=1, le=65535)
    state_file: str | None = Field(default=None, min_length=1)
    initial_block_size: BlockSize | None = Field(
        default=None,
        description=(
            "block size assumed in force until a source, the worker or the state file "
            f"reports one (default: {DEFAULT_BLOCK_SIZE}, or the candidate nearest to it)"
        ),
    )
    read_timeout: Duration = Field(
        default=timedelta(seconds=10),
        description="a connection not delivering a whole request (head and body) this long "
        "after it opened or after its last answer is closed",
    )
    keep_alive: Duration = Field(
        default=timedelta(seconds=5), description="an idle connection is closed after this"
    )
    max_connections: int = Field(
        default=512, ge=1, le=65535, description="connections beyond this many are closed at once"
    )
    allowed_hosts: tuple[HostName, ...] = Field(
        default=(),
        max_length=MAX_ALLOWED_HOSTS,
        description="host names (or addresses) clients may send in the Host header beside the "
        "loopback ones, e.g. the name of a proxy in front (a request for any other is a 421)",
    )


class AuthSettings(Section):
    """The environment variable holding the bearer token of the mutating endpoints."""

    token_env: str | None = Field(default=DEFAULT_TOKEN_ENV, min_length=1)


BLOCK_SIZE_PLACEHOLDER = "{block_size}"
"""Replaced by the block size in an actuator's command."""
DEFAULT_REFUSAL_TTL = timedelta(hours=1)
"""How long a block size vLLM refused to start with is rejected without a try."""


def _command(value: tuple[str, ...]) -> tuple[str, ...]:
    if not any(BLOCK_SIZE_PLACEHOLDER in part for part in value):
        raise ValueError(
            f"the command never says {BLOCK_SIZE_PLACEHOLDER}, so every run would start the "
            f"same size: put it where the size goes, e.g. '--block-size', "
            f"'{BLOCK_SIZE_PLACEHOLDER}'"
        )
    return value


Command = Annotated[
    tuple[Annotated[str, Field(min_length=1)], ...], Field(min_length=1), AfterValidator(_command)
]


class ActuatorSettings(Section):
    """What applies a switch in `mode: enforce`: nothing; a blocktune worker over HTTP; a
    vLLM server the sidecar runs as its child and restarts with the new size
    (`vllm_process`); or a user's command, such as a systemd or Kubernetes rollout
    (`command`). In a command, `{block_size}` stands for the size to start."""

    kind: Literal["none", "http", "vllm_process", "command"] = "none"
    url: HttpUrl | None = Field(
        default=None,
        description="http: the worker's base URL; vllm_process and command: the vLLM "
        "server's base URL, for /health and /metrics",
    )
    command: Command | None = Field(
        default=None, description="vllm_process and command: the argv, with {block_size}"
    )
    token_env: str | None = Field(default=DEFAULT_TOKEN_ENV, min_length=1)
    timeout: Duration = Field(
        default=timedelta(seconds=90),
        description="http: per attempt (a swap waits for a step); command: per run",
    )
    retries: int = Field(default=3, ge=0, le=10, description="retries of a transient failure")
    backoff: Duration = Field(default=timedelta(seconds=0.5), description="first retry delay")
    drain_timeout: DwellDuration = Field(
        default=timedelta(seconds=30),
        description="vllm_process: how long a restart waits for in-flight requests",
    )
    start_timeout: Duration = Field(
        default=timedelta(seconds=300),
        description="vllm_process and command: how long a start may take to answer /health",
    )
    stop_timeout: Duration = Field(
        default=timedelta(seconds=30),
        description="vllm_process: SIGTERM, then SIGKILL after this long",
    )
    log_file: str | None = Field(
        default=None,
        min_length=1,
        description="vllm_process: a file the server's output is appended to (relative paths "
        "start at the policy's folder)",
    )
    refusal_ttl: Duration = Field(
        default=DEFAULT_REFUSAL_TTL,
        description="vllm_process: how long a size vLLM refused is rejected without a try",
    )

    @model_validator(mode="after")
    def _parts_for_the_kind(self) -> ActuatorSettings:
        if self.kind == "http" and self.url is None:
            raise ValueError("kind: http needs the worker's url (e.g. http://127.0.0.1:8000)")
        if self.kind == "none" and self.url is not None:
            raise ValueError("url is set but kind is none: set kind: http to use the worker")
        if self.kind == "vllm_process" and self.url is None:
            raise ValueError(
                "kind: vllm_process needs the server's url (e.g. http://127.0.0.1:8000), "
                "where it answers /health"
            )
        restarts = self.kind in ("vllm_process", "command")
        if restarts and self.command is None:
            raise ValueError(
                f"kind: {self.kind} needs a command, e.g. [python, -m, "
                "vllm.entrypoints.openai.api_server, --block-size, '{block_size}']"
            )
        if not restarts and self.command is not None:
            raise ValueError(
                f"command is set but kind is {self.kind}: set kind: vllm_process or command"
            )
        return self


class SloSettings(Section):
    """The latency the deployment promises: p99 time to first token and per output token."""

    ttft_p99_s: float = Field(default=2.0, gt=0, le=3600, description="seconds")
    tpot_p99_s: float = Field(default=0.15, gt=0, le=60, description="seconds")


class BatchSettings(Section):
    """The engine's batch limits, as its scheduler applies them every step, and its prefix
    cache (the module docstring says how the simulator follows them)."""

    max_num_seqs: int | None = Field(
        default=None,
        ge=1,
        le=1 << 16,
        description="sequences batched at once (none: the engine's default)",
    )
    max_num_batched_tokens: int | None = Field(
        default=None,
        ge=1,
        le=1 << 24,
        description="tokens per step, prefill chunks included (none: the engine's default; "
        "blocktune's prefills whole prompts)",
    )
    enable_prefix_caching: bool | None = Field(
        default=None,
        description="reuse the K/V blocks of a prompt prefix an earlier request computed "
        "(none: on, except for blocktune with max_num_batched_tokens, which excludes it)",
    )


class Policy(Section):
    """One deployment's tuning policy (see the module docstring for the file format)."""

    deployment: str = Field(min_length=1, max_length=200)
    model: ModelShape
    kv_budget: Annotated[ByteSize, Field(gt=0, le=MAX_KV_BUDGET)]
    candidates: Annotated[
        tuple[BlockSize, ...], Field(min_length=1), AfterValidator(_distinct_sorted)
    ] = DEFAULT_CANDIDATES
    window: WindowSettings = WindowSettings()
    interval: Duration = timedelta(minutes=5)
    min_dwell: DwellDuration = timedelta(minutes=30)
    safety_factor: float = Field(default=2.0, ge=1.0, le=1e6)
    slo: SloSettings = SloSettings()
    goal: Literal["capacity", "ttft_p99"] = Field(
        default="capacity",
        description="what the decision maximises: the arrival-rate multiple served within "
        "the SLO, or (lowest) TTFT p99 at the headroom load",
    )
    headroom: float = Field(
        default=2.0, ge=1.0, le=1000, description="the load multiple the decision plans for"
    )
    min_gain: float = Field(
        default=0.02,
        ge=0.0,
        lt=1.0,
        description="the smallest relative gain on the goal worth a switch: the low end of "
        "the forecast's gain interval (its noise) must be above it",
    )
    engine: Literal["blocktune", "vllm"] = Field(
        default="blocktune", description="the engine the predictions model"
    )
    vllm_backend: VllmBackendName = Field(
        default=DEFAULT_VLLM_BACKEND,
        description="engine vllm: the attention backend the server runs (CPU_ATTN on a CPU "
        "build); candidates it refuses are errors",
    )
    batch: BatchSettings = BatchSettings()
    swap_pause: Duration = Field(
        default=timedelta(milliseconds=10),
        description="blocktune: the pause of one live swap besides its copies "
        "(6.8-11.4 ms measured on the CPU engine, 0 bytes moved)",
    )
    restart: Duration = Field(
        default=timedelta(seconds=60),
        description="vLLM: serving lost to drain and reload for a restart with a new size",
    )
    mode: Literal["recommend", "enforce"] = "recommend"
    device: str | None = Field(
        default=None,
        min_length=1,
        description="the GPU the deployment runs on, e.g. 'NVIDIA L4'; a calibration made "
        "for another device is warned about",
    )
    calibration: str = Field(
        default="default",
        min_length=1,
        description="'default', a bundled calibration's name (e.g. 'analytic_a100_80gb') "
        "or a YAML path",
    )
    sources: Sources = Sources()
    server: ServerSettings = ServerSettings()
    auth: AuthSettings = AuthSettings()
    actuator: ActuatorSettings = ActuatorSettings()

    @model_validator(mode="after")
    def _budget_holds_a_block(self) -> Policy:
        largest = max(self.candidates) * self.model.kv_bytes_per_token
        if self.kv_budget < largest:
            raise ValueError(
                f"kv_budget ({int(self.kv_budget)} bytes) holds no block of the largest "
                f"candidate ({max(self.candidates)} tokens = {largest} bytes)"
            )
        return self

    @model_validator(mode="after")
    def _sidecar_sections_agree(self) -> Policy:
        initial = self.server.initial_block_size
        if initial is not None and initial not in self.candidates:
            raise ValueError(
                f"server.initial_block_size {initial} is not among the candidates "
                f"{list(self.candidates)}"
            )
        if self.actuator.kind == "http" and self.sources.vllm_metrics is not None:
            raise ValueError(
                "actuator kind http swaps a blocktune worker's block size, but the lengths come "
                "from a vLLM server (sources.vllm_metrics), which fixes its block size at "
                "start-up: use actuator kind vllm_process or command (a restart), or none "
                "(recommendations)"
            )
        if self.actuator.kind == "vllm_process" and self.engine != "vllm":
            raise ValueError(
                "actuator kind vllm_process runs a vLLM server, but the policy's engine is "
                f"{self.engine}: set engine: vllm (and vllm_backend) so the predictions are vLLM's"
            )
        return self

    @model_validator(mode="after")
    def _prefix_cache_fits_the_batch(self) -> Policy:
        batch = self.batch
        chunked = batch.max_num_batched_tokens is not None
        if self.engine == "blocktune" and chunked and batch.enable_prefix_caching:
            raise ValueError(
                "batch: blocktune's engine cannot combine max_num_batched_tokens (chunked "
                "prefill) with enable_prefix_caching: leave one out"
            )
        return self

    @model_validator(mode="after")
    def _engine_takes_the_candidates(self) -> Policy:
        if self.engine == "vllm":
            refused = self.backend.refused(self.candidates)
            if refused:
                raise ValueError(
                    f"engine vllm: candidates {refused} are refused by the {self.vllm_backend} "
                    f"backend: {self.backend.rule()}"
                )
        return self

    @property
    def backend(self) -> VllmBackend:
        """The vLLM attention backend the policy names (its block-size rule and device)."""
        return VLLM_BACKENDS[self.vllm_backend]

    @property
    def switch_cost_s(self) -> float:
        """Serving time one change of the block size costs: a live swap's pause in
        blocktune's engine, a drain-and-reload restart for vLLM."""
        pause = self.restart if self.engine == "vllm" else self.swap_pause
        return pause.total_seconds()

    def calibration_path(self, base: Path) -> Path | None:
        """The calibration file (relative paths start at `base`), or None for the default.
        A bundled calibration's name is a path that does not exist here: see
        `calibration.calibration_for`."""
        if self.calibration == "default":
            return None
        path = Path(self.calibration).expanduser()
        return path if path.is_absolute() else base / path


def nearest_power_of_two(tokens: float, candidates: tuple[int, ...]) -> int:
    """The candidate nearest to `tokens` in log2 (ties to the smaller), clamped to the range."""
    if not tokens > 0:
        return min(candidates)
    target = math.log2(tokens)
    return min(candidates, key=lambda b: (abs(math.log2(b) - target), b))


def bundled_policies() -> dict[str, Path]:
    """The policies shipped with blocktune, by file stem (``default``, ``long_document``, ...)."""
    folder = Path(str(resources.files("blocktune.policies")))
    return {path.stem: path for path in sorted(folder.glob("*.yaml"))}


def policy_path(name_or_path: Path | str) -> Path:
    """The file of a policy given as a path or as a bundled policy's stem.

    An existing file wins; a bare name (``customer_service_llama8b``) that is no
    file here is looked up among the bundled policies, so commands work from any
    directory and from an installed wheel.
    """
    path = Path(name_or_path).expanduser()
    if path.is_file() or path.parent != Path(".") or path.suffix not in ("", ".yaml"):
        return path
    bundled = bundled_policies()
    if path.stem in bundled:
        return bundled[path.stem]
    problem = f"{path}: no such file, and no bundled policy of that name ({', '.join(bundled)})"
    raise ConfigError(path, [problem])


def load_policy(name_or_path: Path | str = DEFAULT_POLICY) -> Policy:
    """Read and validate a policy file or bundled policy; `ConfigError` lists every problem."""
    return load_yaml_model(policy_path(name_or_path), Policy)

"""Applying a switch: a blocktune worker over HTTP, or an engine in the same process
(restarts of vLLM or a user's command are in `vllm_process` and `command_actuator`).

An actuator's `apply(new, old)` never raises: it returns an `Actuation`, the
worker's `SwapResult` (status `done`, `rejected` or `rolled_back`) with the
attempts it took, or status `failed` when no result came back (the worker
stayed unreachable or answered 5xx through every retry, refused the token, or
the engine reached no step boundary in time). `block_size()` asks the target
which size is in force, so the sidecar decides against the truth.

`HttpActuator` POSTs `{"block_size": B}` to the worker's `/admin/block-size`
with the bearer token, retrying connection errors, timeouts and 5xx answers
with exponential backoff; a 4xx answer is final. Asking for the size already in
force is harmless, so a retry after a lost answer cannot do harm. An answer is
trusted only as far as it is consistent: a "done" swap to any size but the one
asked for, or a size in force that is no valid block size, counts as no answer.
Every field kept from an answer is bounded (a reason is cut at
`MAX_REASON_CHARS`), so the sidecar's state file stays within its size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal, Protocol

import httpx
from pydantic import AfterValidator, BaseModel, Field, TypeAdapter, ValidationError

from blocktune.runtime.swap_result import SwapResult
from blocktune.tuner.config.config_files import clip, format_location
from blocktune.tuner.config.policy import BlockSize

if TYPE_CHECKING:
    from blocktune.runtime.engine import Engine

__all__ = ["Actuation", "Actuator", "EngineActuator", "HttpActuator", "SWAP_STATUSES"]

SWAP_STATUSES = ("done", "rejected", "rolled_back", "failed")
MAX_BACKOFF_S = 30.0
STATE_TIMEOUT_S = 5.0
MAX_REASON_CHARS = 1000  # of a reason the sidecar keeps (a worker's, an error's)
MAX_PAUSE_S = 3600.0


@dataclass(frozen=True)
class Actuation(SwapResult):
    """The outcome of applying one switch: the swap result with the attempts it took, or
    status "failed" (one of SWAP_STATUSES) and why there is none."""

    status: str
    attempts: int = 1
    target: str = ""
    at: float = 0.0


class Actuator(Protocol):
    """What the sidecar asks of an actuator: these here and the restarting ones of
    `vllm_process` and `command_actuator`."""

    @property
    def target(self) -> str:
        """What a switch is applied to, in words."""

    def start(self) -> None:
        """Start what the actuator runs (called once, when the sidecar starts)."""

    def apply(self, new_block_size: int, old_block_size: int) -> Actuation:
        """Apply one switch; the outcome, never an exception."""

    def block_size(self) -> int | None:
        """The size in force, or None when the target does not answer."""

    def close(self) -> None:
        """Release what the actuator holds (called once, when the sidecar stops)."""


# An integer of at most 39 digits: any the worker has reason to send, and bounded.
Integer = Annotated[int, Field(strict=True, gt=-(2**127), lt=2**127)]


class _SwapAnswer(BaseModel):
    """A worker's answer to a swap, every field bounded, so what the sidecar keeps of it
    fits its state file (the reason is cut at `MAX_REASON_CHARS`)."""

    status: Literal["done", "rejected", "rolled_back"]
    old_block_size: Integer
    new_block_size: Integer
    zero_copy_blocks: Integer = 0
    copied_blocks: Integer = 0
    bytes_moved: Integer = 0
    pause_s: float = Field(0.0, ge=0.0, le=MAX_PAUSE_S, allow_inf_nan=False)
    reason: Annotated[str, AfterValidator(lambda text: clip(text, MAX_REASON_CHARS))] = ""


_BLOCK_SIZE = TypeAdapter(BlockSize)


class HttpActuator:
    """Swaps a blocktune worker's block size through its admin endpoint."""

    def __init__(
        self,
        url: str,
        token: str | None,
        *,
        timeout_s: float = 90.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.url = url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self._sleep = sleep
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(timeout=timeout_s, headers=headers)

    @property
    def target(self) -> str:
        return f"{self.url}/admin/block-size"

    def start(self) -> None:
        """Nothing to start: the worker runs on its own."""

    def apply(self, new_block_size: int, old_block_size: int) -> Actuation:
        """POST the swap, retrying transient failures; the outcome, never an exception."""
        last_error = ""
        for attempt in range(1, self.retries + 2):
            if attempt > 1:
                self._sleep(min(MAX_BACKOFF_S, self.backoff_s * 2 ** (attempt - 2)))
            try:
                response = self._client.post(self.target, json={"block_size": new_block_size})
            except httpx.TransportError as error:
                last_error = f"{type(error).__name__}: {error}"
                continue
            if response.status_code >= 500:
                last_error = f"HTTP {response.status_code}: {response.text[:200]}"
                continue
            return self._outcome(response, new_block_size, old_block_size, attempt)
        return self._failed(
            new_block_size,
            old_block_size,
            f"no answer after {self.retries + 1} attempts; last: {last_error}",
            self.retries + 1,
        )

    def _outcome(self, response: httpx.Response, new: int, old: int, attempts: int) -> Actuation:
        if response.status_code == 401:
            reason = "the worker refused the bearer token (check actuator.token_env)"
            return self._failed(new, old, reason, attempts)
        if response.status_code != 200:
            reason = f"HTTP {response.status_code}: {response.text[:200]}"
            return self._failed(new, old, reason, attempts)
        try:
            body = _SwapAnswer.model_validate_json(response.content)
        except ValidationError as error:
            first = error.errors()[0]
            reason = (
                f"the worker's answer is not a SwapResult: {format_location(first['loc'])}: "
                f"{first['msg']}"
            )
            return self._failed(new, old, reason, attempts)
        if body.status == "done" and body.new_block_size != new:
            reason = f"the worker reports a swap to {body.new_block_size}, not to {new}"
            return self._failed(new, old, reason, attempts)
        return Actuation(**body.model_dump(), attempts=attempts, target=self.target, at=time.time())

    def _failed(self, new: int, old: int, reason: str, attempts: int) -> Actuation:
        reason = clip(reason, MAX_REASON_CHARS)
        return Actuation(
            "failed", old, new, reason=reason, attempts=attempts, target=self.target, at=time.time()
        )

    def block_size(self) -> int | None:
        """The worker's block size from `GET /admin/state`, or None when it does not answer
        (or answers no valid block size)."""
        try:
            response = self._client.get(f"{self.url}/admin/state", timeout=STATE_TIMEOUT_S)
            response.raise_for_status()
            return _BLOCK_SIZE.validate_python(response.json().get("block_size"))
        except (httpx.HTTPError, ValueError, AttributeError):  # ValidationError is a ValueError
            return None

    def close(self) -> None:
        self._client.close()


class EngineActuator:
    """Swaps an in-process `Engine`'s block size at its next step boundary.

    Whoever runs the engine must keep stepping it; a swap that finds no step
    boundary within `timeout_s` is reported as failed (the request stays queued
    in the engine, and the sidecar reads the engine's size before each decision).
    """

    target = "engine"

    def __init__(self, engine: Engine, *, timeout_s: float = 90.0) -> None:
        self.engine = engine
        self.timeout_s = timeout_s

    def apply(self, new_block_size: int, old_block_size: int) -> Actuation:
        ticket = self.engine.request_block_size(new_block_size)
        try:
            result = ticket.result(self.timeout_s)
        except FutureTimeout:
            return Actuation(
                "failed",
                old_block_size,
                new_block_size,
                reason=f"the engine reached no step boundary within {self.timeout_s:g} s",
                target=self.target,
                at=time.time(),
            )
        return Actuation(**result.to_dict(), target=self.target, at=time.time())

    def start(self) -> None:
        """Nothing to start: the engine belongs to its owner."""

    def block_size(self) -> int:
        return self.engine.block_size

    def close(self) -> None:
        """Nothing to release: the engine belongs to its owner."""

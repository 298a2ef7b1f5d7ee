"""The engine's request records: what it holds per request and what it reports.

Below the scheduler, the runner and the engine alike: they share these records and
nothing else of each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blocktune.runtime.sampling import SamplingParams

__all__ = [
    "FinishedRequest",
    "Request",
    "RequestError",
    "RequestFailed",
    "RequestOutput",
    "RequestTooLarge",
    "TokenLogprob",
]


class RequestError(ValueError):
    """A request the engine cannot serve; the message names the bad value."""


class RequestTooLarge(RequestError):
    """A request whose tokens could never fit in the KV pool, even alone."""


class RequestFailed(RuntimeError):
    """A request the engine ended during a step because something of its own raised (its
    `RequestOutput` has `finish_reason` "error"); the other requests of the step went on."""


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and the most likely tokens at its position."""

    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class RequestOutput:
    """What a step produced for one request (`logprob` of the new token when asked for;
    in a request's first output, `prompt_logprobs` of its prompt tokens after the first).
    A request that failed ends with no new token, `finish_reason` "error" (vLLM's name)
    and the failure in `error`."""

    request_id: int
    new_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    logprob: TokenLogprob | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    error: str | None = None


@dataclass(frozen=True)
class FinishedRequest:
    """A finished request's lengths and times, for the tuner's window."""

    request_id: int
    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    finish_s: float
    finish_reason: str


@dataclass
class Request:
    """A request the engine holds: its tokens so far, sampling state and batch row."""

    id: int
    prompt: list[int]
    params: SamplingParams
    arrival_s: float
    generator: torch.Generator | None
    output: list[int] = field(default_factory=list)
    row: int | None = None
    prefill_left: int = 0  # tokens of the admitted context whose K/V are not computed yet
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

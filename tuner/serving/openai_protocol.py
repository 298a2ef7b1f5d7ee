"""The request bodies of the worker's OpenAI-compatible API, as strict pydantic models.

Strict means no coercion: `"16"`, `3.0` and `true` are not integers, `["1"]`
is not a list of token ids, NaN and infinity are not numbers, and unknown
fields are refused, so a typo never passes silently. Fields and defaults
follow OpenAI's API (temperature 1, 16 completion tokens); `prompt_ids` and
`stop_token_ids` are blocktune's extensions (the second is vLLM's too).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "MAX_CHOICES",
    "StreamOptions",
]

MAX_CHOICES = 16  # the most choices (`n`) one request may ask for
MAX_PROMPTS = 64  # the most prompts one completion request may list
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's limit for /v1/chat/completions

TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
StopText = Annotated[str, Field(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    """`stream_options`: with `include_usage`, a last chunk carries the token counts."""

    include_usage: bool = False


class _Sampling(_Strict):
    """The fields completions and chat completions share."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] = []
    stream: bool = False
    stream_options: StreamOptions | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: `prompt` as text, texts, token ids or lists of token ids
    (at most `MAX_PROMPTS`; or blocktune's `prompt_ids`), one completion per prompt and
    choice."""

    # What the validator below refuses, said in the schema too.
    model_config = ConfigDict(
        json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["prompt_ids"]}]}
    )

    prompt: (
        str
        | Annotated[list[str], Field(max_length=MAX_PROMPTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(max_length=MAX_PROMPTS)]
        | None
    ) = None
    prompt_ids: TokenIds | None = None
    max_tokens: int = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        if (self.prompt_ids is None) == (self.prompt is None):
            raise ValueError("give exactly one of prompt and prompt_ids")
        if self.prompt == []:
            raise ValueError("prompt is an empty list")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each prompt as text or token ids, in order."""
        if self.prompt_ids is not None:
            return [self.prompt_ids]
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextPart(_Strict):
    """A text part of a message's content (the only kind of part a text model takes)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One message of a conversation."""

    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


_ROOM_LEFT = (
    "default: the room left in the context, max_model_len less the prompt (as vLLM does); "
    "give at most one of max_tokens and max_completion_tokens"
)


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`: the messages in the model's chat template. Without
    `max_completion_tokens` (or the older `max_tokens`) the answer may fill the room left."""

    # What the validator below refuses, said in the schema too.
    model_config = ConfigDict(
        json_schema_extra={"not": {"required": ["max_tokens", "max_completion_tokens"]}}
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description=f"deprecated by OpenAI; {_ROOM_LEFT}")
    max_completion_tokens: int | None = Field(
        None, ge=1, description=f"the most tokens to generate; {_ROOM_LEFT}"
    )
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give at most one of max_tokens and max_completion_tokens")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

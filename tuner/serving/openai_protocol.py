"""The request bodies of the worker's OpenAI-compatible API, as strict pydantic models.

Strict means no coercion: `"16"`, `3.0` and `true` are not integers, `["1"]`
is not a list of token ids, NaN and infinity are not numbers, and unknown
fields are refused, so a typo never passes silently. `null` stands for the
default of any optional field, as in OpenAI's API. Fields and defaults follow
OpenAI's API (temperature 1, 16 completion tokens); vLLM's sampling extras
(`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`,
`stop_token_ids`, `stream_options.continuous_usage_stats`) are accepted with
vLLM's meaning, and `prompt_ids` is blocktune's. Fields that only steer
OpenAI's platform (`user`, `store`, `metadata`, `parallel_tool_calls`,
`service_tier`) are accepted and ignored. What is accepted but not served
(`tools`, a `response_format` other than text, `best_of` above `n`) is refused
with a 400 that says so when the request is prepared (`openai_api`). The JSON
schema says what the validators refuse too, with null as the default: exactly
one of `prompt` and `prompt_ids` that is not null, at most one of `max_tokens`
and `max_completion_tokens`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

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

MAX_LOGIT_BIAS = 300  # OpenAI's limit on the tokens one logit_bias names
MAX_STOP_TOKEN_IDS = MAX_LOGIT_BIAS  # vLLM sets none; as many as logit_bias may name
# vLLM takes any finite penalty above 0; one of 100 already all but bans a token seen, and far
# above it a logit times the penalty leaves float64's range.
MAX_REPETITION_PENALTY = 100.0

TOKEN_ID_KEY = "0|[1-9][0-9]*"  # a logit_bias key: a token id in ASCII digits, as "5" ("05" not)
TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
StopText = Annotated[str, Field(min_length=1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]


def _given(*names: str) -> dict:
    """The JSON schema of "each of `names` is there and not null" (null is the default)."""
    return {
        "required": list(names),
        "properties": {name: {"not": {"type": "null"}} for name in names},
    }


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class StreamOptions(_Strict):
    """`stream_options`: with `include_usage`, a last chunk carries the token counts; with
    vLLM's `continuous_usage_stats`, every chunk carries the counts so far."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    """The fields completions and chat completions share."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, description="vLLM's: keep the k likeliest; 0 or -1 keeps all")
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] = []
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: float = Field(1.0, gt=0.0, le=MAX_REPETITION_PENALTY, allow_inf_nan=False)
    logit_bias: (
        Annotated[
            dict[str, float],
            Field(
                max_length=MAX_LOGIT_BIAS,
                json_schema_extra={"propertyNames": {"pattern": f"^({TOKEN_ID_KEY})$"}},
            ),
        ]
        | None
    ) = None
    response_format: dict[str, Any] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted and ignored: they steer OpenAI's platform, not the completion.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for token, value in (bias or {}).items():
            if not re.fullmatch(TOKEN_ID_KEY, token):
                raise ValueError(
                    f'logit_bias keys are token ids in decimal digits such as "5", got {token!r}'
                )
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values are in [-100, 100], got {value}")
        return bias

    @model_validator(mode="after")
    def _consistent_sampling(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def token_bias(self) -> dict[int, float]:
        return {int(token): value for token, value in (self.logit_bias or {}).items()}

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: `prompt` as text, texts, token ids or lists of token ids
    (at most `MAX_PROMPTS`; or blocktune's `prompt_ids`), one completion per prompt and
    choice."""

    # What the validator below refuses, said in the schema too.
    model_config = ConfigDict(json_schema_extra={"oneOf": [_given("prompt"), _given("prompt_ids")]})

    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
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
    """One message of a conversation. `developer` is OpenAI's newer name for `system`; a
    `name` is accepted and not shown to the model; a `tool` message (a tool's answer, with
    the `tool_call_id` it answers) goes to the chat template like any other, which renders
    it or refuses it (a 400 naming the template's reason)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None
    tool_call_id: str | None = None

    @property
    def template_role(self) -> str:
        """The role as the chat template knows it."""
        return "system" if self.role == "developer" else self.role

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, str]:
        """The message as the chat template reads it: role, text and any `tool_call_id`."""
        message = {"role": self.template_role, "content": self.text()}
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


_ROOM_LEFT = (
    "default: the room left in the context, max_model_len less the prompt (as vLLM does); "
    "give at most one of max_tokens and max_completion_tokens"
)


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`: the messages in the model's chat template. Without
    `max_completion_tokens` (or the older `max_tokens`) the answer may fill the room left."""

    # What the validator below refuses, said in the schema too.
    model_config = ConfigDict(
        json_schema_extra={"not": _given("max_tokens", "max_completion_tokens")}
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description=f"deprecated by OpenAI; {_ROOM_LEFT}")
    max_completion_tokens: int | None = Field(
        None, ge=1, description=f"the most tokens to generate; {_ROOM_LEFT}"
    )
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # accepted and ignored, as without tools

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

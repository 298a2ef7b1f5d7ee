"""The worker's OpenAI-compatible API apart from HTTP: requests become engine jobs, choices
become OpenAI's response and chunk objects, refusals become OpenAI error objects.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from blocktune.runtime.requests import TokenLogprob
from blocktune.runtime.sampling import SamplingParams
from blocktune.runtime.tokenizer import Tokenizer
from blocktune.tuner.serving.generation import ChoiceText
from blocktune.tuner.serving.openai_protocol import ChatCompletionRequest, CompletionRequest

__all__ = ["OPENAI_ERROR_SCHEMA", "OpenAIError", "Prepared", "ServedModel", "Usage"]

# The id prefix and `object` of each kind of response (OpenAI's).
OBJECTS = {"completion": ("cmpl", "text_completion"), "chat": ("chatcmpl", "chat.completion")}


_NULLABLE_TEXT = {"anyOf": [{"type": "string"}, {"type": "null"}]}
OPENAI_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": _NULLABLE_TEXT,
                "code": _NULLABLE_TEXT,
            },
        }
    },
}


class OpenAIError(Exception):
    """A refusal answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True)
class ServedModel:
    """The model as the API presents it: its name, tokenizer and the most tokens a request
    may hold (`max_model_len`, or the KV pool's size when it is smaller)."""

    name: str
    tokenizer: Tokenizer | None
    max_model_len: int
    created: int = field(default_factory=lambda: int(time.time()))

    def card(self) -> dict:
        """The `/v1/models` entry."""
        return {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "blocktune",
            "max_model_len": self.max_model_len,
        }

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.name:
            raise OpenAIError(
                404,
                f"the model {requested!r} does not exist; this worker serves {self.name!r}",
                param="model",
                code="model_not_found",
            )

    def _need_tokenizer(self, what: str, param: str) -> Tokenizer:
        if self.tokenizer is None:
            raise OpenAIError(
                400, f"{what} needs a tokenizer, and this model has none", param=param
            )
        return self.tokenizer

    def encode(self, text: str, param: str) -> list[int]:
        try:
            return self._need_tokenizer("a text prompt", param).encode(text)
        except ValueError as error:
            raise OpenAIError(400, str(error), param=param) from None

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        tokenizer = self._need_tokenizer("a chat", "messages")
        messages = [m.for_template() for m in body.messages]
        try:
            return tokenizer.apply_chat_template(messages)
        except ValueError as error:
            raise OpenAIError(400, str(error), param="messages") from None

    def decode(self, token_ids: Sequence[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids)

    def echoed(self, prompt: Sequence[int], param: str) -> str:
        """A prompt of token ids as `echo` shows it; 400 for ids the tokenizer cannot decode
        (outside its vocabulary), which the engine would refuse anyway."""
        try:
            return self.decode(prompt)
        except (ValueError, OverflowError) as error:
            raise OpenAIError(
                400, f"the prompt's token ids cannot be decoded to echo: {error}", param=param
            ) from None

    def token_text(self, token_id: int) -> str:
        """One token as text (`token_id:N` without a tokenizer, as vLLM writes it)."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def room(self, prompt: list[int], max_tokens: int | None, param: str) -> int:
        """`max_tokens`, or the room left after `prompt` when it is None; 400 when the
        prompt leaves no room or `max_tokens` asks for more than is left."""
        room = self.max_model_len - len(prompt)
        if room < 1:
            raise OpenAIError(
                400,
                f"the prompt has {len(prompt)} tokens; max_model_len {self.max_model_len} "
                "leaves no room for a completion",
                param=param,
            )
        if max_tokens is not None and max_tokens > room:
            raise OpenAIError(
                400,
                f"max_tokens {max_tokens} is more than the {room} tokens left: the prompt has "
                f"{len(prompt)} of max_model_len {self.max_model_len}",
                param="max_tokens",
            )
        return room if max_tokens is None else max_tokens


SUPPORTED_FORMAT = {"type": "text"}


def _refuse_unserved(body: CompletionRequest | ChatCompletionRequest) -> None:
    """400 for what the protocol accepts but this server does not serve."""
    if body.response_format is not None and body.response_format != SUPPORTED_FORMAT:
        kind = body.response_format.get("type")
        raise OpenAIError(
            400,
            f"response_format {kind!r} is not supported; the only format is "
            '{"type": "text"} (no JSON mode or structured outputs)',
            param="response_format",
        )
    if body.best_of is not None and body.best_of != body.n:
        raise OpenAIError(
            400,
            f"best_of {body.best_of} with n {body.n} is not supported: each request "
            "generates exactly the n choices it returns (best_of may only equal n)",
            param="best_of",
        )


def _refuse_tools(body: ChatCompletionRequest) -> None:
    """400 for tool calling, which this server does not do (a `tool` message, the answer of
    a call made elsewhere, is rendered like any other)."""
    if body.tools:
        raise OpenAIError(
            400, "tools (function calling) are not supported by this server", param="tools"
        )
    if body.tool_choice not in (None, "none", "auto"):
        raise OpenAIError(
            400,
            f"tool_choice {body.tool_choice!r} needs tools, which this server does not support",
            param="tool_choice",
        )


@dataclass
class Usage:
    """Token counts: each prompt once, every choice's tokens."""

    prompt_tokens: int
    completion_tokens: int

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@dataclass
class Prepared:
    """An API request as engine jobs (one per prompt and choice) and their choices' text."""

    kind: str  # "completion" or "chat"
    served: ServedModel
    prompts: list[list[int]]
    jobs: list[tuple[list[int], SamplingParams]]
    choices: list[ChoiceText]
    top_logprobs: int | None
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def completion(cls, body: CompletionRequest, served: ServedModel) -> Prepared:
        served.check_model(body.model)
        _refuse_unserved(body)
        param = "prompt_ids" if body.prompt_ids is not None else "prompt"
        prompts = [p if isinstance(p, list) else served.encode(p, param) for p in body.prompts()]
        prefixes = [served.echoed(p, param) if body.echo else "" for p in prompts]
        limits = [served.room(p, body.max_tokens, param) for p in prompts]
        scored = body.logprobs if body.echo else None  # the prompt's log-probabilities too
        return cls._build(
            "completion", body, served, prompts, limits, prefixes, body.logprobs, scored
        )

    @classmethod
    def chat(cls, body: ChatCompletionRequest, served: ServedModel) -> Prepared:
        served.check_model(body.model)
        _refuse_unserved(body)
        _refuse_tools(body)
        prompt = served.chat_prompt(body)
        limit = served.room(prompt, body.completion_limit, "messages")
        top = (body.top_logprobs or 0) if body.logprobs else None
        return cls._build("chat", body, served, [prompt], [limit], [""], top)

    @classmethod
    def _build(
        cls, kind, body, served, prompts, limits, prefixes, top_logprobs, prompt_logprobs=None
    ) -> Prepared:
        jobs, choices = [], []
        for prompt, limit, prefix in zip(prompts, limits, prefixes, strict=True):
            for j in range(body.n):
                params = SamplingParams(
                    max_tokens=limit,
                    temperature=body.temperature,
                    top_p=body.top_p,
                    top_k=max(body.top_k, 0),
                    min_p=body.min_p,
                    seed=None if body.seed is None else body.seed + j,
                    stop_token_ids=tuple(body.stop_token_ids),
                    ignore_eos=body.ignore_eos,
                    min_tokens=min(body.min_tokens, limit),
                    presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty,
                    repetition_penalty=body.repetition_penalty,
                    logit_bias=body.token_bias(),
                    logprobs=top_logprobs,
                    prompt_logprobs=prompt_logprobs,
                )
                jobs.append((prompt, params))
                decoder = None if served.tokenizer is None else served.tokenizer.decoder()
                choices.append(ChoiceText(decoder, body.stop_strings(), prefix))
        return cls(kind, served, prompts, jobs, choices, top_logprobs)

    # ------------------------------------------------------------------ responses
    def usage(self) -> Usage:
        return Usage(sum(len(p) for p in self.prompts), sum(len(c.token_ids) for c in self.choices))

    def _envelope(self, chunk: bool) -> dict:
        prefix, name = OBJECTS[self.kind]
        return {
            "id": f"{prefix}-{self.id}",
            "object": f"{name}.chunk" if chunk and self.kind == "chat" else name,
            "created": self.created,
            "model": self.served.name,
        }

    def response(self) -> dict:
        """The whole response, once every choice has finished."""
        choices = []
        for index, choice in enumerate(self.choices):
            item = {"index": index, "finish_reason": choice.finish_reason}
            item["logprobs"] = self._logprobs(index, choice.token_ids, choice.logprobs, True)
            if self.kind == "completion":
                item["text"] = choice.text
            else:
                item["message"] = {"role": "assistant", "content": choice.text}
            choices.append({**item, "token_ids": choice.token_ids})  # blocktune's extension
        return {**self._envelope(False), "choices": choices, "usage": self.usage().to_dict()}

    def chunk(
        self, index: int, delta: str, logprobs: list[TokenLogprob], first: bool, usage: bool
    ) -> dict:
        """A streamed chunk: choice `index`'s new text (and its end when it has ended); with
        `usage`, the token counts so far (vLLM's `continuous_usage_stats`)."""
        choice = self.choices[index]
        item = {"index": index, "finish_reason": choice.finish_reason}
        tokens = choice.token_ids[len(choice.token_ids) - len(logprobs) :]
        item["logprobs"] = self._logprobs(index, tokens, logprobs, first) if logprobs else None
        if self.kind == "completion":
            item["text"] = delta
        else:
            item["delta"] = {"role": "assistant", "content": delta} if first else {"content": delta}
        out = {**self._envelope(True), "choices": [item]}
        if usage:
            out["usage"] = self.usage().to_dict()
        return out

    def usage_chunk(self) -> dict:
        return {**self._envelope(True), "choices": [], "usage": self.usage().to_dict()}

    def _logprobs(
        self, index: int, token_ids: list[int], logprobs: list[TokenLogprob], first: bool
    ) -> dict | None:
        """Choice `index`'s log-probabilities of `token_ids`; for a completion's `first`
        part with `echo`, the prompt's come first (the first prompt token has none)."""
        if self.top_logprobs is None:
            return None
        texts = [self.served.token_text(t) for t in token_ids]
        if self.kind == "chat":
            pairs = zip(texts, logprobs, strict=True)
            return {"content": [self._chat_logprob(text, lp) for text, lp in pairs]}
        choice = self.choices[index]
        values = [lp.logprob for lp in logprobs]
        tops = [self._top_by_text(lp) for lp in logprobs]
        at = len(choice.prefix) if first else 0
        if first and choice.prompt_logprobs:
            prompt = self.jobs[index][0]
            texts = [self.served.token_text(t) for t in prompt] + texts
            values = [None] + [lp.logprob for lp in choice.prompt_logprobs] + values
            tops = [None] + [self._top_by_text(lp) for lp in choice.prompt_logprobs] + tops
            at = 0
        offsets = []
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": texts,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _top_by_text(self, logprob: TokenLogprob) -> dict[str, float]:
        """Text -> log-probability, most likely first; tokens that read the same keep the
        likelier one."""
        top: dict[str, float] = {}
        for token_id, value in logprob.top:
            top.setdefault(self.served.token_text(token_id), value)
        return top

    def _chat_logprob(self, text: str, logprob: TokenLogprob) -> dict:
        def entry(token: str, value: float) -> dict:
            return {"token": token, "logprob": value, "bytes": list(token.encode("utf-8"))}

        top = [entry(self.served.token_text(t), v) for t, v in logprob.top]
        return {**entry(text, logprob.logprob), "top_logprobs": top}

"""The prompts file of `blocktune generate`: one JSON object a line, validated strictly."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from blocktune.tuner.serving.openai_protocol import ChatMessage

__all__ = ["PromptFileError", "PromptLine", "read_prompts"]


class PromptFileError(ValueError):
    """A prompts file that cannot be read; the message names the file, line and field."""


class PromptLine(BaseModel):
    """`{"prompt": "text"}`, `{"messages": [{"role", "content"}, ...]}` (in the model's chat
    template) or `{"prompt_ids": [...]}`, with optional sampling settings."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str | None = Field(None, min_length=1)
    prompt_ids: list[int] | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> PromptLine:
        given = [self.prompt, self.prompt_ids, self.messages]
        if sum(value is not None for value in given) != 1:
            raise ValueError("give exactly one of 'prompt', 'messages' and 'prompt_ids'")
        return self

    def token_ids(self, tokenizer) -> list[int]:
        """The prompt as token ids (`ValueError` when text needs a tokenizer there is not)."""
        if self.prompt_ids is not None:
            return self.prompt_ids
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer, and this model has none")
        if self.prompt is not None:
            return tokenizer.encode(self.prompt)
        return tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.text()} for m in self.messages]
        )


def read_prompts(path: Path) -> list[tuple[int, PromptLine]]:
    """`(line number, prompt)` for each non-blank line of a JSONL file."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise PromptFileError(f"{path}: cannot read ({error})") from None
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            prompts.append((number, PromptLine.model_validate(json.loads(line))))
        except json.JSONDecodeError as error:
            raise PromptFileError(f"{path}:{number}: invalid JSON ({error.msg})") from None
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "line"
            raise PromptFileError(f"{path}:{number}: {where}: {first['msg']}") from None
    if not prompts:
        raise PromptFileError(f"{path}: no prompts")
    return prompts

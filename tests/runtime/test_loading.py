"""Loading checkpoints saved by transformers (an implementation we did not write): Llama-3
rope scaling, Mistral, reduced precision, EOS ids, GGUF, and refusals of what the model code
does not implement."""

import copy
import json
from dataclasses import replace

import pytest
import torch

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.load_errors import ModelLoadError, UnsupportedModelError
from blocktune.runtime.loading import load_pretrained, load_weights, resolve_dtype
from blocktune.runtime.model import Llama3RopeScaling, LlamaModel, ModelConfig
from blocktune.runtime.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

SHAPE = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def save(folder, config, seed=0):
    torch.manual_seed(seed)
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    reference.save_pretrained(folder, safe_serialization=True)
    return reference


def tokens(count, seed=1):
    return torch.randint(
        0, SHAPE["vocab_size"], (count,), generator=torch.Generator().manual_seed(seed)
    )


def reference_greedy(reference, prompt, count):
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]), max_new_tokens=count, do_sample=False, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()


def engine_greedy(model, prompt, count, **params):
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=32, max_model_len=128))
    return engine.generate([prompt], SamplingParams(max_tokens=count, **params))[0]


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama3")
    config = transformers.LlamaConfig(**SHAPE, rope_scaling=LLAMA3_ROPE, eos_token_id=None)
    return save(folder, config), folder


@pytest.mark.slow
def test_llama3_rope_scaling_matches_transformers(llama3):
    reference, folder = llama3
    ours = load_weights(folder)
    assert ours.config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 32)
    ids = tokens(60)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    got = ours.forward_dense(ids)
    assert (got - expected).abs().max().item() <= 1e-4
    # The scaling matters: the same weights with plain rope give other logits.
    plain = LlamaModel(replace(ours.config, rope_scaling=None))
    plain.load_state_dict(ours.state_dict())
    assert (plain.forward_dense(ids) - expected).abs().max().item() > 1e-3
    prompt = ids[:9].tolist()
    assert engine_greedy(ours, prompt, 12).token_ids == reference_greedy(reference, prompt, 12)


def test_old_style_rope_scaling_keys_are_read():
    config = {
        "model_type": "llama",
        **SHAPE,
        "rope_theta": 500_000.0,
        "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"},
    }
    parsed = ModelConfig.from_hf_dict(config)
    assert parsed.rope_theta == 500_000.0
    assert parsed.rope_scaling.original_max_position_embeddings == 32


def test_mistral_without_sliding_window_matches_transformers(tmp_path):
    config = transformers.MistralConfig(**SHAPE, sliding_window=None)
    reference = save(tmp_path, config)
    ids = tokens(40)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    assert (load_weights(tmp_path).forward_dense(ids) - expected).abs().max().item() <= 1e-4


def test_mistral_with_sliding_window_is_refused(tmp_path):
    save(tmp_path, transformers.MistralConfig(**SHAPE, sliding_window=16))
    with pytest.raises(UnsupportedModelError, match=r"config\.json: sliding_window=16 is not"):
        load_weights(tmp_path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "qwen2"}, "model_type 'qwen2' is not supported"),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
        ({"mlp_bias": True}, "mlp_bias=true is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type 'linear'"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ],
)
def test_unimplemented_options_are_refused_naming_file_and_key(tmp_path, change, message):
    config = {"model_type": "llama", **SHAPE, **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=f"{tmp_path}/config.json: .*{message}"):
        load_weights(tmp_path)


def test_unknown_model_type_saved_by_transformers_is_refused(tmp_path):
    save(tmp_path, transformers.Qwen2Config(**SHAPE))
    with pytest.raises(UnsupportedModelError, match="model_type 'qwen2'"):
        load_pretrained(tmp_path)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    return save(folder, transformers.LlamaConfig(**SHAPE, eos_token_id=None)), folder


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_loads_and_matches_transformers(llama, dtype):
    reference, folder = llama
    ours = load_weights(folder, dtype=str(dtype).removeprefix("torch."))
    assert {p.dtype for p in ours.parameters()} == {dtype}
    ids = tokens(40)
    with torch.no_grad():
        full = reference(ids[None]).logits[0]
        low = copy.deepcopy(reference).to(dtype)(ids[None]).logits[0].float()
    got = ours.forward_dense(ids)
    scale = full.abs().max().item()
    # Rounding to 8 (bf16) or 11 (fp16) mantissa bits: close to both, not bit-equal to fp32.
    tolerance = 0.02 if dtype == torch.bfloat16 else 0.003
    assert (got - low).abs().max().item() <= tolerance * scale
    assert 0 < (got - full).abs().max().item() <= tolerance * scale


def test_dtype_names_are_checked():
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ModelLoadError, match="dtype 'int8' is not supported"):
        resolve_dtype("int8", "cpu")
    with pytest.raises(ModelLoadError, match="not supported"):
        resolve_dtype(torch.float64, "cpu")


@pytest.mark.parametrize("load", [load_pretrained, load_weights])
def test_a_source_that_is_no_known_model_nor_path_names_the_known_ones(tmp_path, load):
    """`smollm3` is no model blocktune knows and no file here: the error says which names
    it knows and what a path must hold, not that smollm3/config.json is missing."""
    with pytest.raises(ModelLoadError) as refused:
        load("smollm3")
    message = str(refused.value)
    assert message.startswith("model 'smollm3' is neither a known model (tiny-random, smollm2)")
    assert "config.json, *.safetensors" in message and ".gguf" in message
    empty = tmp_path / "empty"
    empty.mkdir()  # a folder that exists is read as one
    with pytest.raises(ModelLoadError, match="config.json: not found"):
        load(empty)


def test_max_model_len_defaults_to_max_position_embeddings(llama):
    _, folder = llama
    loaded = load_pretrained(folder)
    assert loaded.max_position_embeddings == 256
    assert loaded.tokenizer is None and loaded.chat_template is None
    engine = Engine(loaded.model, EngineConfig(block_size=8, num_blocks=64))
    assert engine.config.max_model_len == 256
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 256"):
        Engine(loaded.model, EngineConfig(block_size=8, num_blocks=64, max_model_len=512))


def test_generation_stops_at_eos_like_transformers(tmp_path):
    prompt = [5, 17, 99, 3, 150]
    reference = save(tmp_path, transformers.LlamaConfig(**SHAPE, eos_token_id=None))
    greedy = reference_greedy(reference, prompt, 12)
    # An EOS the model emits a few tokens in (from generation_config.json), one it never does
    # (config.json).
    eos = next(t for i, t in enumerate(greedy) if i >= 3 and t not in greedy[:i])
    never = next(t for t in range(SHAPE["vocab_size"]) if t not in greedy)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": never}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, never]}))
    loaded = load_pretrained(tmp_path)
    assert loaded.eos_token_ids == (never, eos)
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=[never, eos]
        )[0, len(prompt) :].tolist()
    assert expected[-1] == eos and len(expected) < 12
    stopped = engine_greedy(loaded.model, prompt, 12)
    assert (stopped.token_ids, stopped.finish_reason) == (expected, "stop")
    ignored = engine_greedy(loaded.model, prompt, 12, ignore_eos=True)
    assert (ignored.token_ids, ignored.finish_reason) == (greedy, "length")


def write_gguf(path, reference):
    """The reference's weights as llama.cpp lays them out (q/k rows pair-interleaved)."""
    gguf = pytest.importorskip("gguf")
    c = reference.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(10_000.0)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_eos_token_id(7)
    parts = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    for name, weight in reference.state_dict().items():
        stem = name.removesuffix(".weight")
        if stem.startswith("model.layers."):
            layer, part = stem.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{parts[part]}"
        else:
            gguf_name = top[stem]
        if gguf_name.endswith(("attn_q", "attn_k")):
            heads = c.num_attention_heads if gguf_name.endswith("q") else c.num_key_value_heads
            pairs = weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1)
            weight = pairs.transpose(1, 2).reshape(weight.shape)
        writer.add_tensor(f"{gguf_name}.weight", weight.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_weights_match_the_checkpoint(llama, tmp_path):
    reference, _ = llama
    path = tmp_path / "tiny.gguf"
    write_gguf(path, reference)
    ours = load_weights(path)
    assert ours.config.eos_token_ids == (7,)
    assert ours.config.max_position_embeddings == 256 and not ours.config.tie_word_embeddings
    ids = tokens(40)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    assert (ours.forward_dense(ids) - expected).abs().max().item() <= 1e-4


def test_gguf_of_another_architecture_is_refused(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"other\.gguf: general\.architecture 'qwen2'"):
        load_weights(path)

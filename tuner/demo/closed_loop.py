"""The closed loop end to end: a worker, a sidecar, traffic whose lengths shift, live swaps.

`run_closed_loop` starts `blocktune worker` and `blocktune serve` as two
processes on loopback, drives a compressed customer-service day through the
worker (daytime mix, then a promotion burst of short queries, then the daytime
mix again), prints one line per sidecar interval, and finally serves every
prompt again on an in-process engine that never swaps, to show that the
swaps changed no generated token. With a real model (`smollm2`) the traffic
is customer-service chat through `/v1/chat/completions` and a few of the
exchanges are printed; `tiny-random` sends token-id prompts to
`/v1/completions`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
import torch
import yaml

from blocktune.runtime.engine import Engine
from blocktune.runtime.loading import TINY_RANDOM, load_pretrained, resolve_source
from blocktune.runtime.sampling import SamplingParams
from blocktune.runtime.tokenizer import Tokenizer
from blocktune.traces.synth import Phase, customer_service_day
from blocktune.tuner.config.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_POLICY
from blocktune.tuner.config.engine_settings import engine_settings
from blocktune.tuner.config.policy import policy_path
from blocktune.tuner.demo.demo_chat import chat_messages
from blocktune.tuner.operations import NotReady, free_port, wait_until_ready

__all__ = ["ClosedLoopReport", "demo_policy", "demo_workload", "run_closed_loop"]

TOKEN_ENV = "BLOCKTUNE_DEMO_TOKEN"
EXCHANGES = 4  # real exchanges printed after a chat run
TRAFFIC_THREADS = 48
"""Client threads sending the demo's requests (each waits for its whole completion)."""
VERIFY_KV_BYTES = 256 * 2**20
VERIFY_ROWS = 32
"""The pool and batch rows of the engine that serves every prompt again, never swapping."""


def demo_workload(
    seed: int, duration_s: float, rate_per_s: float, tokenizer: Tokenizer | None = None
) -> pd.DataFrame:
    """Daytime mix -> promotion burst -> daytime mix, each a third of `duration_s`.

    Without a tokenizer, `prompt_ids` are seeded random token ids of each
    prompt's length, and a few 400-token documents come with the daytime mix.
    With one, every request is a customer-service chat (`messages`) whose
    `prompt_ids` are its chat template; `output_tokens` is its max_tokens.
    """

    def daytime(start_h: float, end_h: float) -> list[Phase]:
        mix = [Phase("day", start_h, end_h, rate_per_s, (60, 90), (20, 60))]
        if tokenizer is None:
            mix.append(Phase("document", start_h, end_h, rate_per_s / 25, (400, 460), (50, 60)))
        return mix

    promo = Phase("promo", 8.0, 16.0, 3 * rate_per_s, (15, 25), (8, 24))
    phases = (*daytime(0.0, 8.0), promo, *daytime(16.0, 24.0))
    # The phases' rates are per second of a 24-hour day; compress it into duration_s.
    day = customer_service_day(
        seed, duration_s=duration_s, rate_scale=duration_s / 86_400.0, phases=phases
    )
    rng = np.random.default_rng(seed + 1)
    if tokenizer is None:
        day["prompt_ids"] = [rng.integers(0, 256, n).tolist() for n in day.prompt_tokens]
        return day
    day["messages"] = [chat_messages(phase, rng) for phase in day.phase]
    day["prompt_ids"] = [tokenizer.apply_chat_template(m) for m in day.messages]
    day["prompt_tokens"] = [len(ids) for ids in day.prompt_ids]
    return day


def demo_policy(worker_url: str, interval_s: float, window: dict | None = None) -> dict:
    """The default policy, deciding every `interval_s` over a short `window` (capacity and
    min_samples; 60 and 20 by default) and enforcing its choice on the worker through
    the HTTP actuator."""
    policy = yaml.safe_load(policy_path(DEFAULT_POLICY).read_text(encoding="utf-8"))
    policy.update(
        {
            "deployment": "closed-loop-demo",
            "interval": f"{interval_s:g}s",
            "min_dwell": f"{2 * interval_s:g}s",
            "window": window or {"capacity": 60, "min_samples": 20},
            # A KV budget the promotion burst fills, so that there the block size matters.
            "kv_budget": "64MiB",
            "mode": "enforce",
            "auth": {"token_env": TOKEN_ENV},
            "actuator": {"kind": "http", "url": worker_url, "token_env": TOKEN_ENV},
        }
    )
    return policy


@contextlib.contextmanager
def _process(args: list[str], env: dict, log_path: Path) -> Iterator[subprocess.Popen]:
    with open(log_path, "w") as log:
        process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def _wait_healthy(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    try:
        wait_until_ready(url, process, timeout_s=timeout_s)
    except NotReady as error:
        raise RuntimeError(f"{error}; see {log_path}:\n{log_path.read_text()}") from None


@dataclass
class ClosedLoopReport:
    """What the demo did: completions, swaps, timeline and the verification."""

    requests: int = 0
    failed: int = 0
    completions: dict[int, list[int]] = field(default_factory=dict)
    texts: dict[int, str] = field(default_factory=dict)
    traffic_s: float = 0.0
    swaps: list[dict] = field(default_factory=list)
    timeline: list[dict] = field(default_factory=list)
    identical: int = 0
    verified: int = 0
    restart: dict | None = None
    idle_blocks_used: int | None = None

    @property
    def swaps_done(self) -> int:
        return sum(s["status"] == "done" for s in self.swaps)

    @property
    def tokens_per_s(self) -> float:
        """Tokens generated per second of traffic."""
        generated = sum(map(len, self.completions.values()))
        return generated / self.traffic_s if self.traffic_s else 0.0

    @property
    def ok(self) -> bool:
        return self.failed == 0 and self.verified == self.identical == self.requests


def _send(client: httpx.Client, url: str, row: pd.Series) -> tuple[list[int], str]:
    """One greedy request: a chat when the row has messages, else a token-id completion;
    its token ids and text."""
    body = {"max_tokens": int(row.output_tokens), "temperature": 0}
    if "messages" in row:
        path, body = "chat/completions", {**body, "messages": row.messages}
    else:
        path, body = "completions", {**body, "prompt_ids": row.prompt_ids}
    response = client.post(f"{url}/v1/{path}", json=body)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return choice["token_ids"], text


def _drive(url: str, workload: pd.DataFrame, report: ClosedLoopReport) -> threading.Thread:
    """Send every request at its arrival time (from now) on a pool of client threads, which
    share one HTTP client (a new one per request costs ~35 ms of CPU beside the worker)."""

    def run() -> None:
        start = time.monotonic()
        limits = httpx.Limits(
            max_connections=TRAFFIC_THREADS, max_keepalive_connections=TRAFFIC_THREADS
        )
        with (
            httpx.Client(timeout=300, limits=limits) as client,
            concurrent.futures.ThreadPoolExecutor(max_workers=TRAFFIC_THREADS) as pool,
        ):
            futures = {}
            for index, row in workload.iterrows():
                delay = row.arrival_s - (time.monotonic() - start)
                if delay > 0:
                    time.sleep(delay)
                futures[pool.submit(_send, client, url, row)] = index
            for future in concurrent.futures.as_completed(futures):
                try:
                    index = futures[future]
                    report.completions[index], report.texts[index] = future.result()
                except httpx.HTTPError:
                    report.failed += 1
        report.traffic_s = time.monotonic() - start

    thread = threading.Thread(target=run, name="demo-traffic", daemon=True)
    thread.start()
    return thread


def _live_line(
    elapsed: float, workload: pd.DataFrame, worker_url: str, sidecar_url: str, seen: int
) -> tuple[str, dict, list[dict]]:
    state = httpx.get(f"{worker_url}/admin/state", timeout=60).json()
    recommendation = httpx.get(f"{sidecar_url}/v1/recommendation", timeout=60).json()
    window = httpx.get(f"{sidecar_url}/v1/window", timeout=60).json()
    # The worker keeps only its latest swaps: count the new ones from its totals.
    total = sum(state[f"swaps_{status}"] for status in ("done", "rejected", "rolled_back"))
    new_swaps = state["swap_history"][len(state["swap_history"]) - (total - seen) :]
    recent = workload[(workload.arrival_s > elapsed - 5) & (workload.arrival_s <= elapsed)]
    median = window["total_tokens"]["median"] if window["count"] else None
    swap_text = "-"
    if new_swaps:
        last = new_swaps[-1]
        swap_text = (
            f"{last['old_block_size']}->{last['new_block_size']} {last['status']}, "
            f"{last['bytes_moved']} B moved, pause {last['pause_s'] * 1e3:.2f} ms"
        )
    point = {
        "t_s": round(elapsed, 1),
        "rate_per_s": len(recent) / 5,
        "median_len": median,
        "recommended": recommendation.get("recommended_block_size"),
        "reason": recommendation.get("reason"),
        "gain_interval": (
            recommendation.get("gain_interval")
            if any("capacity_interval" in c for c in recommendation.get("candidates", []))
            else None  # no forecast compared two sizes: the reason says why
        ),
        "block_size": state["block_size"],
        "blocks_used": state["blocks_used"],
    }
    line = (
        f"{elapsed:6.1f}s  {point['rate_per_s']:5.1f} req/s  "
        f"window median len {'-' if median is None else f'{median:.0f}':>5}  "
        f"recommend {point['recommended']!s:>4}  block size {state['block_size']:>3}  "
        f"blocks used {state['blocks_used']:>4}  swap {swap_text}"
    )
    interval = point["gain_interval"]
    if point["reason"] is not None:
        gain = (
            ""
            if interval is None
            else f"gain {interval[0]:+.1%} to {interval[1]:+.1%} over the resamples; "
        )
        line += f"\n         last decision: {gain}{point['reason']}"
    return line, point, new_swaps


@dataclass(frozen=True)
class _Services:
    """The worker and sidecar processes of one run, their URLs, arguments and folder."""

    folder: Path
    env: dict
    worker_url: str
    sidecar_url: str
    worker_args: list[str]
    sidecar_args: list[str]


def _services(
    folder: Path, model: str, seed: int, kv_bytes: str | None, interval_s: float
) -> _Services:
    token = secrets.token_urlsafe(24)
    # One intra-op thread per process: three processes share a small machine, often with
    # other work, and a second thread waiting for a core slows every matmul several-fold
    # (42x576x1536 in fp32: 5.5 ms with two threads, 0.9 ms with one, on a loaded 2-core CPU).
    env = {**os.environ, TOKEN_ENV: token, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    worker_url = f"http://127.0.0.1:{free_port()}"
    sidecar_url = f"http://127.0.0.1:{free_port()}"
    cli = [sys.executable, "-m", "blocktune.tuner.cli"]
    policy = folder / "policy.yaml"
    # A real model's answers are shorter and slower to come: a smaller window follows the
    # shift with fewer requests.
    window = None if model == TINY_RANDOM else {"capacity": 30, "min_samples": 15}
    policy.write_text(yaml.safe_dump(demo_policy(worker_url, interval_s, window)))
    # The worker reads its engine settings (pool, starting size, candidates, batch limits and
    # prefix cache: those the sidecar simulates) and token variable from the sidecar's
    # policy; `kv_bytes` overrides the pool where the demo's model is not the one the policy
    # prices.
    worker_args = [
        *cli, "worker", "--model", model, "--port", worker_url.rsplit(":", 1)[1],
        "--seed", str(seed), "--policy", str(policy),
        "--sidecar", sidecar_url, "--sidecar-token-env", TOKEN_ENV,
    ]  # fmt: skip
    if kv_bytes is not None:
        worker_args += ["--kv-bytes", kv_bytes]
    sidecar_args = [
        *cli, "serve", "--policy", str(policy), "--port", sidecar_url.rsplit(":", 1)[1],
        "--state-file", str(folder / "sidecar-state.json"),
    ]  # fmt: skip
    return _Services(folder, env, worker_url, sidecar_url, worker_args, sidecar_args)


def run_closed_loop(
    *,
    model: str = TINY_RANDOM,
    duration_s: float = 60.0,
    interval_s: float = 4.0,
    rate_per_s: float = 2.0,
    seed: int = 0,
    kv_bytes: str | None = None,
    restart_sidecar_at_s: float | None = None,
    out=print,
) -> ClosedLoopReport:
    """Run the demo; returns its report (`report.ok` is the verification's verdict).

    The worker's KV pool is the demo policy's `kv_budget` unless `kv_bytes` overrides it.

    With `restart_sidecar_at_s`, the sidecar is stopped (SIGTERM) at that time and
    started again on the same state file while traffic continues.
    """
    resolve_source(model)  # a missing model fails here, before any process starts
    with tempfile.TemporaryDirectory(prefix="blocktune-demo-") as folder:
        services = _services(Path(folder), model, seed, kv_bytes, interval_s)
        with contextlib.ExitStack() as stack:
            log = services.folder / "worker.log"
            worker = stack.enter_context(_process(services.worker_args, services.env, log))
            sidecar = stack.enter_context(
                _process(services.sidecar_args, services.env, services.folder / "sidecar.log")
            )
            loaded = load_pretrained(model, seed=seed)  # while the worker loads its own copy
            chat = None if model == TINY_RANDOM else loaded.tokenizer
            workload = demo_workload(seed, duration_s, rate_per_s, chat)
            report = ClosedLoopReport(requests=len(workload))
            out(
                f"closed loop: {len(workload)} requests over {duration_s:.0f} s (daytime mix -> "
                f"promotion burst -> daytime mix), sidecar deciding every {interval_s:g} s"
            )
            _wait_healthy(services.worker_url, worker, log, 300)
            _wait_healthy(services.sidecar_url, sidecar, services.folder / "sidecar.log", 60)
            kind = "chat through /v1/chat/completions" if chat else "token ids"
            out(f"worker {services.worker_url} ({model}, {kind}), sidecar {services.sidecar_url}")
            _serve_traffic(
                services, stack, sidecar, workload, report, interval_s, restart_sidecar_at_s, out
            )
    out(
        f"done: {len(report.completions)} completions, {report.failed} failed, "
        f"{report.tokens_per_s:.1f} tokens/s, "
        f"{report.swaps_done} swaps ({', '.join(_swap_text(s) for s in report.swaps) or 'none'}), "
        f"{report.idle_blocks_used} blocks in use when idle"
    )
    if chat is not None:
        _print_exchanges(workload, report, out)
    _verify(workload, report, loaded, out)
    return report


def _serve_traffic(
    services: _Services,
    stack: contextlib.ExitStack,
    sidecar: subprocess.Popen,
    workload: pd.DataFrame,
    report: ClosedLoopReport,
    interval_s: float,
    restart_sidecar_at_s: float | None,
    out,
) -> None:
    """Drive the workload, print a line per interval (restarting the sidecar once if asked,
    growing the blocks by hand at five sixths of the traffic) and record the swaps and the
    blocks in use when idle."""
    start, grown = time.monotonic(), False
    grow_at_s = workload.arrival_s.max() * 5 / 6
    traffic = _drive(services.worker_url, workload, report)
    while traffic.is_alive():
        traffic.join(timeout=interval_s)
        elapsed = time.monotonic() - start
        if restart_sidecar_at_s is not None and elapsed >= restart_sidecar_at_s:
            restart_sidecar_at_s = None
            sidecar = _restart_sidecar(services, stack, sidecar, report)
            out(
                f"sidecar restarted: window held {report.restart['before']} requests before, "
                f"{report.restart['after']} after restoring its state file"
            )
        if not grown and elapsed >= grow_at_s:
            grown = True
            out(_operator_grow(services.worker_url, services.env[TOKEN_ENV]))
        line, point, new = _live_line(
            elapsed, workload, services.worker_url, services.sidecar_url, len(report.swaps)
        )
        report.timeline.append(point)
        report.swaps.extend(new)
        out(line)
    state = httpx.get(f"{services.worker_url}/admin/state", timeout=60).json()
    report.idle_blocks_used = state["blocks_used"]


def _restart_sidecar(
    services: _Services,
    stack: contextlib.ExitStack,
    sidecar: subprocess.Popen,
    report: ClosedLoopReport,
) -> subprocess.Popen:
    before = _window_count(services.sidecar_url)
    sidecar.send_signal(signal.SIGTERM)
    sidecar.wait(timeout=15)
    log = services.folder / "sidecar-restarted.log"
    sidecar = stack.enter_context(_process(services.sidecar_args, services.env, log))
    _wait_healthy(services.sidecar_url, sidecar, log, 60)
    report.restart = {"before": before, "after": _window_count(services.sidecar_url)}
    return sidecar


def _print_exchanges(workload: pd.DataFrame, report: ClosedLoopReport, out) -> None:
    """A few questions and the model's answers, from both phases."""
    shown = 0
    for phase in ("day", "promo"):
        rows = [i for i in workload.index[workload.phase == phase] if i in report.texts]
        for index in rows[: EXCHANGES // 2]:
            question = workload.messages[index][-1]["content"]
            answer = " ".join(report.texts[index].split())
            out(f"  [{phase}] Q: {question}")
            out(f"          A: {answer[:200]}{' ...' if len(answer) > 200 else ''}")
            shown += 1
    if not shown:
        out("  (no exchange completed)")


def _verify(workload: pd.DataFrame, report: ClosedLoopReport, loaded, out) -> None:
    """Count the completions identical to an engine that never swaps."""
    out("verifying every completion against an engine that never swaps ...")
    settings = engine_settings(None, kv_bytes=VERIFY_KV_BYTES, max_num_seqs=VERIFY_ROWS)
    engine = Engine(loaded.model, settings.engine_config())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the worker ran (see _services)
    try:
        expected = engine.generate(
            list(workload.prompt_ids),
            [SamplingParams(max_tokens=int(n)) for n in workload.output_tokens],
        )
    finally:
        torch.set_num_threads(threads)
    for index, output in enumerate(expected):
        if index in report.completions:
            report.verified += 1
            report.identical += report.completions[index] == output.token_ids
    out(f"{report.identical}/{report.requests} completions identical to the run without swaps")


def _operator_grow(worker_url: str, token: str) -> str:
    """Swap the worker back to the default size by hand, with requests in flight: the
    sidecar's forecast keeps B=8 for this traffic (8 serves it at least as well), so the
    demo grows the blocks itself to show a live grow keeps every token too."""
    response = httpx.post(
        f"{worker_url}/admin/block-size",
        json={"block_size": DEFAULT_BLOCK_SIZE},
        headers={"Authorization": f"Bearer {token}"},
        timeout=120,
    )
    result = response.json()
    return (
        f"operator: POST /admin/block-size {DEFAULT_BLOCK_SIZE} (a live grow, requests in "
        f"flight): {result.get('status')}; the sidecar may shrink again where 8 serves better"
    )


def _window_count(sidecar_url: str) -> int:
    window = httpx.get(f"{sidecar_url}/v1/window", timeout=60).json()
    return int(window["count"])


def _swap_text(swap: dict) -> str:
    return f"{swap['old_block_size']}->{swap['new_block_size']} {swap['status']}"

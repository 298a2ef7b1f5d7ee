"""`blocktune calibrate --engine vllm`: a vLLM server's steps timed from its streamed tokens.

For each block size of the grid, one vLLM server is started (`VllmServer`) and
sent, for every point of `batch_sizes x context_lens`, a batch of that many
concurrent streaming completions whose prompts are that many random token ids
(no two share a prefix block), each generating `decode_tokens` tokens with EOS
ignored. The client stamps each streamed chunk's arrival with `time.monotonic`
and counts its tokens (vLLM's `return_token_ids`). Two kinds of timed steps
come out of a batch (`TimedStep`, the simulator's features):

- its prefill: from sending the batch to the median request's first token,
  one step that admits the batch's prompts (only batches whose prompt tokens
  fit vLLM's `max_num_batched_tokens`, which prefill in one step);
- its decode: the tokens after the first in segments of `SEGMENT_TOKENS`; a
  segment's step time is the median over the batch of its duration over its
  tokens, its features those of the segment's middle step (each request then
  holds its prompt and the tokens before that step).

`fit_steps` fits `STEP_FORM` to all of them jointly across block sizes. One
server runs at a time, so the sizes are timed one after the other, and a load
that changes between them can pass for a block-size effect (a per-size term
counts only beyond `SIGNIFICANCE_SE` standard errors; the residuals tell how
steady the machine was). The
calibration names the device as vLLM's platform with the vLLM version and
attention backend; its kernel, host and bandwidth sections are the analytic
model's (vLLM's kernels are not timed one by one; sizes beyond the analytic
model's take its largest size's), and its engine section,
which prices every step the simulator takes, is vLLM's as measured.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np

from blocktune.tuner.config.calibration import (
    STEP_FORM,
    Calibration,
    Provenance,
    analytic_calibration,
    prefill_pairs,
)
from blocktune.tuner.config.policy import ModelShape
from blocktune.tuner.measure.step_fit import TimedStep, fit_steps
from blocktune.tuner.measure.vllm_server import VllmServer, interpreter_torch_version

__all__ = [
    "DEFAULT_MAX_BATCHED_TOKENS",
    "SEGMENT_TOKENS",
    "StreamedRequest",
    "VllmClient",
    "VllmGrid",
    "default_vllm_grid",
    "hf_model_shape",
    "measure_vllm_calibration",
    "timed_steps",
]

SEGMENT_TOKENS = 8
"""Decode tokens per timed segment: enough that one late chunk moves a segment's mean little."""
DEFAULT_MAX_BATCHED_TOKENS = 2048
"""vLLM's online-serving default of prompt tokens per step: larger batches prefill in chunks."""
REQUEST_TIMEOUT_S = 600.0
TOKEN_ID_LOW = 100
"""Random prompt token ids start here (above the special tokens of common vocabularies)."""


@dataclass(frozen=True)
class VllmGrid:
    """What `calibrate --engine vllm` times: per block size, one batch of each batch size at
    each context length (its prompts' tokens), each request decoding `decode_tokens`."""

    block_sizes: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    context_lens: tuple[int, ...]
    decode_tokens: int
    max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS

    def __post_init__(self) -> None:
        if self.decode_tokens < 1 + SEGMENT_TOKENS:
            raise ValueError(
                f"decode_tokens must be at least {1 + SEGMENT_TOKENS} (the first token and "
                f"one segment of {SEGMENT_TOKENS}), got {self.decode_tokens}"
            )

    @property
    def longest(self) -> int:
        return max(self.context_lens) + self.decode_tokens


def default_vllm_grid(*, quick: bool, block_sizes: tuple[int, ...]) -> VllmGrid:
    """The default grid: a few minutes per block size on a small CPU (quick: seconds)."""
    if quick:
        return VllmGrid(block_sizes, (1, 4), (32, 256), decode_tokens=1 + 2 * SEGMENT_TOKENS)
    return VllmGrid(block_sizes, (1, 4, 16), (64, 512, 1024), decode_tokens=1 + 3 * SEGMENT_TOKENS)


def hf_model_shape(folder: Path, name: str, dtype: str) -> ModelShape:
    """The model's shape from a Hugging Face folder's config.json, as a calibration records
    it; `ValueError` naming the file and the missing key."""
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: cannot read the model's config ({error})") from error
    try:
        heads = config["num_attention_heads"]
        return ModelShape(
            name=name,
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=config["vocab_size"],
            dtype=dtype,
        )
    except KeyError as error:
        raise ValueError(f"{path}: no {error.args[0]!r}") from error


@dataclass(frozen=True)
class StreamedRequest:
    """One streamed completion: when it was sent and when each token arrived [monotonic s]."""

    sent_s: float
    token_s: tuple[float, ...]

    @property
    def first_token_s(self) -> float:
        return self.token_s[0]

    @property
    def finish_s(self) -> float:
        return self.token_s[-1]


class VllmClient:
    """Streaming completions of exact prompt lengths (random token ids) on one server."""

    def __init__(self, url: str, vocab_size: int, *, seed: int = 0) -> None:
        self.url = url
        # every request of a batch or a replay streams at once: no pool limit delays one
        self._http = httpx.Client(
            timeout=REQUEST_TIMEOUT_S, limits=httpx.Limits(max_connections=None)
        )
        self._rng = np.random.default_rng(seed)
        self._vocab = vocab_size
        models = self._http.get(f"{url}/v1/models")
        models.raise_for_status()
        self.model = models.json()["data"][0]["id"]

    def version(self) -> str:
        """The server's vLLM version (its `/version`), or "unknown"."""
        try:
            return str(self._http.get(f"{self.url}/version").json()["version"])
        except (httpx.HTTPError, ValueError, KeyError):
            return "unknown"

    def prompt(self, tokens: int) -> list[int]:
        return self._rng.integers(TOKEN_ID_LOW, self._vocab, tokens).tolist()

    def stream(
        self, prompt: list[int], max_tokens: int, *, at_s: float | None = None
    ) -> StreamedRequest:
        """Send one completion (at monotonic time `at_s`, else now) and stamp its tokens."""
        if at_s is not None:
            time.sleep(max(0.0, at_s - time.monotonic()))
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
        }
        sent = time.monotonic()
        stamps: list[float] = []
        with self._http.stream("POST", f"{self.url}/v1/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic()
                for choice in json.loads(line[6:]).get("choices", []):
                    count = len(choice["token_ids"]) if "token_ids" in choice else 1
                    stamps += [now] * count
        if not stamps:
            raise ValueError(f"{self.url} streamed no tokens for a {len(prompt)}-token prompt")
        return StreamedRequest(sent, tuple(stamps))

    def batch(self, batch_size: int, prompt_tokens: int, max_tokens: int) -> list[StreamedRequest]:
        """`batch_size` concurrent streams of `prompt_tokens`-token prompts."""
        prompts = [self.prompt(prompt_tokens) for _ in range(batch_size)]
        with ThreadPoolExecutor(batch_size) as pool:
            return list(pool.map(lambda p: self.stream(p, max_tokens), prompts))

    def close(self) -> None:
        self._http.close()


def timed_steps(
    block_size: int,
    prompt_tokens: int,
    requests: list[StreamedRequest],
    *,
    max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS,
) -> list[TimedStep]:
    """The steps one batch of equal requests timed (module doc): its prefill, when its
    prompts fit one step, and its decode segments."""
    n = len(requests)
    steps = []
    if n * prompt_tokens <= max_batched_tokens:
        sent = min(r.sent_s for r in requests)
        seconds = statistics.median(r.first_token_s for r in requests) - sent
        steps.append(
            TimedStep(
                block_size,
                n,
                n * prompt_tokens,
                n * math.ceil(prompt_tokens / block_size),
                n * prompt_tokens,
                seconds,
                padded_tokens=0,
                prefill_pairs=n * prefill_pairs(0, prompt_tokens),
                prompt_chunks=n,
            )
        )
    tokens = min(len(r.token_s) for r in requests)
    for start in range(1, tokens - SEGMENT_TOKENS + 1, SEGMENT_TOKENS):
        end = start + SEGMENT_TOKENS  # the segment's tokens are start..end-1 (0-based)
        seconds = statistics.median(
            (r.token_s[end - 1] - r.token_s[start - 1]) / SEGMENT_TOKENS for r in requests
        )
        # the step that computes token k (0-based) holds the prompt and the k tokens before
        held = [prompt_tokens + k for k in range(start, end)]
        middle = held[len(held) // 2]
        blocks = statistics.mean(math.ceil(h / block_size) for h in held)
        steps.append(
            TimedStep(
                block_size,
                n,
                n * middle,
                round(n * blocks),
                0,
                seconds,
                padded_tokens=n * middle,
            )
        )
    # a segment whose tokens all came in one chunk timed nothing
    return [s for s in steps if s.seconds > 0]


def measure_vllm_calibration(
    template: str,
    model: ModelShape,
    grid: VllmGrid,
    log_folder: Path,
    *,
    start_timeout_s: float,
    env: dict[str, str] | None = None,
    seed: int = 0,
    progress: Callable[[str], None] = lambda _: None,
) -> Calibration:
    """Time `grid` on vLLM servers started from `template` (one per block size) and fit the
    step form (module doc). Raises `VllmStartError` when a server does not come up."""
    steps: list[TimedStep] = []
    engine_info: tuple[str | None, str | None, str] | None = None  # the first server's
    torch_version = None
    for block_size in grid.block_sizes:
        progress(f"B={block_size}: starting vLLM")
        began = time.monotonic()
        log_file = log_folder / f"vllm-b{block_size}.log"
        with VllmServer(
            template, block_size, log_file, start_timeout_s=start_timeout_s, env=env
        ) as server:
            progress(f"B={block_size}: healthy after {time.monotonic() - began:.1f} s")
            torch_version = torch_version or interpreter_torch_version(server.argv)
            client = VllmClient(server.url, model.vocab_size, seed=seed + block_size)
            try:
                client.batch(1, min(grid.context_lens), grid.decode_tokens)  # warm-up
                for batch_size in grid.batch_sizes:
                    for context in grid.context_lens:
                        requests = client.batch(batch_size, context, grid.decode_tokens)
                        steps += timed_steps(
                            block_size,
                            context,
                            requests,
                            max_batched_tokens=grid.max_batched_tokens,
                        )
                progress(f"B={block_size}: {len(steps)} timed steps so far")
                engine_info = engine_info or (*server.engine_info(), client.version())
            finally:
                client.close()
    fit = fit_steps(steps)
    platform, backend, version = engine_info
    backend_name = f"vLLM {version}" + ("" if backend is None else f", {backend}")
    device = f"{platform or 'unknown platform'} ({backend_name})"
    provenance = Provenance(
        kind="measured",
        device=device,
        date=datetime.now(timezone.utc).replace(microsecond=0),
        torch=torch_version or "unknown (the server's interpreter did not say)",
        backend=backend_name,
        grid={k: list(v) if isinstance(v, tuple) else v for k, v in asdict(grid).items()},
        notes=(
            "engine steps of a vLLM server timed by `blocktune calibrate --engine vllm` from "
            "its streamed tokens' arrival times (prefill: send to first token; decode: "
            f"segments of {SEGMENT_TOKENS} tokens), one server start per block size; fitted "
            f"jointly by non-negative least squares of the relative error: {STEP_FORM}. The "
            "kernel, host and bandwidth sections are the analytic model's."
        ),
    )
    engine = fit.engine_calibration(
        provenance,
        model,
        threads=len(os.sched_getaffinity(0)),  # vLLM's CPU build runs on every core it may
    )
    base = analytic_calibration()
    largest = max(base.kernel)
    return Calibration(
        provenance=provenance,
        kernel_shape=base.kernel_shape,
        memory_bandwidth_bytes_per_s=base.memory_bandwidth_bytes_per_s,
        compute_flops_per_s=base.compute_flops_per_s,
        copy_bandwidth_bytes_per_s=base.copy_bandwidth_bytes_per_s,
        kernel={b: base.kernel.get(b, base.kernel[largest]) for b in grid.block_sizes},
        host_s_per_token={
            b: base.host_s_per_token.get(b, base.host_s_per_token[largest])
            for b in grid.block_sizes
        },
        engine=engine,
    )

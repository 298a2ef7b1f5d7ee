"""The engine: requests in, one step at a time, tokens and finished requests out.

`Engine` holds the KV pool, a `Scheduler` (the queues, the blocks and the block
table) and a `ModelRunner` (the model and the sampler). Every `step()` applies
the block-size swaps asked for since the last one, schedules (grow the
decodes, chunk the prefills), runs the batch through the model, and takes the
sampled tokens: each is appended to its request, a request that meets a stop
token, its `max_tokens` or `max_model_len` finishes, and the step returns each
request's new tokens as `RequestOutput`s. A request whose sampling or update
raises ends alone, with `finish_reason` "error", and frees its blocks; the
other requests of the step go on as they would without it.

Finished requests free their blocks at once and are reported to listeners
(`add_listener`) as `FinishedRequest` records, which is what the tuner's length
window observes. A block-size swap (`request_block_size`, from any thread) is
planned and prepared against the scheduler's block manager and table
(`runtime.hot_swap`), and committed by installing the new pair in the scheduler.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from blocktune.kernels.cpu_attention import default_backend
from blocktune.runtime.block_manager import BlockManager
from blocktune.runtime.block_table import BlockTable
from blocktune.runtime.config import EngineConfig
from blocktune.runtime.hot_swap import (
    SwapRejected,
    SwapResult,
    SwapTicket,
    prepare_swap,
    write_staged,
)
from blocktune.runtime.kv_cache import KVCache, slots_for_budget
from blocktune.runtime.model import LlamaModel
from blocktune.runtime.requests import (
    FinishedRequest,
    Request,
    RequestError,
    RequestOutput,
)
from blocktune.runtime.runner import ModelRunner, SampledToken
from blocktune.runtime.sampling import SamplingParams
from blocktune.runtime.scheduler import Scheduler

__all__ = ["Engine"]

SWAP_HISTORY = 100  # swap results kept for introspection
log = logging.getLogger(__name__)


class Engine:
    """Serves requests step by step on a paged KV cache shared by all of them."""

    def __init__(self, model: LlamaModel, config: EngineConfig) -> None:
        if config.max_model_len is None:
            config = replace(config, max_model_len=model.config.max_position_embeddings)
        if config.attention_backend is None:
            config = replace(config, attention_backend=default_backend(model.device))
        if config.max_model_len > model.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's "
                f"max_position_embeddings {model.config.max_position_embeddings}"
            )
        self.model = model
        self.config = config
        mc = model.config
        num_slots = _pool_slots(model, config)
        self.kv = KVCache(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, num_slots, model.dtype, model.device
        )
        self.scheduler = Scheduler(config, num_slots, model.device)
        self.runner = ModelRunner(model, self.kv, config)
        self._ids = itertools.count()
        self._listeners: list[Callable[[FinishedRequest], None]] = []
        self.steps = 0
        self._swap_requests: queue.SimpleQueue[SwapTicket] = queue.SimpleQueue()
        # The latest swaps (bounded for a long-running engine) and running totals.
        self.swap_history: deque[SwapResult] = deque(maxlen=SWAP_HISTORY)
        self._swap_counts = {"done": 0, "rejected": 0, "rolled_back": 0}
        self._swap_bytes_moved = 0
        # Test seam: called with "copy" and "table" during a swap's prepare phase.
        self.swap_fault_hook: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ the scheduler's state
    @property
    def blocks(self) -> BlockManager:
        return self.scheduler.blocks

    @property
    def table(self) -> BlockTable:
        return self.scheduler.table

    @property
    def block_size(self) -> int:
        return self.scheduler.block_size

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    @property
    def prefix_hit_tokens(self) -> int:
        return self.scheduler.prefix_hit_tokens

    @property
    def peak_blocks_used(self) -> int:
        """The most blocks referenced at once during a step."""
        return self.scheduler.peak_blocks_used

    @property
    def max_request_tokens(self) -> int:
        """The most tokens, prompt and output together, that one request can reach:
        `max_model_len`, or fewer when the KV pool is smaller (its last token needs no slot)."""
        return min(self.config.max_model_len, self.kv.num_slots + 1)

    # ------------------------------------------------------------------ requests
    def add_listener(self, listener: Callable[[FinishedRequest], None]) -> None:
        """Call `listener(FinishedRequest)` for every request that finishes."""
        self._listeners.append(listener)

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. Raises `RequestError` for input it cannot serve."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        self._validate(prompt, params)
        request_id = next(self._ids)
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else torch.seed()
            generator = torch.Generator().manual_seed(seed)
        request = Request(request_id, prompt, params, time.monotonic(), generator)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = self.runner.prompt_logprobs(prompt, params.prompt_logprobs)
        self.scheduler.add(request)
        return request_id

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        limit = self.config.max_model_len
        vocab = self.model.config.vocab_size
        if not prompt:
            raise RequestError("the prompt is empty")
        if len(prompt) >= limit:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens; max_model_len {limit} leaves no room"
            )
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        problems = params.problems(vocab)
        if problems:
            raise RequestError(problems[0])
        self.scheduler.check_fits(len(prompt), params)

    def cancel(self, request_id: int) -> bool:
        """Drop a request and free its blocks now; False if it is unknown or already done."""
        return self.scheduler.remove(request_id) is not None

    def stop(self, request_id: int) -> bool:
        """End a request now as finished with reason "stop" (it met a stop string, which the
        engine does not see): its blocks are freed and listeners hear of it, as of any
        finished request. False if it is unknown or already done."""
        request = self.scheduler.remove(request_id)
        if request is None:
            return False
        self._notify(request, "stop")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[RequestOutput]:
        """Serve the prompts to completion; one final output per prompt, in order."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        ids: list[int] = []
        try:
            for prompt, prompt_params in zip(prompts, params, strict=True):
                ids.append(self.add_request(prompt, prompt_params))
        except RequestError:
            for request_id in ids:  # all or nothing: leave no earlier prompt queued
                self.cancel(request_id)
            raise
        final: dict[int, RequestOutput] = {}
        while any(i not in final for i in ids):
            for output in self.step():
                if output.finished:
                    final[output.request_id] = output
        return [final[i] for i in ids]

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Apply pending swaps, schedule, run the model and take its tokens; returns each
        request's new tokens."""
        self.steps += 1
        self._apply_swaps()
        batch = self.scheduler.schedule()
        sampled = self.runner.run(batch, self.scheduler.table)
        return [self._take(s) for s in sampled]

    def _take(self, sampled: SampledToken) -> RequestOutput:
        """`_accept` the sampled token, or end its request with the error that sampling or
        accepting it raised (that request alone)."""
        error = sampled.error
        if error is None:
            try:
                return self._accept(sampled)
            except Exception as raised:
                error = raised
        request = sampled.request
        log.error(
            "request %d failed in step %d; the others go on",
            request.id,
            self.steps,
            exc_info=(type(error), error, error.__traceback__),
        )
        self.scheduler.remove(request.id)
        return RequestOutput(
            request.id,
            [],
            list(request.output),
            True,
            "error",
            error=f"{type(error).__name__}: {error}",
        )

    def _accept(self, sampled: SampledToken) -> RequestOutput:
        """Append a sampled token to its request, finishing the request if it ends there."""
        request, token = sampled.request, sampled.token
        request.output.append(token)
        params = request.params
        reason = None
        if len(request.output) > params.min_tokens - 1 and (
            token in params.stop_token_ids
            or (not params.ignore_eos and token in self.model.config.eos_token_ids)
        ):
            reason = "stop"
        elif len(request.output) >= params.max_tokens or (
            len(request.prompt) + len(request.output) >= self.config.max_model_len
        ):
            reason = "length"
        if reason is not None:
            self.scheduler.remove(request.id)
            self._notify(request, reason)
        prompt_logprobs = request.prompt_logprobs if len(request.output) == 1 else None
        return RequestOutput(
            request.id,
            [token],
            list(request.output),
            reason is not None,
            reason,
            sampled.logprob,
            prompt_logprobs,
        )

    def _notify(self, request: Request, reason: str) -> None:
        """Tell the listeners that `request` finished for `reason`."""
        record = FinishedRequest(
            request.id,
            len(request.prompt),
            len(request.output),
            request.arrival_s,
            time.monotonic(),
            reason,
        )
        for listener in self._listeners:
            listener(record)

    # ------------------------------------------------------------------ block-size swaps
    def request_block_size(self, new_block_size: int) -> SwapTicket:
        """Ask for a block-size change at the next step boundary (thread-safe)."""
        ticket = SwapTicket(new_block_size)
        self._swap_requests.put(ticket)
        return ticket

    def has_pending_swaps(self) -> bool:
        """Whether a requested swap waits for the next step boundary."""
        return not self._swap_requests.empty()

    def _apply_swaps(self) -> None:
        while True:
            try:
                ticket = self._swap_requests.get_nowait()
            except queue.Empty:
                return
            start = time.perf_counter()
            try:
                result = self._swap(ticket.new_block_size)
            except Exception as error:  # a failure during the commit itself
                ticket.fail(error)
                raise
            result = SwapResult(**{**result.to_dict(), "pause_s": time.perf_counter() - start})
            self.swap_history.append(result)
            self._swap_counts[result.status] += 1
            self._swap_bytes_moved += result.bytes_moved
            log.info("block-size swap %s", result.to_dict())
            ticket.resolve(result)

    def _swap(self, new_size: int) -> SwapResult:
        old_size = self.block_size
        scheduler = self.scheduler

        def rejected(reason: str) -> SwapResult:
            return SwapResult("rejected", old_size, new_size, reason=reason)

        if new_size not in self.config.candidate_block_sizes:
            return rejected(
                f"{new_size} is not a candidate block size {self.config.candidate_block_sizes}"
            )
        if new_size == old_size:  # idempotent: a retried request finds its swap done
            return SwapResult(
                "done", old_size, new_size, reason=f"already at block size {old_size}"
            )
        num_blocks = self.kv.num_slots // new_size
        for request in scheduler.unfinished:
            stored = scheduler.max_stored_tokens(len(request.prompt), request.params)
            if -(-stored // new_size) > num_blocks:
                return rejected(
                    f"request {request.id} may hold {stored} tokens, more than the "
                    f"{num_blocks} blocks of {new_size} in the pool"
                )
        running = scheduler.running
        try:
            prepared = prepare_swap(
                scheduler.blocks,
                scheduler.table,
                self.kv,
                new_size,
                tokens={r.id: r.tokens[: scheduler.blocks.num_tokens(r.id)] for r in running},
                rows={r.id: r.row for r in running},
                max_model_len=self.config.max_model_len,
                backend=self.config.attention_backend,
                staging_budget_bytes=self.config.swap_staging_bytes,
                align=scheduler.align(new_size),
                fault_hook=self.swap_fault_hook,
            )
        except SwapRejected as error:
            return rejected(str(error))
        except Exception as error:  # anything before the commit leaves the engine as it was
            log.exception("block-size swap to %d rolled back", new_size)
            return SwapResult(
                "rolled_back", old_size, new_size, reason=f"{type(error).__name__}: {error}"
            )
        if prepared.staging is not None:
            write_staged(self.kv, prepared)
        scheduler.install(prepared.manager, prepared.table)
        if self.kv.k[0].is_cuda:
            torch.cuda.synchronize(self.kv.k[0].device)
        plan = prepared.plan
        return SwapResult(
            "done",
            old_size,
            new_size,
            zero_copy_blocks=plan.zero_copy_blocks,
            copied_blocks=plan.copied_blocks,
            bytes_moved=prepared.bytes_moved,
        )

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, int | float]:
        """Queue lengths, pool usage, padding, preemptions and swaps right now."""
        return {
            **self.scheduler.stats(),
            "steps": self.steps,
            "peak_blocks_used": self.peak_blocks_used,
            **{f"swaps_{status}": count for status, count in self._swap_counts.items()},
            "swap_bytes_moved": self._swap_bytes_moved,
            "last_swap_pause_s": self.swap_history[-1].pause_s if self.swap_history else 0.0,
        }


def _pool_slots(model: LlamaModel, config: EngineConfig) -> int:
    """The KV pool's token slots: `num_blocks` blocks, or as many as `kv_bytes` holds (a
    multiple of the largest candidate block size)."""
    if config.num_blocks is not None:
        return config.num_blocks * config.block_size
    mc = model.config
    dtype_bytes = torch.empty((), dtype=model.dtype).element_size()
    return slots_for_budget(
        config.kv_bytes,
        mc.num_layers,
        mc.num_kv_heads,
        mc.head_dim,
        dtype_bytes,
        align=max(config.candidate_block_sizes),
    )

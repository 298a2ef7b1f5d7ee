"""A continuous-batching inference engine on the paged KV cache.

Every `step()`:

1. grows every decoding request by its last sampled token; when no block is
   free, the youngest running request is preempted (its blocks are freed and
   it is recomputed from its tokens when it is admitted again);
2. gives the step's remaining token budget (`max_num_batched_tokens` less one
   token per decode) to prefills, oldest first: the partially prefilled
   request continues, then waiting requests are admitted while the budget,
   blocks and batch rows allow. Admission reserves the blocks of the whole
   context (prompt, plus the generated tokens of a preempted request); each
   prefill computes a chunk of at most the budget left, and a request yields
   its first token in the step its last chunk runs;
3. performs the copy-on-write copies the block manager asked for;
4. computes the decodes and the prefill chunks in one pass over the model
   (`LlamaModel.forward_step`): one token for each growing request, and the
   first token of each request whose prefill is complete.

Without `max_num_batched_tokens` the budget is unlimited: every admitted
prompt is prefilled whole in its admission step.

Finished requests free their blocks at once and are reported to listeners
(`add_listener`) as `FinishedRequest` records, which is what the tuner's length
window observes.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from blocktune.kernels.cache_ops import copy_blocks, warmup_cache_ops
from blocktune.kernels.cpu_attention import default_backend
from blocktune.kernels.cpu_layer_ops import argmax_rows
from blocktune.kernels.paged_attention import warmup
from blocktune.runtime.block_manager import BlockManager, blocks_for
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
    RequestTooLarge,
    TokenLogprob,
)
from blocktune.runtime.sampling import SamplingParams, next_token_distribution

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
        if config.num_blocks is not None:
            num_slots = config.num_blocks * config.block_size
        else:
            dtype_bytes = torch.empty((), dtype=model.dtype).element_size()
            num_slots = slots_for_budget(
                config.kv_bytes,
                mc.num_layers,
                mc.num_kv_heads,
                mc.head_dim,
                dtype_bytes,
                align=max(config.candidate_block_sizes),
            )
        self.kv = KVCache(
            mc.num_layers, mc.num_kv_heads, mc.head_dim, num_slots, model.dtype, model.device
        )
        self.block_size = config.block_size
        self.blocks = BlockManager(
            num_slots // config.block_size,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            align=self._align(config.block_size),
        )
        self.table = BlockTable(
            config.max_num_seqs,
            -(-config.max_model_len // config.block_size),
            config.block_size,
            model.device,
        )
        self._free_rows = list(range(config.max_num_seqs - 1, -1, -1))
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._listeners: list[Callable[[FinishedRequest], None]] = []
        self.preemptions = 0
        self.prefix_hit_tokens = 0
        self.steps = 0
        self.peak_blocks_used = 0  # the most blocks referenced at once during a step
        self._swap_requests: queue.SimpleQueue[SwapTicket] = queue.SimpleQueue()
        # The latest swaps (bounded for a long-running engine) and running totals.
        self.swap_history: deque[SwapResult] = deque(maxlen=SWAP_HISTORY)
        self._swap_counts = {"done": 0, "rejected": 0, "rolled_back": 0}
        self._swap_bytes_moved = 0
        # Test seam: called with "copy" and "table" during a swap's prepare phase.
        self.swap_fault_hook: Callable[[str], None] | None = None
        # Compile (Triton) or build (cpu) every kernel a swap may need now, never in the
        # middle of serving; a backend that cannot run here says why before serving.
        warmup(
            config.candidate_block_sizes,
            num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype=model.dtype,
            device=model.device,
            backend=config.attention_backend,
        )
        warmup_cache_ops(
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype=model.dtype,
            device=model.device,
            backend=config.attention_backend,
        )

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
            request.prompt_logprobs = self._prompt_logprobs(prompt, params.prompt_logprobs)
        self._requests[request_id] = request
        self._waiting.append(request)
        return request_id

    def _prompt_logprobs(self, prompt: list[int], top: int) -> tuple[TokenLogprob, ...]:
        """Each prompt token's log-probability after the ones before it, from one dense pass
        over the prompt (asked for rarely: the prompt's KV is computed again when it is
        scheduled, and cached prefix blocks are never rewritten)."""
        device = self.model.device
        logits = self.model.forward_dense(torch.tensor(prompt, device=device))
        return tuple(_logprob(logits[i], prompt[i + 1], top) for i in range(len(prompt) - 1))

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
        stored = self._max_stored_tokens(len(prompt), params)
        needed = blocks_for(stored, self.block_size)
        if needed > self.blocks.num_blocks:
            raise RequestTooLarge(
                f"the request can hold up to {stored} tokens ({needed} blocks of "
                f"{self.block_size}) but the pool has only {self.blocks.num_blocks} blocks"
            )

    @property
    def max_request_tokens(self) -> int:
        """The most tokens, prompt and output together, that one request can reach:
        `max_model_len`, or fewer when the KV pool is smaller (its last token needs no slot)."""
        return min(self.config.max_model_len, self.kv.num_slots + 1)

    def _max_stored_tokens(self, prompt_tokens: int, params: SamplingParams) -> int:
        """The most tokens a request ever holds KV for (its last token never needs a slot)."""
        return min(prompt_tokens + params.max_tokens, self.config.max_model_len) - 1

    def cancel(self, request_id: int) -> bool:
        """Drop a request and free its blocks now; False if it is unknown or already done."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        if request.row is None:
            self._waiting.remove(request)
        else:
            self._running.remove(request)
            self._release(request)
        return True

    def stop(self, request_id: int) -> bool:
        """End a request now as finished with reason "stop" (it met a stop string, which the
        engine does not see): its blocks are freed and listeners hear of it, as of any
        finished request. False if it is unknown or already done."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._finish(request, "stop")
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests)

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
        """Grow, schedule prefill chunks, copy, prefill and decode once; returns each
        request's new tokens."""
        self.steps += 1
        self._apply_swaps()
        decoding = self._grow([r for r in self._running if not r.prefill_left])
        budget = self.config.max_num_batched_tokens
        chunks = self._schedule_prefills(math.inf if budget is None else budget - len(decoding))
        self._copy_pending()
        used = self.blocks.num_blocks - self.blocks.num_free_blocks
        self.peak_blocks_used = max(self.peak_blocks_used, used)
        if not decoding and not chunks:
            return []
        return self._forward(decoding, chunks)

    def _schedule_prefills(self, budget: float) -> list[tuple[Request, int]]:
        """(request, tokens) prefill chunks within `budget` tokens, oldest first: the
        partially prefilled request, then admissions while the budget lasts."""
        chunks: list[tuple[Request, int]] = []
        for request in [r for r in self._running if r.prefill_left]:
            if budget <= 0:
                return chunks
            chunks.append((request, min(request.prefill_left, budget)))
            budget -= chunks[-1][1]
        while budget > 0 and self._waiting and self._free_rows:
            request = self._waiting[0]
            if self.blocks.allocate(request.id, request.tokens) is None:
                break
            self._waiting.popleft()
            request.row = self._free_rows.pop()
            self.table.set_row(request.row, self.blocks.block_ids(request.id))
            self._running.append(request)
            cached = self.blocks.num_cached_tokens(request.id)
            self.prefix_hit_tokens += cached
            request.prefill_left = len(request.tokens) - cached
            chunks.append((request, min(request.prefill_left, budget)))
            budget -= chunks[-1][1]
        return chunks

    def _grow(self, candidates: list[Request]) -> list[Request]:
        """Reserve a slot for each request's pending token, preempting the youngest if needed."""
        grown: list[Request] = []
        for request in candidates:
            if request.row is None:  # preempted while making room for an older request
                continue
            while not self.blocks.append_token(request.id, request.output[-1]):
                victim = max(self._running, key=lambda r: r.id)
                self._preempt(victim)
                if victim is request:
                    break
            else:
                self.table.set_row(request.row, self.blocks.block_ids(request.id))
                grown.append(request)
        return grown

    def _preempt(self, request: Request) -> None:
        self.preemptions += 1
        self._running.remove(request)
        self._release(request)
        self._waiting.appendleft(request)

    def _copy_pending(self) -> None:
        pairs = self.blocks.take_pending_copies()
        if pairs:
            copy_blocks(
                self.kv.k,
                self.kv.v,
                pairs,
                block_size=self.block_size,
                backend=self.config.attention_backend,
            )

    def _forward(
        self, decoding: list[Request], chunks: list[tuple[Request, int]]
    ) -> list[RequestOutput]:
        """Run the step's decodes and prefill chunks through the model; sample the decodes'
        next tokens and the first token of each request whose last chunk this is."""
        device = self.model.device
        self.table.sync()
        lengths = [self.blocks.num_tokens(r.id) for r in decoding]
        token_ids = [r.output[-1] for r in decoding]
        positions = [n - 1 for n in lengths]
        slots = [
            int(self.table.slot_mapping(r.row, [n - 1])[0])
            for r, n in zip(decoding, lengths, strict=True)
        ]
        contexts, rows, sampled = [], list(range(len(decoding))), list(decoding)
        for request, num_tokens in chunks:
            start = len(request.tokens) - request.prefill_left
            end = start + num_tokens
            context = self.table.slot_mapping(request.row, range(end))
            token_ids += request.tokens[start:end]
            positions += range(start, end)
            slots += context[start:].tolist()
            contexts.append((num_tokens, torch.from_numpy(context).to(device)))
            request.prefill_left -= num_tokens
            if not request.prefill_left:
                rows.append(len(token_ids) - 1)
                sampled.append(request)
        decode_rows = torch.tensor([r.row for r in decoding], dtype=torch.long, device=device)
        logits = self.model.forward_step(
            torch.tensor(token_ids, device=device),
            torch.tensor(positions, device=device),
            torch.tensor(slots, device=device),
            self.kv,
            block_table=self.table.device_table.index_select(0, decode_rows),
            context_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
            block_size=self.block_size,
            chunks=contexts,
            logit_rows=torch.tensor(rows, dtype=torch.long, device=device),
            backend=self.config.attention_backend,
        )
        tokens = self._sample_batch(sampled, logits)
        return [
            self._accept(r, t, logits[i])
            for i, (r, t) in enumerate(zip(sampled, tokens, strict=True))
        ]

    # ------------------------------------------------------------------ block-size swaps
    def _align(self, block_size: int) -> int:
        """Allocation alignment that keeps runs whole for a grow to the largest candidate."""
        return max(1, max(self.config.candidate_block_sizes) // block_size)

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
        for request in self._requests.values():
            stored = self._max_stored_tokens(len(request.prompt), request.params)
            if -(-stored // new_size) > num_blocks:
                return rejected(
                    f"request {request.id} may hold {stored} tokens, more than the "
                    f"{num_blocks} blocks of {new_size} in the pool"
                )
        try:
            prepared = prepare_swap(
                self.blocks,
                self.table,
                self.kv,
                new_size,
                tokens={r.id: r.tokens[: self.blocks.num_tokens(r.id)] for r in self._running},
                rows={r.id: r.row for r in self._running},
                max_model_len=self.config.max_model_len,
                backend=self.config.attention_backend,
                staging_budget_bytes=self.config.swap_staging_bytes,
                align=self._align(new_size),
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
        self.blocks, self.table, self.block_size = prepared.manager, prepared.table, new_size
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

    # ------------------------------------------------------------------ sampling
    def _sample_batch(self, batch: list[Request], logits: torch.Tensor) -> list[int]:
        if all(r.params.greedy and not r.params.adjusts_logits for r in batch):
            return argmax_rows(logits)
        return [self._sample(r, logits[i]) for i, r in enumerate(batch)]

    def _sample(self, request: Request, logits: torch.Tensor) -> int:
        params = request.params
        if params.greedy and not params.adjusts_logits:
            return int(logits.argmax())
        probs = next_token_distribution(
            logits,
            params,
            prompt=request.prompt,
            output=request.output,
            eos_token_ids=self.model.config.eos_token_ids,
        )
        if params.greedy:
            return int(probs.argmax())
        return int(torch.multinomial(probs, 1, generator=request.generator))

    def _accept(self, request: Request, token: int, logits: torch.Tensor) -> RequestOutput:
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
            self._finish(request, reason)
        logprob = None if params.logprobs is None else _logprob(logits, token, params.logprobs)
        prompt_logprobs = request.prompt_logprobs if len(request.output) == 1 else None
        return RequestOutput(
            request.id,
            [token],
            list(request.output),
            reason is not None,
            reason,
            logprob,
            prompt_logprobs,
        )

    def _finish(self, request: Request, reason: str) -> None:
        if request.row is None:  # preempted, waiting to be recomputed
            self._waiting.remove(request)
        else:
            self._running.remove(request)
            self._release(request)
        del self._requests[request.id]
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

    def _release(self, request: Request) -> None:
        self.blocks.free(request.id)
        self.table.clear_row(request.row)
        self._free_rows.append(request.row)
        request.row = None

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, int | float]:
        """Queue lengths, pool usage, padding and preemptions right now."""
        used_blocks = self.blocks.num_blocks - self.blocks.num_free_blocks
        # The unused tail of each sequence's last block (shared full blocks pad nothing).
        padding = sum(-self.blocks.num_tokens(r.id) % self.block_size for r in self._running)
        return {
            "block_size": self.block_size,
            "running": len(self._running),
            "waiting": len(self._waiting),
            "blocks_total": self.blocks.num_blocks,
            "blocks_used": used_blocks,
            "blocks_free": self.blocks.num_free_blocks,
            "padding_slots": padding,
            "preemptions": self.preemptions,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "steps": self.steps,
            "peak_blocks_used": self.peak_blocks_used,
            **{f"swaps_{status}": count for status, count in self._swap_counts.items()},
            "swap_bytes_moved": self._swap_bytes_moved,
            "last_swap_pause_s": self.swap_history[-1].pause_s if self.swap_history else 0.0,
        }


def _logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability under `logits [vocab]` and the `top` most likely tokens'."""
    logprobs = logits.float().log_softmax(-1)
    values, ids = logprobs.topk(top)
    return TokenLogprob(
        float(logprobs[token]), tuple(zip(ids.tolist(), values.tolist(), strict=True))
    )

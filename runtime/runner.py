"""Running the model on a scheduled batch and sampling its next tokens.

`ModelRunner.run` does the batch's copy-on-write block copies, then computes the
decodes and the prefill chunks in one pass over the model
(`LlamaModel.forward_step`): one token for each growing request, and the first
token of each request whose prefill is complete. It samples those requests' next
tokens (greedy rows by one argmax over the batch, others through
`next_token_distribution` with each request's generator) and, where a request
asks, their log-probabilities. A row whose sampling raises carries the error
instead of a token, and the other rows are sampled as they would be without it.
The runner changes no request: what a token means for its request (or its
error) is the engine's to decide.

The runner builds every kernel a block-size swap may need when it is created,
never in the middle of serving.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blocktune.kernels.cache_ops import copy_blocks, warmup_cache_ops
from blocktune.kernels.cpu_layer_ops import argmax_rows
from blocktune.kernels.paged_attention import warmup
from blocktune.runtime.block_table import BlockTable
from blocktune.runtime.config import EngineConfig
from blocktune.runtime.kv_cache import KVCache
from blocktune.runtime.model import LlamaModel
from blocktune.runtime.requests import Request, TokenLogprob
from blocktune.runtime.sampling import next_token_distribution
from blocktune.runtime.scheduler import ScheduledBatch

__all__ = ["ModelRunner", "SampledToken"]


@dataclass(frozen=True)
class SampledToken:
    """A request's next token from this step and its log-probability when asked for, or
    (`token` None) the error that sampling it raised."""

    request: Request
    token: int | None
    logprob: TokenLogprob | None = None
    error: Exception | None = None


@dataclass(frozen=True)
class _StepInputs:
    """The flat inputs of one `forward_step` call (see `LlamaModel.forward_step`)."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    context_lens: list[int]  # per decode
    chunks: list[tuple[int, torch.Tensor]]  # per prefill chunk: (tokens, context slots)
    logit_rows: list[int]  # the rows sampled: each decode's, each last chunk's last


class ModelRunner:
    """Computes scheduled batches with one model on one KV pool."""

    def __init__(self, model: LlamaModel, kv: KVCache, config: EngineConfig) -> None:
        """`config` with `attention_backend` set; warms up its kernels at every candidate
        block size (a backend that cannot run here says why now)."""
        self.model = model
        self.kv = kv
        self.backend = config.attention_backend
        mc = model.config
        warmup(
            config.candidate_block_sizes,
            num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype=model.dtype,
            device=model.device,
            backend=self.backend,
        )
        warmup_cache_ops(
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype=model.dtype,
            device=model.device,
            backend=self.backend,
        )

    def run(self, batch: ScheduledBatch, table: BlockTable) -> list[SampledToken]:
        """Copy the batch's blocks, compute it and sample `batch.sampled`'s next tokens, in
        that order; `table` is the block table its rows and copies refer to."""
        if batch.copies:
            copy_blocks(
                self.kv.k,
                self.kv.v,
                batch.copies,
                block_size=table.block_size,
                backend=self.backend,
            )
        if batch.empty:
            return []
        logits = self._forward(batch, table)
        requests = batch.sampled
        tokens: list[int | None] = [None] * len(requests)
        if all(r.params.greedy and not r.params.adjusts_logits for r in requests):
            tokens = argmax_rows(logits)
        return [self._sample_row(r, logits[i], tokens[i]) for i, r in enumerate(requests)]

    def prompt_logprobs(self, prompt: Sequence[int], top: int) -> tuple[TokenLogprob, ...]:
        """Each prompt token's log-probability after the ones before it, from one dense pass
        over the prompt (asked for rarely: the prompt's KV is computed again when it is
        scheduled, and cached prefix blocks are never rewritten)."""
        logits = self.model.forward_dense(torch.tensor(prompt, device=self.model.device))
        return tuple(_logprob(logits[i], prompt[i + 1], top) for i in range(len(prompt) - 1))

    # ------------------------------------------------------------------ the forward pass
    def _forward(self, batch: ScheduledBatch, table: BlockTable) -> torch.Tensor:
        """Logits `[len(batch.sampled), vocab]` of the batch's sampled rows."""
        device = self.model.device
        table.sync()
        inputs = _step_inputs(batch, table, device)
        decode_rows = torch.tensor([r.row for r in batch.decodes], dtype=torch.long, device=device)
        return self.model.forward_step(
            torch.tensor(inputs.token_ids, device=device),
            torch.tensor(inputs.positions, device=device),
            torch.tensor(inputs.slots, device=device),
            self.kv,
            block_table=table.device_table.index_select(0, decode_rows),
            context_lens=torch.tensor(inputs.context_lens, dtype=torch.int32, device=device),
            block_size=table.block_size,
            chunks=inputs.chunks,
            logit_rows=torch.tensor(inputs.logit_rows, dtype=torch.long, device=device),
            backend=self.backend,
        )

    # ------------------------------------------------------------------ sampling
    def _sample_row(
        self, request: Request, logits: torch.Tensor, token: int | None
    ) -> SampledToken:
        """`request`'s token (sampled from its row of `logits` unless given) with its
        log-probability where the request asks for it, or the error either raised (which
        ends that request alone)."""
        try:
            if token is None:
                token = self._sample(request, logits)
            top = request.params.logprobs
            return SampledToken(
                request, token, None if top is None else _logprob(logits, token, top)
            )
        except Exception as error:
            return SampledToken(request, None, error=error)

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


def _step_inputs(batch: ScheduledBatch, table: BlockTable, device: torch.device) -> _StepInputs:
    """The decodes' pending tokens (each a slot reserved at its context's end), then each
    prefill chunk's tokens, with their positions and slots."""
    context_lens = [len(r.tokens) for r in batch.decodes]
    token_ids = [r.output[-1] for r in batch.decodes]
    positions = [n - 1 for n in context_lens]
    slots = [
        int(table.slot_mapping(r.row, [n - 1])[0])
        for r, n in zip(batch.decodes, context_lens, strict=True)
    ]
    chunks, logit_rows = [], list(range(len(batch.decodes)))
    for chunk in batch.prefills:
        request = chunk.request
        context = table.slot_mapping(request.row, range(chunk.end))
        token_ids += request.tokens[chunk.start : chunk.end]
        positions += range(chunk.start, chunk.end)
        slots += context[chunk.start :].tolist()
        chunks.append((chunk.num_tokens, torch.from_numpy(context).to(device)))
        if chunk.last:
            logit_rows.append(len(token_ids) - 1)
    return _StepInputs(token_ids, positions, slots, context_lens, chunks, logit_rows)


def _logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability under `logits [vocab]` and the `top` most likely tokens'."""
    logprobs = logits.float().log_softmax(-1)
    values, ids = logprobs.topk(top)
    return TokenLogprob(
        float(logprobs[token]), tuple(zip(ids.tolist(), values.tolist(), strict=True))
    )

"""How a request's next token is picked from the model's logits: biases, penalties, filters.

`SamplingParams` holds one request's settings, as OpenAI's and vLLM's APIs
name them. `next_token_distribution` turns one row of logits into the
probabilities the token is drawn from, in this order:

1. `logit_bias` is added to the logits of the tokens it names;
2. until `min_tokens` tokens were generated, the stop tokens (EOS unless
   `ignore_eos`, and `stop_token_ids`) cannot be picked;
3. `repetition_penalty` (over the prompt and the output) divides a positive
   logit of a token already seen and multiplies a negative one;
   `frequency_penalty` subtracts its value times the token's count in the
   output, `presence_penalty` its value once for a token in the output;
4. temperature: greedy at 0 (all the weight on the largest logit, the lowest
   token id on ties), else a softmax of logits / temperature;
5. `min_p` drops tokens less likely than `min_p` times the likeliest, `top_k`
   keeps the `top_k` likeliest, `top_p` the smallest set whose mass reaches
   `top_p`; what is left is renormalised.

The distribution is total: where steps 1-3 leave no token a finite logit (every
token is a stop token before `min_tokens`, or a penalty pushed every logit past
float64's range), the settings cannot all be met, and the token is the model's
own likeliest one, the argmax of the raw logits, with all the weight. A request
whose every token is a stop token so generates `min_tokens` tokens and stops at
the next, as it asked. A NaN logit (never from a sound model) counts as -inf.

Log-probabilities reported to the client are the model's own (before all of
this), as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["SamplingParams", "next_token_distribution"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens: greedy at temperature 0, else sampling from a seeded generator.

    A request stops at any of `stop_token_ids` and, unless `ignore_eos`, at the model's EOS
    ids, but never before `min_tokens`. With `logprobs` set, each output carries the sampled
    token's log-probability under the model and the `logprobs` most likely tokens'; with
    `prompt_logprobs` set, the first output also carries each prompt token's (after the
    first). `top_k` 0 keeps every token. See the module docstring for the order of the steps.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether any step before the temperature changes the logits."""
        return bool(
            self.logit_bias
            or self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

    def problems(self, vocab_size: int) -> list[str]:
        """What is out of range, one sentence each (empty when the settings are valid)."""
        out = []
        if self.max_tokens < 1:
            out.append(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            out.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            out.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            out.append(f"top_k must be >= 0 (0 keeps every token), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            out.append(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0:
            out.append(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.repetition_penalty <= 0:
            out.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            out.append(f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= vocab_size:
                out.append(f"{name} must be in [0, {vocab_size}], got {value}")
        for token in (*self.logit_bias, *self.stop_token_ids):
            if not 0 <= token < vocab_size:
                out.append(f"token id {token} is outside the vocabulary [0, {vocab_size})")
        return out


def next_token_distribution(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    prompt: Sequence[int],
    output: Sequence[int],
    eos_token_ids: Sequence[int],
) -> torch.Tensor:
    """The float64 probabilities `[vocab]` the next token is drawn from (see the module
    docstring); one-hot on the argmax when greedy, or when no token is left."""
    raw = (
        logits.detach()
        .double()
        .cpu()
        .nan_to_num(nan=-torch.inf, posinf=torch.inf, neginf=-torch.inf)
    )
    logits = raw.clone()
    vocab = logits.shape[-1]
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=torch.float64)
    if len(output) < params.min_tokens:
        stops = [*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)]
        if stops:
            logits[torch.tensor(stops, dtype=torch.long)] = -torch.inf
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*prompt, *output}), dtype=torch.long)
        values = logits[seen]
        penalty = params.repetition_penalty
        logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if output and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab)
        logits -= params.frequency_penalty * counts.double()
        logits -= params.presence_penalty * (counts > 0).double()
    # A penalty near 0 divides a logit past float64's range: hold it at the largest finite
    # value, so the softmax below sees no inf - inf.
    logits = logits.clamp(max=torch.finfo(torch.float64).max)
    if not torch.isfinite(logits).any():
        return _one_hot(raw)  # no token left: the model's own choice
    if params.greedy:
        return _one_hot(logits)
    # Relative to the largest logit, so a tiny temperature gives a one-hot distribution
    # instead of inf/inf = NaN.
    probs = ((logits - logits.max()) / params.temperature).softmax(-1)
    if params.min_p > 0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    if 0 < params.top_k < vocab:
        kth = probs.topk(params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if params.top_p < 1:
        sorted_probs, order = (probs / probs.sum()).sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < params.top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
    return probs / probs.sum()


def _one_hot(logits: torch.Tensor) -> torch.Tensor:
    """All the weight on the largest logit (the lowest token id on ties)."""
    probs = torch.zeros_like(logits)
    probs[int(logits.argmax())] = 1.0
    return probs

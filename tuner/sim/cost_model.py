"""What each candidate block size costs a window of requests, in one unit: seconds per token.

Notation, for one window of requests i with prompt p_i and output o_i tokens
(a request holds l = p_i + t tokens in its decode step t = 1..o_i, so each
step generates one token; sums run over every decode step of every request):

    S    = sum o_i                               generated tokens            [token]
    T    = sum_i sum_t l                         held KV slots over time     [slot*step]
    K_B  = sum_i sum_t ceil(l / B)               held blocks over time       [block*step]
    pad_B = (B*K_B - T) / (B*K_B)                padding ratio               [1]
    a_B  = B*K_B / S                             slots a running request holds [slot]
    C_B  = floor(budget / (B*s)) * B             slots the KV budget holds   [slot]
                                                 (s = KV bytes per slot, all layers)
    n_B  = C_B / a_B                             requests the budget runs at once

The objective is the time per generated token of an engine whose KV budget is
full (the regime where the block size matters), in seconds per token:

    J(B) = (W / bw + L * launch_B) / n_B                   weights read once per step,
                                                            shared by n_B requests
         + L * (per_block_B * K_B + per_token_B * T) / S   paged attention (L layers)
         + host_B                                          BlockManager bookkeeping
         + P * (B - 1) / 2 * (2 N / flops) / S             prefix tokens recomputed

with W = weight bytes (N parameters), bw = memory bandwidth, flops = matmul
throughput, P = requests that share a prefix with an earlier one in the window,
and launch, per_block, per_token, host from the calibration. Padding costs time
through n_B: every padded slot displaces useful KV, so fewer requests share each
step's weight read. The per-block attention cost falls as B grows, padding
rises, so J has an interior optimum; with c_block = L * per_block [s/block per
token] and c_pad = (W / bw) * s / budget [s/slot per token], minimising
c_block * l / B + c_pad * B / 2 gives the principled prior
B* = sqrt(2 * c_block * l / c_pad) tokens (docs/deciding.md, "The per-token cost").

The source article's heuristic sqrt(length * head_dim * heads * 2 * dtype_bytes) is also
computed, exactly as stated: with length in tokens and the rest in bytes per
token, its value has units sqrt(token * byte); the article divides it by the bytes
per token (head_dim * heads * 2 * dtype_bytes) to get "tokens", i.e.
sqrt(length / bytes_per_token) tokens, which is below one token for any real
model (0.17 for its own example, whose value is sqrt(500*128*32*2*2) = 2862,
not the 1280 it states). It is reported, rounded to a power of two and clamped
to the candidates, beside the measured choice; it decides nothing.

The sums T and K_B are closed-form per request (no loop over tokens):
sum_{l=1..n} ceil(l/B) = B*q*(q+1)/2 + r*(q+1) with n = q*B + r.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from blocktune.tuner.config.calibration import Calibration, KernelCoefficients
from blocktune.tuner.config.policy import Policy, nearest_power_of_two

__all__ = [
    "CandidateCost",
    "CostModel",
    "EmptyWindow",
    "ArticleHeuristic",
    "block_steps",
    "article_heuristic",
    "token_steps",
]


class EmptyWindow(ValueError):
    """The requests given generate no tokens, so no cost per token exists."""


def _ceil_prefix_sum(n: np.ndarray, block_size: int) -> np.ndarray:
    """sum_{l=1..n} ceil(l / block_size), elementwise for n >= 0 (int64)."""
    q, r = np.divmod(n, block_size)
    return block_size * q * (q + 1) // 2 + r * (q + 1)


def token_steps(prompts: np.ndarray, outputs: np.ndarray) -> np.ndarray:
    """Per request: sum of held tokens over its decode steps, l = p+1 .. p+o [slot*step]."""
    p = np.asarray(prompts, dtype=np.int64)
    o = np.asarray(outputs, dtype=np.int64)
    return o * (2 * p + o + 1) // 2


def block_steps(prompts: np.ndarray, outputs: np.ndarray, block_size: int) -> np.ndarray:
    """Per request: sum of held blocks over its decode steps, ceil(l / B) for l = p+1 .. p+o."""
    p = np.asarray(prompts, dtype=np.int64)
    o = np.asarray(outputs, dtype=np.int64)
    return _ceil_prefix_sum(p + o, block_size) - _ceil_prefix_sum(p, block_size)


@dataclass(frozen=True)
class ArticleHeuristic:
    """The source article's sqrt rule as stated, and its conversion to a token count."""

    length_tokens: float
    value_sqrt_token_bytes: float
    bytes_per_token: int
    tokens: float
    block_size: int


def article_heuristic(
    length_tokens: float,
    *,
    head_dim: int,
    num_heads: int,
    dtype_bytes: int,
    candidates: tuple[int, ...],
) -> ArticleHeuristic:
    """sqrt(length x head_dim x heads x 2 x dtype_bytes), divided by the bytes per token of
    that product (head_dim x heads x 2 x dtype_bytes) as the article does, then the nearest
    candidate power of two."""
    bytes_per_token = head_dim * num_heads * 2 * dtype_bytes
    value = math.sqrt(length_tokens * bytes_per_token)
    tokens = value / bytes_per_token
    return ArticleHeuristic(
        length_tokens=float(length_tokens),
        value_sqrt_token_bytes=value,
        bytes_per_token=bytes_per_token,
        tokens=tokens,
        block_size=nearest_power_of_two(tokens, candidates),
    )


@dataclass(frozen=True)
class CandidateCost:
    """Every cost term of one block size for one window (see the module docstring)."""

    block_size: int
    padding_ratio: float
    padding_slots_per_request: float
    padding_bytes_per_request: float
    padding_bytes_in_budget: float
    allocated_slots_per_request: float
    capacity_slots: int
    capacity_tokens: float
    concurrent_requests: float
    weights_s_per_token: float
    kernel_translation_s_per_token: float
    kernel_bandwidth_s_per_token: float
    host_s_per_token: float
    prefix_loss_tokens: float
    prefix_loss_s_per_token: float
    objective_s_per_token: float

    @property
    def kernel_s_per_token(self) -> float:
        return self.kernel_translation_s_per_token + self.kernel_bandwidth_s_per_token


class CostModel:
    """Prices candidate block sizes for a policy's model and budget with a calibration."""

    def __init__(self, policy: Policy, calibration: Calibration) -> None:
        calibration.require(policy.candidates)
        self.policy = policy
        self.calibration = calibration
        model = policy.model
        self._slot_bytes = model.kv_bytes_per_token
        self.weights_read_s = model.weight_bytes / calibration.memory_bandwidth_bytes_per_s
        """Seconds to read the weights once (every engine step does)."""
        self.prefill_s_per_token = 2 * model.weight_count / calibration.compute_flops_per_s
        """Seconds of matmul work per prompt token computed."""

    def kernel(self, block_size: int) -> KernelCoefficients:
        """Calibrated kernel coefficients for this model's K/V bytes per token and layer."""
        return self.calibration.kernel_for(block_size, self.policy.model.kv_bytes_per_token_layer)

    def capacity_slots(self, block_size: int) -> int:
        """Token slots of the KV budget in whole blocks of `block_size`."""
        return int(self.policy.kv_budget) // (block_size * self._slot_bytes) * block_size

    def switch_cost_s(self, bytes_moved: int = 0) -> float:
        """Serving time lost to one change of the block size whose plan moves `bytes_moved`
        bytes of K and V: the policy's pause (a live swap, or a vLLM restart) plus the copy
        at the calibrated bandwidth. A shrink moves nothing, and so does a grow whose
        blocks lie in aligned runs, as blocktune's allocator keeps them."""
        copy_s = bytes_moved / self.calibration.copy_bandwidth_bytes_per_s
        return self.policy.switch_cost_s + copy_s

    def costs(
        self,
        prompts: np.ndarray,
        outputs: np.ndarray,
        *,
        shared_prefixes: int = 0,
        block_sizes: tuple[int, ...] | None = None,
    ) -> list[CandidateCost]:
        """The cost record of each block size (default: the policy's candidates)."""
        sizes = self.policy.candidates if block_sizes is None else tuple(block_sizes)
        prompts = np.asarray(prompts, dtype=np.int64)
        outputs = np.asarray(outputs, dtype=np.int64)
        generated = int(outputs.sum())
        if generated <= 0:
            raise EmptyWindow(f"{len(prompts)} requests generate no tokens; nothing to price")
        # Sums in float64: exact below 2**53 and never wrapping like int64 on huge windows.
        held = int(token_steps(prompts, outputs).sum(dtype=np.float64))
        return [self._cost(b, prompts, outputs, generated, held, shared_prefixes) for b in sizes]

    def _cost(
        self,
        block_size: int,
        prompts: np.ndarray,
        outputs: np.ndarray,
        generated: int,
        held: int,
        shared_prefixes: int,
    ) -> CandidateCost:
        layers = self.policy.model.num_layers
        kernel = self.kernel(block_size)
        blocks = int(block_steps(prompts, outputs, block_size).sum(dtype=np.float64))
        allocated = block_size * blocks
        padding_ratio = (allocated - held) / allocated
        per_request = allocated / generated
        capacity = self.capacity_slots(block_size)
        concurrent = capacity / per_request
        weights = (self.weights_read_s + layers * kernel.launch_s) / concurrent
        translation = layers * kernel.per_block_s * blocks / generated
        bandwidth = layers * kernel.per_token_s * held / generated
        host = self.calibration.host_s_per_token[block_size]
        lost_tokens = shared_prefixes * (block_size - 1) / 2
        prefix = lost_tokens * self.prefill_s_per_token / generated
        padding_per_request = (allocated - held) / generated
        return CandidateCost(
            block_size=block_size,
            padding_ratio=padding_ratio,
            padding_slots_per_request=padding_per_request,
            padding_bytes_per_request=padding_per_request * self._slot_bytes,
            padding_bytes_in_budget=padding_ratio * capacity * self._slot_bytes,
            allocated_slots_per_request=per_request,
            capacity_slots=capacity,
            capacity_tokens=capacity * (1 - padding_ratio),
            concurrent_requests=concurrent,
            weights_s_per_token=weights,
            kernel_translation_s_per_token=translation,
            kernel_bandwidth_s_per_token=bandwidth,
            host_s_per_token=host,
            prefix_loss_tokens=lost_tokens,
            prefix_loss_s_per_token=prefix,
            objective_s_per_token=weights + translation + bandwidth + host + prefix,
        )

    def principled_block_size(self, mean_context_tokens: float) -> tuple[float, int]:
        """B* = sqrt(2 c_block l / c_pad) in tokens, and the nearest candidate.

        c_block [s per block per token] is the mean calibrated per-block attention cost
        over the candidates times the layers; c_pad [s per slot per token] is the
        weight-read time shared out per slot of the budget.
        """
        layers = self.policy.model.num_layers
        c_block = layers * float(
            np.mean([self.kernel(b).per_block_s for b in self.policy.candidates])
        )
        c_pad = self.weights_read_s * self._slot_bytes / int(self.policy.kv_budget)
        optimum = math.sqrt(2 * c_block * mean_context_tokens / c_pad)
        return optimum, nearest_power_of_two(optimum, self.policy.candidates)

    def article_heuristic(self, length_tokens: float) -> ArticleHeuristic:
        """The article's rule for this policy's model (query heads, as the article states it)."""
        model = self.policy.model
        return article_heuristic(
            length_tokens,
            head_dim=model.head_dim,
            num_heads=model.num_heads,
            dtype_bytes=model.dtype_bytes,
            candidates=self.policy.candidates,
        )

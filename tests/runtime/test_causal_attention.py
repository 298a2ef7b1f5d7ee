"""`causal_attention`: the prompt attention of a step, against explicit scores, and on torch's
fused kernel (the one that never builds the `[H, T, C]` scores) for fresh prompts and for
chunks after a cached prefix alike."""

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from blocktune.runtime.model import causal_attention

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The same attention from materialised scores: query i sees keys up to C - T + i."""
    num_new, context = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("thd,chd->htc", q, keys) * scale
    visible = torch.ones(num_new, context, dtype=torch.bool).tril(context - num_new)
    weights = scores.masked_fill(~visible, -math.inf).softmax(-1)
    return torch.einsum("htc,chd->thd", weights, values)


@pytest.mark.parametrize(("num_new", "context"), [(24, 24), (7, 31)], ids=["prompt", "chunk"])
def test_causal_attention_is_the_explicit_attention_on_the_fused_kernel(num_new, context):
    generator = torch.Generator().manual_seed(num_new)
    q = torch.randn(num_new, HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(context, KV_HEADS, HEAD_DIM, generator=generator)
    v = torch.randn(context, KV_HEADS, HEAD_DIM, generator=generator)
    scale = HEAD_DIM**-0.5
    # Only the fused kernel allowed: it refuses inputs without a batch dimension, which
    # the unfused path (scores built whole) would take.
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = causal_attention(q, k, v, scale)
    assert out.shape == (num_new, HEADS, HEAD_DIM)
    torch.testing.assert_close(out, explicit(q, k, v, scale), rtol=1e-5, atol=1e-5)

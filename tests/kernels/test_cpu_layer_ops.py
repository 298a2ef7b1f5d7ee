"""The fused layer operators of the cpu library against the torch operators they replace
(`blocktune.runtime.model`): the residual add and rotary embedding bit for bit, the norm and
SwiGLU to float32 rounding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blocktune.kernels import cpu_library
from blocktune.kernels.cpu_layer_ops import (
    add_rms_norm,
    argmax_rows,
    fused_ops_apply,
    rotate_heads,
    silu_and_mul,
)
from blocktune.runtime.model import ModelConfig, RMSNorm, rotary_tables, rotate

DTYPES = [torch.float32, torch.bfloat16]
pytestmark = pytest.mark.skipif(
    cpu_library.cpu_kernel_error() is not None, reason=str(cpu_library.cpu_kernel_error())
)


def _randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _ulps(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference in units of the last place of `expected`'s dtype."""
    eps = torch.finfo(expected.dtype).eps
    scale = expected.float().abs().clamp_min(torch.finfo(expected.dtype).tiny)
    return ((got.float() - expected.float()).abs() / (scale * eps)).max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_add_rms_norm_adds_in_place_and_normalises_like_rmsnorm(dtype, rows):
    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(576, dtype=dtype, seed=1))
    x, delta = _randn(rows, 576, dtype=dtype, seed=2), _randn(rows, 576, dtype=dtype, seed=3)
    stream = x.clone()
    with torch.inference_mode():
        out = add_rms_norm(stream, delta, norm.weight, norm.eps)
        expected_stream = x + delta
        expected = norm(expected_stream)
    assert torch.equal(stream, expected_stream)  # the add, bit for bit
    assert out.dtype == dtype
    # float32: the sum of squares in another order moves the scale by an ulp or so;
    # bfloat16: that rarely crosses a rounding boundary, and then by one bfloat16 ulp.
    assert _ulps(out, expected) <= (8 if dtype == torch.float32 else 1)
    assert (out == expected).float().mean().item() > (0.0 if dtype == torch.float32 else 0.99)
    with torch.inference_mode():  # without a delta: the norm alone, x untouched
        alone = add_rms_norm(stream, None, norm.weight, norm.eps)
    assert torch.equal(stream, expected_stream) and torch.equal(alone, out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotate_heads_is_bitwise_torchs_rotary_embedding_in_place(dtype):
    config = ModelConfig.tiny()  # head_dim 16
    tokens, heads, rotated = 5, 8, 6  # 4 query and 2 key heads rotated, 2 value heads not
    buffer = _randn(tokens, heads * 16, dtype=dtype, seed=4)
    view = buffer.view(tokens, heads, 16)
    rotary = rotary_tables(config, torch.tensor([0, 1, 7, 300, 4095]), dtype)
    expected = rotate(view[:, :rotated], rotary)
    values_before = view[:, rotated:].clone()
    rotate_heads(view, rotated, *rotary)
    assert torch.equal(view[:, :rotated], expected)
    assert torch.equal(view[:, rotated:], values_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_is_swiglu(dtype):
    gate_up = _randn(9, 2 * 1536, dtype=dtype, seed=5) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    got = silu_and_mul(gate_up)
    assert got.shape == expected.shape and got.dtype == dtype
    assert _ulps(got, expected) <= (4 if dtype == torch.float32 else 1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=40))
def test_silu_and_mul_stays_finite_and_close_over_the_whole_range(gates):
    """The kernel's exp is clamped to [-87, 88]: huge gates still give x * sigmoid(x)."""
    gate = torch.tensor(gates, dtype=torch.float32)
    gate_up = torch.cat((gate, torch.ones_like(gate)))[None]
    got = silu_and_mul(gate_up)[0]
    expected = torch.nn.functional.silu(gate.double())
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-30)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.lists(
            st.sampled_from([0.0, 1.0, -1.0, 3.5, float("inf"), -float("inf"), float("nan")]),
            min_size=1,
            max_size=70,
        ),
        min_size=1,
        max_size=4,
    ).filter(lambda rows: len({len(row) for row in rows}) == 1)
)
def test_argmax_rows_picks_as_torch_does_with_ties_infinities_and_nans(rows):
    """Few distinct values, so rows tie; torch takes the first largest, or the first NaN."""
    logits = torch.tensor(rows, dtype=torch.float32)
    assert argmax_rows(logits) == logits.argmax(dim=-1).tolist()


def test_argmax_rows_reads_rows_apart_and_falls_back_for_other_dtypes():
    logits = _randn(5, 49_152, dtype=torch.float32, seed=7)
    logits[2, 40_000] = 99.0
    spaced = torch.zeros(5, 50_000)[:, :49_152]
    spaced.copy_(logits)
    expected = logits.argmax(dim=-1).tolist()
    assert expected[2] == 40_000
    assert argmax_rows(logits) == argmax_rows(spaced) == expected
    assert argmax_rows(logits.bfloat16()) == logits.bfloat16().argmax(dim=-1).tolist()


def test_fused_ops_apply_only_where_they_can_run(monkeypatch):
    x = torch.ones(2, 4)
    with torch.inference_mode():
        assert fused_ops_apply(x)
        assert fused_ops_apply(x.bfloat16())
        assert not fused_ops_apply(x.half())  # no float16 in the kernels
    with torch.enable_grad():
        assert not fused_ops_apply(x)  # autograd needs torch's operators
    monkeypatch.setenv("CC", "no-such-compiler")
    cpu_library.cpu_library.cache_clear()
    try:
        with torch.inference_mode():
            assert not fused_ops_apply(x)
    finally:
        monkeypatch.undo()
        cpu_library.cpu_library.cache_clear()

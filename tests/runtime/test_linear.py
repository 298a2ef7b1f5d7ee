"""PackedLinear and FusedProjections: the products of nn.Linear through packed weights,
packed again when a weight changes."""

import pytest
import torch

from blocktune.runtime import linear
from blocktune.runtime.linear import FusedProjections, PackedLinear, packs


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 0.0)])
def test_packed_products_equal_linear_and_follow_weight_changes(dtype, atol):
    generator = torch.Generator().manual_seed(0)
    layer = PackedLinear(24, 40).to(dtype)
    x = torch.randn(5, 24, generator=generator).to(dtype)
    with torch.inference_mode():
        first = layer(x)
        assert (layer._packed is not None) == packs(layer.weight)
        torch.testing.assert_close(first, x @ layer.weight.T, atol=atol, rtol=atol)
        layer.weight.mul_(2)  # in place: a new version of the same storage
        torch.testing.assert_close(layer(x), 2 * first, atol=2 * atol, rtol=2 * atol)
    replacement = torch.randn(40, 24, generator=generator).to(dtype)
    layer.load_state_dict({"weight": replacement})
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), x @ replacement.T, atol=atol, rtol=atol)


@pytest.mark.parametrize("fused", [False, True])
def test_a_bfloat16_weight_packed_as_float32_multiplies_in_float32_and_rounds_once(
    fused, monkeypatch
):
    """Where oneDNN has no bfloat16 kernels, the product of a bfloat16 input and weight is their
    float32 product rounded to bfloat16, and the packed copy is float32."""
    monkeypatch.setattr(linear, "packed_dtype", lambda dtype: torch.float32)
    generator = torch.Generator().manual_seed(3)
    layers = [PackedLinear(64, n).to(torch.bfloat16) for n in (40, 24)]
    product = FusedProjections(layers) if fused else layers[0]
    weight = torch.cat([layer.weight for layer in layers]) if fused else layers[0].weight
    x = torch.randn(7, 64, generator=generator).to(torch.bfloat16)
    with torch.inference_mode():
        out = product(x)
    assert out.dtype == torch.bfloat16
    assert product._packed.dtype == torch.float32
    expected = (x.float() @ weight.detach().float().T).to(torch.bfloat16)
    # float32 sums in another order may round the other way: at most one bfloat16 step apart.
    torch.testing.assert_close(out, expected, atol=0, rtol=2**-7)
    assert (out == expected).float().mean() > 0.95


@pytest.mark.parametrize("pads", [True, False])  # the AVX-512 path and the others
@pytest.mark.parametrize("streamed_bytes", [0, None])  # every weight padded; the default
@pytest.mark.parametrize("shape", [(1, 24), (2, 24), (1, 2, 24), (0, 24)])
def test_products_of_fewer_rows_than_the_kernels_minimum_are_those_rows_alone(
    shape, streamed_bytes, pads, monkeypatch
):
    monkeypatch.setattr(linear, "pads_few_rows", lambda: pads)
    if streamed_bytes is not None:
        monkeypatch.setattr(linear, "STREAMED_WEIGHT_BYTES", streamed_bytes)
    generator = torch.Generator().manual_seed(2)
    layer = PackedLinear(24, 40)
    x = torch.randn(shape, generator=generator)
    assert x.numel() // 24 < linear.MIN_PRODUCT_ROWS
    with torch.inference_mode():
        out = layer(x)
    assert out.shape == (*shape[:-1], 40)
    torch.testing.assert_close(out, x @ layer.weight.T.detach(), atol=1e-5, rtol=1e-5)


def test_with_autograd_it_is_plain_linear():
    layer = PackedLinear(8, 3)
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()
    assert layer._packed is None
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(2, 8).detach())


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 0.0)])
def test_fused_projections_equal_the_layers_side_by_side_and_follow_weight_changes(dtype, atol):
    generator = torch.Generator().manual_seed(1)
    layers = [PackedLinear(24, n).to(dtype) for n in (40, 8, 8)]
    fused = FusedProjections(layers)
    x = torch.randn(5, 24, generator=generator).to(dtype)

    def separately() -> torch.Tensor:
        return torch.cat([x @ layer.weight.T for layer in layers], dim=-1)

    with torch.inference_mode():
        out = fused(x)
        assert out.shape == (5, 56)
        assert (fused._packed is not None) == packs(layers[0].weight)
        torch.testing.assert_close(out, separately(), atol=atol, rtol=atol)
        layers[1].weight.mul_(-3)  # one layer's weight changes in place
        torch.testing.assert_close(fused(x), separately(), atol=3 * atol, rtol=3 * atol)
    layers[2].load_state_dict({"weight": torch.randn(8, 24, generator=generator).to(dtype)})
    with torch.inference_mode():
        torch.testing.assert_close(fused(x), separately(), atol=atol, rtol=atol)


def test_fused_projections_with_autograd_call_the_layers():
    layers = [PackedLinear(8, 3), PackedLinear(8, 2)]
    x = torch.randn(2, 8, requires_grad=True)
    out = FusedProjections(layers)(x)
    out.sum().backward()
    assert out.shape == (2, 5)
    assert x.grad is not None
    torch.testing.assert_close(
        x.grad, (layers[0].weight.sum(0) + layers[1].weight.sum(0)).expand(2, 8).detach()
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: PackedLinear(16, 8),
        lambda: FusedProjections([PackedLinear(16, 8), PackedLinear(16, 4)]),
    ],
    ids=["packed-linear", "fused-projections"],
)
def test_pickles_without_the_packed_copy_and_packs_again(make):
    import pickle

    product = make()
    x = torch.randn(3, 16)
    with torch.inference_mode():
        before = product(x)
    copy = pickle.loads(pickle.dumps(product))
    assert copy._packed is None
    with torch.inference_mode():
        torch.testing.assert_close(copy(x), before, rtol=0, atol=0)


def test_a_model_packs_every_projection_up_front():
    """`pack_weights` makes the packed copies a first forward would make: the fused query/key/
    value and gate/up products and the output head, so nothing is packed while serving."""
    from blocktune.runtime.model import LlamaModel, ModelConfig

    model = LlamaModel(ModelConfig.tiny()).eval()
    if not packs(model.lm_head.weight):
        pytest.skip("oneDNN does not pack float32 here")
    fused = [p for layer in model.model.layers for p in (layer.self_attn.qkv, layer.mlp.gate_up)]
    assert all(p._packed is None for p in fused) and model.lm_head._packed is None
    model.pack_weights()
    assert all(p._packed is not None for p in fused) and model.lm_head._packed is not None

"""PackedLinear: the products of nn.Linear through a packed weight, repacked when it changes."""

import pytest
import torch

from blocktune.runtime.linear import PackedLinear, packs


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


def test_with_autograd_it_is_plain_linear():
    layer = PackedLinear(8, 3)
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()
    assert layer._packed is None
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(2, 8).detach())


def test_a_packed_layer_pickles_without_its_packed_copy_and_packs_again():
    import pickle

    layer = PackedLinear(16, 8)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        before = layer(x)
    copy = pickle.loads(pickle.dumps(layer))
    assert copy._packed is None
    with torch.inference_mode():
        torch.testing.assert_close(copy(x), before, rtol=0, atol=0)

import pytest
import torch

from distbelief.exceptions import ConfigError
from distbelief.ps.sharding import ShardLayout, bind_flat, flatten, param_specs, unflatten_into
from tests.conftest import OddModel


@pytest.mark.parametrize("k", range(1, 8))
def test_flatten_split_reassemble_is_exact(k):
    torch.manual_seed(k)
    model = OddModel()
    flat = flatten(model)
    layout = ShardLayout.balanced(flat.numel(), k)
    pieces = [flat[lo:hi].clone() for lo, hi in (layout.range(i) for i in range(k))]
    assert sum(p.numel() for p in pieces) == flat.numel()
    other = OddModel()
    unflatten_into(other, torch.cat(pieces))
    for (na, a), (nb, b) in zip(model.named_parameters(), other.named_parameters()):
        assert na == nb and torch.equal(a, b)
    sizes = layout.sizes()
    assert max(sizes) - min(sizes) <= max(1, 0.01 * max(sizes))


def test_balance_within_one_percent_on_big_model():
    layout = ShardLayout.balanced(42_000_007, 7)
    sizes = layout.sizes()
    assert (max(sizes) - min(sizes)) / max(sizes) < 0.01
    assert layout.bounds[0] == 0 and layout.bounds[-1] == 42_000_007


def test_a_tensor_may_span_shards():
    model = OddModel()
    specs = param_specs(model)
    layout = ShardLayout.balanced(sum(s.numel for s in specs), 5)
    big = specs[0]  # a.weight: 91 elements, more than one shard's ~59
    assert len(layout.shards_overlapping(big.offset, big.offset + big.numel)) >= 2


def test_more_shards_than_parameters_is_an_error():
    with pytest.raises(ConfigError, match="shards"):
        ShardLayout.balanced(10, 11)
    with pytest.raises(ConfigError, match="shards"):
        ShardLayout.balanced(10, 0)


def test_bind_flat_makes_parameters_and_grads_views():
    model = OddModel()
    before = flatten(model)
    flat, grads = bind_flat(model)
    assert torch.equal(flat, before)
    flat.add_(1.0)
    assert torch.equal(flatten(model), before + 1.0)
    model(torch.randn(4, 7)).sum().backward()
    assert grads.abs().sum() > 0
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in model.parameters()]), grads)


def test_bind_flat_onto_given_buffers_keeps_values_and_zeroes_grads():
    model = OddModel()
    before = flatten(model)
    n = before.numel()
    flat_buf, grad_buf = torch.full((n,), 7.0), torch.full((n,), 3.0)
    flat, grads = bind_flat(model, flat_buf, grad_buf)
    assert flat.data_ptr() == flat_buf.data_ptr() and grads.data_ptr() == grad_buf.data_ptr()
    assert torch.equal(flat_buf, before) and not grad_buf.any()
    flat_buf.mul_(2.0)  # a shard writing a fetch into the buffer changes the model with no copy
    assert torch.equal(flatten(model), before * 2.0)
    model(torch.randn(4, 7)).sum().backward()
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in model.parameters()]), grad_buf)


@pytest.mark.parametrize("make_bad", [lambda n: torch.zeros(n - 1), lambda n: torch.zeros(n, dtype=torch.float64),
                                      lambda n: torch.zeros(1, n)], ids=["short", "float64", "2-D"])
def test_bind_flat_rejects_a_buffer_of_the_wrong_size_or_type(make_bad):
    model = OddModel()
    n = flatten(model).numel()
    with pytest.raises(ValueError, match=f"flat must be a 1-D float32 tensor of {n} elements"):
        bind_flat(model, make_bad(n))
    with pytest.raises(ValueError, match=f"grads must be a 1-D float32 tensor of {n} elements"):
        bind_flat(model, None, make_bad(n))

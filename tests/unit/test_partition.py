"""Model parallelism without processes: the partitioned model equals the unpartitioned one, messages are exact.

Oracles: (1) the same layer stack run as one partition (``PartitionedModel.forward``), (2) independent plain-torch
implementations (``nn.Linear``, ``F.unfold``, an explicit loop, ``F.avg_pool`` with ``count_include_pad=False``)
fed the model's canonical parameters, and (3) analytic halo sizes for the bytes exchanged.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from distbelief.exceptions import ConfigError
from distbelief.partition import (
    Activation,
    AvgPool,
    ExchangePlan,
    FullyConnected,
    LocalContrastNorm,
    LocallyConnected1d,
    LocallyConnected2d,
    Logistic,
    MaxPool,
    PartitionedExecutor,
    PartitionedModel,
    PartitionSpec,
    Softmax,
    one_vs_all_loss,
)
from distbelief.partition.layers import box_empty, box_volume, intersect

pytestmark = pytest.mark.timeout(120)

PARTITIONS = (1, 2, 3, 4)
B = 3

# name -> (input shape, layer stack factory, loss). Each stack exercises one layer type; the last ones mix.
STACKS = {
    "fully_connected": ((11,), lambda: [FullyConnected(9), FullyConnected(4)], F.cross_entropy),
    "lc1d": ((1, 20), lambda: [LocallyConnected1d(3, 4, 1), LocallyConnected1d(2, 3, 2)], F.cross_entropy),
    "lc2d": ((2, 9, 8), lambda: [LocallyConnected2d(3, 3, 1), LocallyConnected2d(2, (2, 3), (2, 1))],
             F.cross_entropy),
    "maxpool1d": ((2, 21), lambda: [LocallyConnected1d(2, 2, 1), MaxPool(3, 2)], F.cross_entropy),
    "avgpool2d": ((1, 10, 9), lambda: [LocallyConnected2d(2, 2, 1), AvgPool(2)], F.cross_entropy),
    "lcn1d": ((2, 24), lambda: [LocallyConnected1d(3, 3, 1), LocalContrastNorm(2)], F.cross_entropy),
    "lcn2d": ((1, 11, 10), lambda: [LocallyConnected2d(2, 2, 1), LocalContrastNorm(1)], F.cross_entropy),
    "activations": ((1, 16), lambda: [LocallyConnected1d(2, 3, 1), Activation("relu"), LocallyConnected1d(2, 2, 1),
                                      Activation("sigmoid"), LocallyConnected1d(1, 2, 1), Activation("tanh")],
                    F.cross_entropy),
    "softmax": ((1, 12), lambda: [LocallyConnected1d(1, 3, 1), Softmax()], F.nll_loss),
    "logistic": ((8,), lambda: [FullyConnected(6), Logistic()], one_vs_all_loss),
    "mixed_1d": ((40,), lambda: [LocallyConnected1d(4, 5, 1), Activation("tanh"), LocalContrastNorm(1),
                                 MaxPool(2), LocallyConnected1d(3, 3, 2), AvgPool(2, 1), FullyConnected(7),
                                 Activation("sigmoid"), FullyConnected(3), Softmax()], F.nll_loss),
    "mixed_2d": ((2, 14, 13), lambda: [LocallyConnected2d(3, 3, 1), Activation("relu"), LocalContrastNorm(1),
                                       MaxPool(2), LocallyConnected2d(4, (3, 2), (2, 1)), AvgPool(2, 1),
                                       FullyConnected(5), Logistic()], one_vs_all_loss),
}


def build(name, P, seed=1):
    shape, stack, _ = STACKS[name]
    torch.manual_seed(seed)
    return PartitionedModel(shape, stack(), P)


def batch(name, seed=0):
    shape, _, loss_fn = STACKS[name]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, *shape, generator=g)
    ref = build(name, 1)
    n_out = ref(x).shape[1]
    y = torch.randint(0, n_out, (B,), generator=g)
    return x, y, loss_fn


@pytest.mark.parametrize("name", list(STACKS))
@pytest.mark.parametrize("P", PARTITIONS)
def test_partitioned_outputs_and_gradients_equal_single_partition(name, P):
    x, y, loss_fn = batch(name)
    ref = build(name, 1)
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward()
    model = build(name, P)
    with PartitionedExecutor(model, timeout_s=30) as ex:
        res = ex.step(x, y, loss_fn)
    torch.testing.assert_close(res.output, ref(x).detach(), atol=1e-5, rtol=1e-5)
    assert res.loss == pytest.approx(ref_loss.item(), abs=1e-5)
    for i, (want, got) in enumerate(zip(ref.canonical_grads(), model.canonical_grads())):
        assert want.keys() == got.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5, msg=f"layer {i} {k}")
    if P == 1:
        assert res.bytes_sent == [0] and res.messages_sent == [0]


@pytest.mark.parametrize("name", ["mixed_1d", "mixed_2d"])
def test_forward_only_step_sends_no_gradients(name):
    x, _, _ = batch(name)
    model = build(name, 3)
    with PartitionedExecutor(model, timeout_s=30) as ex:
        res = ex.step(x, backward=False)
    torch.testing.assert_close(res.output, build(name, 1)(x).detach(), atol=1e-5, rtol=1e-5)
    assert all(ph["backward"] == 0 for ph in res.bytes_by_phase)
    assert all(p.grad is None for p in model.parameters())


# ----------------------------------------------------------------------------- independent plain-torch oracles
def _lc1d_loop(x, w, b, k, s):
    """Locally connected 1-D by an explicit loop over output positions (w: (L_out, C_out, C_in*k))."""
    outs = []
    for pos in range(w.shape[0]):
        patch = x[:, :, pos * s: pos * s + k].reshape(x.shape[0], -1)  # (B, C_in*k), channel-major like unfold
        outs.append(patch @ w[pos].t() + b[pos])
    return torch.stack(outs, dim=2)  # (B, C_out, L_out)


def _lc2d_unfold(x, w, b, k, s):
    """Locally connected 2-D via F.unfold (im2col) (w: (H_out, W_out, C_out, C_in*kh*kw))."""
    cols = F.unfold(x, k, stride=s)  # (B, C_in*kh*kw, H_out*W_out)
    ho, wo, co, _ = w.shape
    y = torch.einsum("bkl,lok->bol", cols, w.reshape(ho * wo, co, -1)) + b.reshape(ho * wo, co).t()
    return y.reshape(x.shape[0], co, ho, wo)


def _lcn_ref(x, r, eps):
    """LCN with torch pooling: mean over valid window positions and all channels."""
    pool = F.avg_pool1d if x.dim() == 3 else F.avg_pool2d
    mean = lambda t: pool(t.mean(1, keepdim=True), 2 * r + 1, 1, r, count_include_pad=False)  # noqa: E731
    v = x - mean(x)
    return v / torch.sqrt(mean(v * v) + eps)


@pytest.mark.parametrize("P", PARTITIONS)
def test_fully_connected_equals_nn_linear(P):
    torch.manual_seed(3)
    model = PartitionedModel((10,), [FullyConnected(8), Activation("sigmoid"), FullyConnected(5)], P)
    (w1, b1), (w2, b2) = [(p["weight"], p["bias"]) for p in model.canonical_params() if p]
    lin1, lin2 = torch.nn.Linear(10, 8), torch.nn.Linear(8, 5)
    with torch.no_grad():
        lin1.weight.copy_(w1), lin1.bias.copy_(b1), lin2.weight.copy_(w2), lin2.bias.copy_(b2)
    x, y = torch.randn(B, 10), torch.tensor([0, 4, 2])
    F.cross_entropy(lin2(torch.sigmoid(lin1(x))), y).backward()
    with PartitionedExecutor(model) as ex:
        res = ex.step(x, y, F.cross_entropy)
    torch.testing.assert_close(res.output, lin2(torch.sigmoid(lin1(x))).detach(), atol=1e-5, rtol=1e-5)
    g = model.canonical_grads()
    for want, got in ((lin1.weight.grad, g[0]["weight"]), (lin1.bias.grad, g[0]["bias"]),
                      (lin2.weight.grad, g[2]["weight"]), (lin2.bias.grad, g[2]["bias"])):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("P", PARTITIONS)
def test_locally_connected_1d_equals_explicit_loop(P):
    torch.manual_seed(4)
    model = PartitionedModel((2, 23), [LocallyConnected1d(3, 4, 1), LocallyConnected1d(2, 3, 2)], P)
    params = [{k: v.requires_grad_(True) for k, v in p.items()} for p in model.canonical_params()]
    x, y = torch.randn(B, 2, 23), torch.tensor([1, 0, 7])
    h = _lc1d_loop(x, params[0]["weight"], params[0]["bias"], 4, 1)
    out = _lc1d_loop(h, params[1]["weight"], params[1]["bias"], 3, 2).reshape(B, -1)
    F.cross_entropy(out, y).backward()
    with PartitionedExecutor(model) as ex:
        res = ex.step(x, y, F.cross_entropy)
    torch.testing.assert_close(res.output, out.detach(), atol=1e-5, rtol=1e-5)
    for want, got in zip(params, model.canonical_grads()):
        for k in want:
            torch.testing.assert_close(got[k], want[k].grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("P", PARTITIONS)
def test_locally_connected_2d_with_pooling_and_lcn_equals_unfold_reference(P):
    torch.manual_seed(5)
    model = PartitionedModel((2, 12, 11), [LocallyConnected2d(3, 3, 1), MaxPool(2), LocalContrastNorm(1, 0.1),
                                           LocallyConnected2d(2, 2, (1, 2))], P)
    params = [{k: v.requires_grad_(True) for k, v in p.items()} for p in model.canonical_params()]
    x = torch.randn(B, 2, 12, 11)
    h = _lc2d_unfold(x, params[0]["weight"], params[0]["bias"], (3, 3), (1, 1))
    h = _lcn_ref(F.max_pool2d(h, 2), 1, 0.1)
    out = _lc2d_unfold(h, params[3]["weight"], params[3]["bias"], (2, 2), (1, 2)).reshape(B, -1)
    y = torch.tensor([0, 5, 9])
    F.cross_entropy(out, y).backward()
    with PartitionedExecutor(model) as ex:
        res = ex.step(x, y, F.cross_entropy)
    torch.testing.assert_close(res.output, out.detach(), atol=1e-5, rtol=1e-5)
    for want, got in zip(params, model.canonical_grads()):
        for k in want:
            torch.testing.assert_close(got[k], want[k].grad, atol=1e-5, rtol=1e-5)


def test_softmax_layer_is_log_softmax_of_all_units():
    torch.manual_seed(6)
    model = PartitionedModel((6,), [FullyConnected(5), Softmax()], 2)
    x = torch.randn(B, 6)
    p = model.canonical_params()[0]
    torch.testing.assert_close(model(x), torch.log_softmax(x @ p["weight"].t() + p["bias"], 1), atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- messaging: exact byte counts
def test_lc1d_bytes_equal_analytic_halo():
    """Band split of stride-1 LC layers: each inner boundary sends (k-1) positions x channels, once."""
    kernels, channels = (5, 3, 3), (4, 6, 2)
    layers = [LocallyConnected1d(c, k, 1) for c, k in zip(channels, kernels)]
    for P in (2, 3, 4):
        torch.manual_seed(0)
        model = PartitionedModel((1, 60), layers, P)
        x, y = torch.randn(B, 60), torch.zeros(B, dtype=torch.long)
        with PartitionedExecutor(model) as ex:
            res = ex.step(x, y, F.cross_entropy)
        # layer i >= 1 reads a halo of (k_i - 1) positions of layer i-1 (channels[i-1]) across each boundary
        halo_units = sum((P - 1) * (kernels[i] - 1) * channels[i - 1] for i in range(1, len(layers)))
        assert sum(ph["forward"] for ph in res.bytes_by_phase) == halo_units * B * 4
        assert sum(ph["backward"] for ph in res.bytes_by_phase) == halo_units * B * 4
        out_units = model.plan.shapes[-1][0] * model.plan.shapes[-1][1]
        head_units = model.plan.shapes[-1][0] * (model.plan.regions[-1][0][0][1] - model.plan.regions[-1][0][0][0])
        # the output is gathered on the head once, and its gradient scattered once
        assert sum(ph["output"] for ph in res.bytes_by_phase) == 2 * (out_units - head_units) * B * 4


@pytest.mark.parametrize("grid", [(2, 1), (1, 2)])
def test_lc2d_bytes_equal_analytic_halo(grid):
    """Two tiles split along one axis: the boundary sends (k-1) rows (or columns) x the other extent x C."""
    torch.manual_seed(0)
    C, k = 3, 3
    model = PartitionedModel((1, 14, 12), [LocallyConnected2d(C, 3, 1), LocallyConnected2d(2, k, 1)],
                             PartitionSpec(2, grid=grid))
    h, w = model.plan.shapes[1][1:]
    other_extent = w if grid == (2, 1) else h
    with PartitionedExecutor(model) as ex:
        res = ex.step(torch.randn(B, 1, 14, 12), torch.zeros(B, dtype=torch.long), F.cross_entropy)
    assert sum(ph["forward"] for ph in res.bytes_by_phase) == (k - 1) * other_extent * C * B * 4
    assert res.bytes_by_phase[0]["backward"] == res.bytes_by_phase[1]["forward"]


@pytest.mark.parametrize("P", (2, 3, 4))
def test_fully_connected_sends_each_unit_once_per_destination_not_once_per_edge(P):
    D, F_out = 12, 9
    torch.manual_seed(0)
    model = PartitionedModel((5,), [FullyConnected(D), FullyConnected(F_out)], P)
    with PartitionedExecutor(model) as ex:
        res = ex.step(torch.randn(B, 5), torch.zeros(B, dtype=torch.long), F.cross_entropy)
    # every partition needs all D units of layer 0 and receives the (D - own) it lacks, once each
    assert sum(ph["forward"] for ph in res.bytes_by_phase) == (P - 1) * D * B * 4
    # one message per (owner, destination) pair in the forward pass, not one per edge
    assert sum(len(ts) for ts in model.plan.sends[1]) == P * (P - 1)


@pytest.mark.parametrize("name", ["mixed_1d", "mixed_2d", "lcn2d"])
@pytest.mark.parametrize("P", (2, 3, 4))
def test_plan_delivers_each_needed_unit_exactly_once(name, P):
    model = build(name, P)
    plan = model.plan
    for i in range(1, plan.num_layers):
        for dst in range(P):
            need, own = plan.needs[i][dst], plan.regions[i - 1][dst]
            ts = plan.recvs[i][dst]
            assert len({t.src for t in ts}) == len(ts)  # one transfer per source partition
            for a in range(len(ts)):
                for b in range(a + 1, len(ts)):
                    assert box_empty(intersect(ts[a].box, ts[b].box))  # no unit twice
            own_vol = 0 if box_empty(intersect(need, own)) else box_volume(intersect(need, own))
            got = sum(box_volume(t.box) for t in ts)
            assert got + own_vol == (0 if box_empty(need) else box_volume(need))


def test_locally_connected_needs_only_a_halo():
    plan = ExchangePlan.build((1, 100), [LocallyConnected1d(2, 5, 1), LocallyConnected1d(2, 7, 1)],
                              PartitionSpec(4))
    for dst in range(4):
        assert all(t.src in (dst - 1, dst + 1) for t in plan.recvs[1][dst])  # neighbours only
    # bands of layers 0 (96 positions) and 1 (90) do not align, but each of the 3 boundaries still moves k-1 = 6
    assert sum(box_volume(t.box) for ts in plan.recvs[1] for t in ts) == 3 * 6


# ----------------------------------------------------------------------------- parameter layout
@pytest.mark.parametrize("P", (2, 3, 4))
def test_each_partition_owns_one_contiguous_flat_range_and_init_does_not_depend_on_P(P):
    ref, model = build("mixed_2d", 1), build("mixed_2d", P)
    ranges = model.partition_ranges()
    total = sum(p.numel() for p in model.parameters())
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(ranges[k][1] == ranges[k + 1][0] for k in range(P - 1))
    flat_names = [n for n, _ in model.named_parameters()]
    for p in range(P):  # the names in partition p's range are exactly partition p's parameters
        lo, hi, off = *ranges[p], 0
        for n, t in model.named_parameters():
            if lo <= off < hi:
                assert n.startswith(f"parts.{p}.")
            off += t.numel()
    assert len(flat_names) == len(set(flat_names))
    for a, b in zip(ref.canonical_params(), model.canonical_params()):
        for k in a:
            assert torch.equal(a[k], b[k])


def test_empty_regions_when_a_layer_has_fewer_units_than_partitions():
    # 3 output classes over 4 partitions: one partition owns no output unit and sends nothing for it.
    x, y, loss_fn = batch("fully_connected")
    model = PartitionedModel((11,), [FullyConnected(9), FullyConnected(3)], 4)
    assert sum(box_empty(r) for r in model.plan.regions[-1]) == 1
    with PartitionedExecutor(model) as ex:
        res = ex.step(x, y.clamp(max=2), loss_fn)
    assert math.isfinite(res.loss)


def test_bad_partition_settings_name_the_field():
    with pytest.raises(ConfigError, match="partitions"):
        PartitionSpec(0)
    with pytest.raises(ConfigError, match="partitions"):
        PartitionSpec(4, grid=(3, 1))


def test_partition_messaging_metrics_per_step_average_the_replicas():
    """Each partition's bytes, messages and process CPU per step (the head's steps count a replica's steps),
    averaged over replicas, as summary.json has them."""
    from distbelief.partition.stats import messaging_metrics
    from distbelief.runtime.group_stats import merge_partition_stats

    def part(pid, steps, sent, msgs, cpu):
        return {"partition_id": pid, "num_parameters": 10, "bytes_sent": sent, "messages_sent": msgs,
                "bytes_by_phase": {}, "compute_s": 2 * cpu, "compute_cpu_s": cpu, "wait_s": 0.0, "replica_id": 0,
                "steps": steps, "examples": steps * 4, "pushes": steps, "loss_ema": 1.0, "acked": []}

    r0 = merge_partition_stats([part(1, 0, 400, 20, 3.0), part(0, 10, 800, 40, 2.0)])
    r1 = merge_partition_stats([part(0, 20, 800, 40, 4.0), part(1, 0, 400, 20, 8.0)])
    m = messaging_metrics([r0, r1, {"steps": 5}])  # (a replica without partitions is left out)
    assert m["partition_bytes_per_step"] == [(80 + 40) / 2, (40 + 20) / 2]
    assert m["partition_messages_per_step"] == [(4 + 2) / 2, (2 + 1) / 2]
    assert m["partition_cpu_s_per_step"] == [(0.2 + 0.2) / 2, (0.3 + 0.4) / 2]

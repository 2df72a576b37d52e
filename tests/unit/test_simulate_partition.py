"""The model-parallel step simulator (simulate/partition.py) and the paper's models (simulate/paper.py).

Oracles, no wall clock: the real partitions' message counts (``PartitionedExecutor``), box arithmetic for fully
connected and locally connected splits, exact division of a balanced model's compute, and the paper's parameter
counts.
"""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from distbelief.exceptions import ConfigError
from distbelief.partition import (
    Activation,
    FullyConnected,
    LocalContrastNorm,
    LocallyConnected2d,
    MaxPool,
    PartitionedExecutor,
    PartitionedModel,
)
from distbelief.simulate.costs import Costs
from distbelief.simulate.machines import Machines
from distbelief.simulate.partition import fig3_curve, partition_step
from distbelief.simulate.profile import profile_layers, profile_model

pytestmark = pytest.mark.timeout(120)

B = 4
FREE = Costs(step_s=0.0, example_s=0.0, call_s=0.0, local_object_cpu_s_per_byte=0.0)  # compute only: no messages
FREE_LINKS = Machines(cores_per_node=1)  # infinite bandwidth, no latency


def costs(**kw) -> Costs:
    return Costs(macs_per_s={"dense": 1e9, "local": 2e8, "other": 5e8, "elementwise": 1e8}, step_s=1e-3, example_s=1e-5,
                 call_s=2e-4, **kw)


LINKS = Machines(cores_per_node=2, bandwidth=1e8, latency_s=1e-4)


def mixed_2d():
    return profile_layers("mixed", (2, 14, 13), [
        LocallyConnected2d(3, 3, 1), Activation("relu"), LocalContrastNorm(1), MaxPool(2),
        LocallyConnected2d(4, (3, 2), (2, 1)), FullyConnected(5)])


def test_one_partition_sends_nothing_and_its_step_is_its_compute():
    for profile in (mixed_2d(), profile_layers("fc", (1, 7), [FullyConnected(6), FullyConnected(3)])):
        s = partition_step(profile, 1, B, costs(), LINKS)
        assert s.message_bytes == (0,) and s.messages == (0,) and s.message_path_s == 0
        assert s.seconds == pytest.approx(s.compute_s[0], rel=1e-12)
        assert s.bottleneck == "compute"


@pytest.mark.parametrize("P", (2, 3, 4))
def test_fully_connected_split_sends_each_partition_units_to_the_others(P):
    """D hidden units in P bands: each partition sends its D/P units to the P-1 others (forward) and gets the
    gradients of theirs back (backward); the head gathers the F outputs and scatters their gradients."""
    D, F_out = 12, 24
    s = partition_step(profile_layers("fc", (1, 5), [FullyConnected(D), Activation("sigmoid"),
                                                     FullyConnected(F_out)]), P, B, costs(), LINKS)
    forward = backward = (P - 1) * D // P
    assert s.message_bytes[0] == (forward + backward + (P - 1) * F_out // P) * B * 4
    assert all(b == (forward + backward + F_out // P) * B * 4 for b in s.message_bytes[1:])
    assert s.messages == (3 * (P - 1),) + (2 * (P - 1) + 1,) * (P - 1)


def test_locally_connected_halo_bytes_equal_the_box_arithmetic():
    """Two row bands of a 12x10 map (3 channels) read by 4x4 filters: layer 1's rows [0, 5) need input rows
    [0, 8), two of them (6, 7) owned by partition 1; its rows [5, 9) need [5, 12), one (5) owned by partition 0."""
    profile = profile_layers("lc", (1, 14, 12), [LocallyConnected2d(3, 3, 1), LocallyConnected2d(2, 4, 1)])
    s = partition_step(profile, 2, B, costs(), LINKS)
    row = 10 * 3  # units of one row of layer 0's output
    out_rows_1 = 4 * 7 * 2  # partition 1's rows of the 9x7x2 output, gathered on the head
    assert s.message_bytes == ((1 * row + 2 * row + out_rows_1) * B * 4, (2 * row + 1 * row + out_rows_1) * B * 4)
    assert s.messages == (3, 3)


@pytest.mark.parametrize("P", (2, 3, 4))
def test_bytes_and_messages_equal_what_the_real_partitions_send(P):
    profile = mixed_2d()
    torch.manual_seed(0)
    model = PartitionedModel(profile.input_shape, list(profile.layers), P)
    with PartitionedExecutor(model) as ex:
        res = ex.step(torch.randn(B, *profile.input_shape), torch.zeros(B, dtype=torch.long), F.cross_entropy)
    s = partition_step(profile, P, B, costs(), LINKS)
    assert list(s.message_bytes) == res.bytes_sent
    assert list(s.messages) == res.messages_sent


@pytest.mark.parametrize("P", (2, 3, 4, 6))
def test_balanced_model_is_exactly_P_times_faster_with_free_links(P):
    profile = profile_layers("fc", (1, 10), [FullyConnected(24), Activation("relu"), FullyConnected(48),
                                             Activation("sigmoid"), FullyConnected(12)])
    one = partition_step(profile, 1, B, FREE, FREE_LINKS)
    s = partition_step(profile, P, B, FREE, FREE_LINKS)
    assert s.message_path_s == 0 and sum(s.messages) > 0
    assert s.seconds == pytest.approx(one.seconds / P, rel=1e-12)
    assert s.compute_s == pytest.approx([one.compute_s[0] / P] * P, rel=1e-12)


def test_on_one_machine_an_exchange_pays_the_object_stores_cpu_per_byte_sent_and_received():
    """No link (the partitions share a machine): an exchange costs its slowest partition its bytes out and in at
    half the object store's CPU per byte each. Two bands of a fully connected stack send and receive alike in
    every hidden exchange; the gather and the scatter move the non-head band's outputs one way."""
    D, F_out, per_byte = 12, 24, 1e-6
    profile = profile_layers("fc", (1, 5), [FullyConnected(D), Activation("sigmoid"), FullyConnected(F_out)])
    only_bytes = Costs(step_s=0.0, example_s=0.0, call_s=0.0, local_object_cpu_s_per_byte=per_byte)
    s = partition_step(profile, 2, B, only_bytes, FREE_LINKS)
    hidden = 2 * (D // 2) * B * 4 * per_byte  # forward and backward: D/2 units out and D/2 in, half the CPU each
    ends = 2 * (F_out // 2) * B * 4 * per_byte / 2  # gather and scatter: F/2 units one way
    assert s.message_path_s == pytest.approx(hidden + ends, rel=1e-12)
    # with a link the bytes are the link's, at its rate, and the object store's CPU is not charged again
    link = Machines(cores_per_node=1, bandwidth=1e8)
    assert partition_step(profile, 2, B, only_bytes, link).message_path_s == pytest.approx(
        (2 * (D // 2) + 2 * (F_out // 2)) * B * 4 / (link.bytes_per_s * only_bytes.link_efficiency), rel=1e-12)


def test_partitions_sharing_a_machine_pay_the_measured_message_cost_and_others_a_calls():
    """``partition_message_s`` (measured in real model-parallel steps on one machine) replaces ``call_s`` per
    message where the partitions share a machine; across a link a message still costs ``call_s``; not measured
    (None), ``call_s`` everywhere. Six messages on the path of a two-layer stack's step over two partitions: each
    layer's input exchanged forward and its gradient backward, the gather and the scatter."""
    D, F_out = 12, 24
    profile = profile_layers("fc", (1, 5), [FullyConnected(D), Activation("sigmoid"), FullyConnected(D),
                                            Activation("sigmoid"), FullyConnected(F_out)])
    calls = dataclasses.replace(FREE, call_s=1e-3)
    measured = dataclasses.replace(calls, partition_message_s=5e-3)
    link = Machines(cores_per_node=1, bandwidth=1e30)
    assert partition_step(profile, 2, B, calls, FREE_LINKS).message_path_s == pytest.approx(6e-3)
    assert partition_step(profile, 2, B, measured, FREE_LINKS).message_path_s == pytest.approx(30e-3)
    assert partition_step(profile, 2, B, measured, link).message_path_s == pytest.approx(6e-3)
    with pytest.raises(ConfigError, match="partition_message_s"):
        dataclasses.replace(measured, partition_message_s=-1.0).check()
    assert measured.scaled(2.0).partition_message_s == pytest.approx(10e-3)
    assert calls.scaled(2.0).partition_message_s is None


def test_a_model_the_calibration_timed_is_partitioned_at_its_timed_pace():
    """Its multiply-adds take the timed step's time (less the fixed costs), split over the partitions as the fit
    splits them (as ``compute_seconds`` does for an unpartitioned replica)."""
    profile = profile_model("speech-tiny", "speech", 8192)
    c = costs()
    fitted = partition_step(profile, 1, 128, c, FREE_LINKS).seconds
    timed = dataclasses.replace(c, step_measured={f"speech-tiny:{profile.params}": {"128": 3 * fitted}})
    fixed = c.step_s + 128 * c.example_s
    assert partition_step(profile, 1, 128, timed, FREE_LINKS).seconds == pytest.approx(3 * fitted, rel=1e-9)
    two, two_fit = (partition_step(profile, 2, 128, k, FREE_LINKS) for k in (timed, c))
    assert [t - fixed for t in two.compute_s] == pytest.approx(
        [(f - fixed) * (3 * fitted - fixed) / (fitted - fixed) for f in two_fit.compute_s], rel=1e-9)
    assert two.message_path_s == two_fit.message_path_s


@pytest.mark.parametrize("P", (1, 2, 3, 8))
@pytest.mark.parametrize("sigma", (0.05, 0.5))
def test_jitter_never_makes_a_step_faster_on_average(P, sigma):
    profile = mixed_2d()
    plain = partition_step(profile, P, B, costs(), LINKS)
    for seed in range(3):
        s = partition_step(profile, P, B, costs(), LINKS, jitter=sigma, seed=seed)
        assert s.seconds >= plain.seconds * (1 - 1e-12)
        assert s.straggler_s == pytest.approx(s.seconds - plain.seconds, rel=1e-9)
        assert s == partition_step(profile, P, B, costs(), LINKS, jitter=sigma, seed=seed)  # seeded


def test_cores_divide_compute_and_shared_cores_are_time_shared():
    profile = mixed_2d()
    one_core = partition_step(profile, 4, B, FREE, FREE_LINKS).compute_s
    assert partition_step(profile, 4, B, FREE, FREE_LINKS, cores_per_partition=4).compute_s == \
        pytest.approx([c / 4 for c in one_core], rel=1e-12)
    shared = Machines(cores_per_node=1, shared_cores=2)  # 4 partitions on 2 cores: half a core each
    assert partition_step(profile, 4, B, FREE, shared).compute_s == pytest.approx([c * 2 for c in one_core])


def test_dense_profile_without_layers_is_partitioned_like_build_partitioned():
    from distbelief.simulate.paper import speech_profile

    shipped = profile_model("speech-paper", "speech")
    assert not shipped.layers
    a, b = (partition_step(p, 4, B, costs(), LINKS) for p in (shipped, speech_profile()))
    assert a == b
    with pytest.raises(ConfigError, match="cannot be partitioned"):
        partition_step(profile_model("cnn", "mnist1d"), 2, B, costs(), LINKS)


def test_fig3_curve_speedup_is_relative_to_one_partition():
    rows = fig3_curve(mixed_2d(), [1, 2, 4], B, costs(), LINKS, jitter=0.1)
    assert [r["P"] for r in rows] == [1, 2, 4] and rows[0]["speedup"] == 1.0
    assert rows[2]["speedup"] == pytest.approx(rows[0]["step_s"] / rows[2]["step_s"])
    plain = fig3_curve(mixed_2d(), [1, 2, 4], B, costs(), LINKS)
    assert [r["speedup_no_jitter"] for r in rows] == pytest.approx([r["speedup"] for r in plain], rel=1e-12)


def test_paper_models_have_the_papers_parameter_counts():
    from distbelief.simulate.paper import image_profile, speech_profile

    assert speech_profile().params == pytest.approx(42e6, rel=0.01)
    assert speech_profile().params == profile_model("speech-paper", "speech").params
    image = image_profile()
    assert image.params == pytest.approx(1.7e9, rel=0.05)
    assert image.macs["local"] > 0.9 * image.macs_per_example  # a locally connected model


def test_paper_scale_writes_the_figure_and_its_numbers(tmp_path):
    from distbelief.simulate.paper import IMAGE_PARTITIONS, SPEECH_PARTITIONS, paper_scale

    results = paper_scale(tmp_path, Costs())
    assert json.loads((tmp_path / "fig3-paper-scale.json").read_text()) == results
    assert (tmp_path / "fig3-paper-scale.png").stat().st_size > 0
    speech, image, image_ours = results["models"]
    for m, counts in ((speech, SPEECH_PARTITIONS), (image, IMAGE_PARTITIONS)):
        assert m["paper"] and [r["P"] for r in m["rows"]] == counts
        assert m["rows"][0]["speedup"] == 1.0 and m["rows"][0]["speedup_no_jitter"] == 1.0
    # the locally connected model partitions far better than the fully connected one (paper §3)
    assert max(r["speedup"] for r in image["rows"]) > 2 * max(r["speedup"] for r in speech["rows"])
    # with our slower locally connected kernels there is more compute to spread over the same messages
    assert [r["P"] for r in image_ours["rows"]] == IMAGE_PARTITIONS
    assert image_ours["local_macs_per_s"] < image["local_macs_per_s"]
    assert image_ours["rows"][-1]["speedup"] > image["rows"][-1]["speedup"]

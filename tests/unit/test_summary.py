"""The typed run summary: every run's fields always written, the others only where they apply; unknown keys
refused."""

import pytest

from distbelief.summary import RunSummary, rate

EVERY_RUN = dict(strategy="sgd", runtime="single-process", replicas=1, num_parameters=10,
                 final_test_accuracy=0.5, best_test_accuracy=0.6, target_accuracy=None, time_to_target_s=None,
                 examples=100, examples_per_s=50.0, updates=4, steps_per_replica=[4], stop_reason="step limit reached",
                 wall_s=2.0)


def test_fields_that_do_not_apply_are_left_out_but_every_run_field_is_written():
    d = RunSummary(**EVERY_RUN).to_dict()
    assert d == {**EVERY_RUN, "events": []}  # no staleness, shards, restarts... for a single process
    assert d["time_to_target_s"] is None and d["target_accuracy"] is None  # "not reached" is information


def test_a_measured_zero_is_kept():
    d = RunSummary(**EVERY_RUN, shards=2, staleness_mean=0.0, staleness_max=0, replicas_lost=0).to_dict()
    assert (d["shards"], d["staleness_mean"], d["staleness_max"], d["replicas_lost"]) == (2, 0.0, 0, 0)
    assert "rejected_pushes" not in d


def test_an_unknown_field_is_refused():
    with pytest.raises(TypeError):
        RunSummary(**EVERY_RUN, stalenes_mean=0.0)


def test_rate():
    assert rate(100, 4.0) == 25.0 and rate(100, 0.0) == 0.0


def test_buffers_average_floats_and_take_the_largest_count():
    import torch

    from distbelief.buffers import average, buffers_of, load_buffers

    a = {"m": torch.tensor([1.0, 3.0]), "n": torch.tensor(4)}
    b = {"m": torch.tensor([3.0, 5.0]), "n": torch.tensor(7)}
    avg = average([a, b, {}])
    assert torch.equal(avg["m"], torch.tensor([2.0, 4.0])) and int(avg["n"]) == 7 and avg["n"].dtype == torch.int64
    bn = torch.nn.BatchNorm1d(2)
    load_buffers(bn, {"running_mean": avg["m"], "num_batches_tracked": avg["n"]})
    assert torch.equal(buffers_of(bn)["running_mean"], torch.tensor([2.0, 4.0]))
    with pytest.raises(KeyError):
        load_buffers(bn, {"nope": torch.zeros(1)})

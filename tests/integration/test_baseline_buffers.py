"""Module buffers (BatchNorm's running statistics) in the hogwild and ddp baselines: evaluations use the live
ones, and the returned model, its state_dict and params.safetensors carry them (docs/api.md, "Module buffers").

Hogwild's workers share the driver's buffers as they share its parameters; DDP's run buffers are rank 0's, which
DDP broadcasts to the other ranks at every forward and which rank 0 keeps in the driver's shared-memory model."""

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

from distbelief import train
from distbelief.testing import Faults
from tests.conftest import toy_classification


def bn_model() -> nn.Module:
    return nn.Sequential(nn.Linear(7, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def shifted_split(part: str) -> TensorDataset:
    """Inputs far from zero mean and unit variance: the running statistics move far from their initial
    (0, 1), so evaluating with the initial ones instead of the carried ones changes the predictions."""
    x, y = toy_classification(800, seed=5).tensors
    x = 3.0 * x + 2.0
    return TensorDataset(x[:640], y[:640]) if part == "train" else TensorDataset(x[640:], y[640:])


class WatchBuffers:
    """A probe at every evaluation (in the driver, the workers paused): the batches counted in the model the
    driver evaluates, beside the workers' step counts and the record."""

    def __init__(self):
        self.seen: list[tuple[int, list[int], dict]] = []

    def __call__(self, run, rec):
        self.seen.append((int(run.model[1].num_batches_tracked), run.progress.steps(), dict(rec)))


def accuracy_in_eval_mode(model: nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    with torch.no_grad():
        return (model.eval()(x).argmax(1) == y).float().mean().item()


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["hogwild", "ddp"])
def test_batchnorm_statistics_are_used_returned_and_saved(strategy, tmp_path):
    train_data, test_data = shifted_split("train"), shifted_split("test")
    watch = WatchBuffers()
    res = train(bn_model, train_data, test_data, strategy=strategy, replicas=2, batch_size=16, optimizer="sgd",
                lr=0.05, threads=1, max_seconds=1.0, eval_every_seconds=0.2, quiet=True,
                hooks=Faults(on_evaluation=watch), out=str(tmp_path / "run"))
    assert res.summary["stop_reason"] == "time budget spent" and res.summary["replicas_lost"] == 0
    bn = res.model[1]
    # really carried: the statistics moved far from their initial (0, 1) towards the shifted inputs' ones
    assert (bn.running_mean - torch.zeros(16)).abs().max() > 0.5
    assert (bn.running_var - torch.ones(16)).abs().max() > 0.5
    # the final evaluation used these statistics: the recorded accuracy is the eval-mode accuracy of the result
    acc = accuracy_in_eval_mode(res.model, test_data)
    assert acc == pytest.approx(res.summary["final_test_accuracy"], abs=1e-6)
    initial = bn_model()  # the trained parameters with the initial statistics: what returning none would give
    initial.load_state_dict(res.state_dict())
    initial[1].reset_running_stats()
    assert accuracy_in_eval_mode(initial, test_data) != pytest.approx(acc, abs=1e-6)
    saved = load_file(str(res.checkpoint))
    assert {k for k in saved if k.startswith("buffer.")} == {
        "buffer.1.running_mean", "buffer.1.running_var", "buffer.1.num_batches_tracked"}
    assert torch.equal(saved["buffer.1.running_mean"], bn.running_mean)
    assert torch.equal(saved["buffer.1.running_var"], bn.running_var)
    assert torch.equal(saved["buffer.1.num_batches_tracked"], bn.num_batches_tracked)
    # every evaluation, not only the last, used the live buffers: the batches they counted match the steps
    # the paused workers had taken at that moment
    assert len(watch.seen) >= 3  # at least two during training, and the final one
    steps = res.summary["steps_per_replica"]
    assert int(bn.num_batches_tracked) == watch.seen[-1][0]
    for batches, paused_steps, rec in watch.seen:
        if strategy == "ddp":  # rank 0's buffers: one forward per synchronous step
            assert batches == paused_steps[0] == rec["updates"]
        else:  # one shared counter, incremented by every worker's forward without a lock (none lost, in practice)
            assert 0 < batches <= sum(paused_steps) == rec["updates"]
    if strategy == "hogwild":  # shared, not a worker's own: it counted both workers' batches
        assert max(steps) < int(bn.num_batches_tracked) <= sum(steps)
    else:
        assert int(bn.num_batches_tracked) == steps[0] == steps[1]

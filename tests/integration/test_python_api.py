"""What a PyTorch user gets from train(): typed evaluation callbacks for every strategy, the trained weights as
a state_dict and a checkpoint file, and a clear error for parameters distbelief would not keep as they are."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from distbelief import ConfigError, Evaluation, train
from distbelief.warmstart import load_flat_params
from tests.conftest import make_odd_model, toy_classification

_ALL = toy_classification(n=600, seed=3).tensors
TRAIN, TEST = TensorDataset(_ALL[0][:480], _ALL[1][:480]), TensorDataset(_ALL[0][480:], _ALL[1][480:])
STEPS = {"sgd": {}, "sync": {}, "downpour": {}, "sandblaster": {"lbfgs_batch": 200, "portion_size": 50},
         "hogwild": {}, "ddp": {}}


@pytest.mark.parametrize("strategy", [pytest.param(k, marks=pytest.mark.slow) if k in ("ddp", "hogwild") else k
                                      for k in sorted(STEPS)])  # (worker processes: slow)
def test_callbacks_get_a_typed_evaluation_for_every_strategy(strategy, tmp_path):
    seen: list[Evaluation] = []
    res = train(make_odd_model, TRAIN, TEST, strategy=strategy, runtime="inprocess", replicas=2, shards=2,
                max_steps=4, max_seconds=0, eval_every_seconds=0.01, quiet=True, out=str(tmp_path / "run"),
                callbacks=[seen.append], **STEPS[strategy])
    assert seen and all(isinstance(e, Evaluation) for e in seen)
    assert len(seen) == len(res.metrics)  # one call per metrics.jsonl line, the final evaluation included
    last = seen[-1]
    assert last.test_accuracy == res.metrics[-1]["test_accuracy"] == res.summary["final_test_accuracy"]
    assert last.examples == res.metrics[-1]["examples"] > 0 and last.values == res.metrics[-1]
    assert [e.wall_s for e in seen] == sorted(e.wall_s for e in seen)


def test_a_callback_that_raises_stops_the_run_with_its_error(tmp_path):
    def stop(evaluation):
        raise RuntimeError("enough")

    with pytest.raises(RuntimeError, match="enough"):
        train(make_odd_model, TRAIN, TEST, strategy="sgd", max_steps=50, max_seconds=0, eval_every_seconds=0.01,
              quiet=True, callbacks=[stop])


def test_the_result_gives_a_state_dict_and_the_checkpoint_path(tmp_path):
    res = train(make_odd_model, TRAIN, TEST, strategy="downpour", runtime="inprocess", replicas=2, shards=2,
                max_steps=5, max_seconds=0, quiet=True, out=str(tmp_path / "run"))
    model = make_odd_model()
    model.load_state_dict(res.state_dict())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(flat, res.flat_params)
    assert res.checkpoint == tmp_path / "run" / "params.safetensors"
    assert torch.equal(load_flat_params(res.checkpoint, flat.numel()), res.flat_params)
    no_dir = train(make_odd_model, TRAIN, TEST, strategy="sgd", max_steps=2, max_seconds=0, quiet=True, out="")
    assert no_dir.checkpoint is None and no_dir.run_dir is None


def double_model():
    return nn.Sequential(nn.Flatten(), nn.Linear(7, 3)).double()


def test_parameters_that_are_not_float32_are_refused_before_any_worker_starts():
    with pytest.raises(ConfigError, match=r"^model: parameter '1.weight' is torch.float64; .*model.float\(\)"):
        train(double_model, TRAIN, TEST, strategy="downpour", runtime="inprocess", max_steps=1, quiet=True)


def bn_model():
    return nn.Sequential(nn.Linear(7, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


@pytest.mark.parametrize("strategy", ["downpour", "sgd", "sandblaster"])
def test_batchnorm_statistics_are_kept_used_and_saved(strategy, tmp_path):
    from safetensors.torch import load_file

    extra = dict(lbfgs_batch=64, portion_size=16, max_steps=4) if strategy == "sandblaster" else \
        dict(batch_size=16, max_steps=30)
    res = train(bn_model, TRAIN, TEST, strategy=strategy, runtime="inprocess", replicas=2, shards=2, max_seconds=0,
                eval_every_seconds=0.01, quiet=True, out=str(tmp_path / "run"), **extra)
    bn = res.model[1]
    if strategy != "sandblaster":
        assert int(bn.num_batches_tracked) == 30  # the replicas' counts combine by their maximum
    else:  # every portion's forward passes count (gradient and line-search evaluations)
        assert int(bn.num_batches_tracked) > 4
    assert not torch.equal(bn.running_mean, torch.zeros(16)) and not torch.equal(bn.running_var, torch.ones(16))
    # the final evaluation used these statistics: the recorded accuracy is the eval-mode accuracy of the result
    x, y = TEST.tensors
    with torch.no_grad():
        acc = (res.model.eval()(x).argmax(1) == y).float().mean().item()
    assert acc == pytest.approx(res.summary["final_test_accuracy"], abs=1e-6)
    saved = load_file(str(res.checkpoint))
    assert torch.equal(saved["buffer.1.running_mean"], bn.running_mean)
    assert torch.equal(saved["buffer.1.num_batches_tracked"], bn.num_batches_tracked)
    assert set(res.state_dict()) >= {"1.running_mean", "1.running_var", "1.num_batches_tracked"}


def r2(outputs, targets):
    """The coefficient of determination: 1 - MSE / variance of the targets (1 = perfect)."""
    return 1.0 - float(((outputs.squeeze(1) - targets) ** 2).mean() / targets.var(unbiased=False))


def regression_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(600, 7, generator=g)
    y = x @ torch.randn(7, generator=g)
    return TensorDataset(x[:480], y[:480]), TensorDataset(x[480:], y[480:])


def mse(out, y):
    return ((out.squeeze(1) - y) ** 2).mean()


@pytest.mark.parametrize("strategy", ["downpour", "sgd"])
def test_a_regression_task_trains_to_a_target_of_its_own_metric(strategy):
    tr, te = regression_data()
    res = train(lambda: nn.Linear(7, 1), tr, te, strategy=strategy, runtime="inprocess", replicas=2, shards=2,
                loss_fn=mse, metric_fn=r2, optimizer="sgd", lr=0.05, batch_size=32, max_steps=400,
                max_seconds=0, target_accuracy=0.95, eval_every_seconds=0.01, quiet=True)
    last = res.summary["final_test_accuracy"]
    assert last >= 0.95 and res.summary["stop_reason"] == "target accuracy reached"  # R^2 on the test set
    x, y = te.tensors
    with torch.no_grad():
        assert last == pytest.approx(r2(res.model(x), y), abs=1e-6)
        assert r2(nn.Linear(7, 1)(x), y) < 0.5  # an untrained model is far from it


def test_a_metric_that_cannot_return_a_number_is_refused_before_workers_start():
    with pytest.raises(ConfigError, match="^metric_fn: "):
        train(make_odd_model, TRAIN, TEST, strategy="downpour", runtime="inprocess", max_steps=1, quiet=True,
              metric_fn=lambda out: 1.0)


class DictItems(torch.utils.data.Dataset):
    """Items as dicts (what many real datasets return): torch's default collate would give a dict, not (x, y)."""

    def __init__(self, ds):
        self.x, self.y = ds.tensors

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"features": self.x[i], "label": int(self.y[i])}


def dict_collate(items):
    return torch.stack([it["features"] for it in items]), torch.tensor([it["label"] for it in items])


def test_a_collate_fn_loads_items_of_any_shape_for_training_and_evaluation(tmp_path):
    tr, te = DictItems(TRAIN), DictItems(TEST)
    with pytest.raises(ConfigError, match="^train_data: two items of the training set do not collate"):
        train(make_odd_model, tr, te, strategy="sgd", max_steps=2, max_seconds=0, quiet=True)
    res = train(make_odd_model, tr, te, strategy="downpour", runtime="inprocess", replicas=2, shards=2,
                collate_fn=dict_collate, max_steps=60, max_seconds=0, quiet=True)
    plain = train(make_odd_model, TRAIN, TEST, strategy="downpour", runtime="inprocess", replicas=2, shards=2,
                  max_steps=60, max_seconds=0, quiet=True)
    assert res.summary["final_test_accuracy"] > 0.5  # 3 classes: it learned
    # the same examples in the same order as the tensors themselves: one replica's run is reproducible bit for bit
    one = dict(strategy="downpour", runtime="inprocess", replicas=1, shards=2, max_steps=20, max_seconds=0,
               quiet=True)
    a = train(make_odd_model, tr, te, collate_fn=dict_collate, **one)
    b = train(make_odd_model, TRAIN, TEST, **one)
    assert torch.equal(a.flat_params, b.flat_params) and plain.summary["final_test_accuracy"] > 0.5


def test_loader_workers_prepare_the_same_batches_in_the_same_order():
    tr, te = DictItems(TRAIN), DictItems(TEST)
    one = dict(strategy="sgd", threads=1, max_steps=30, max_seconds=0, quiet=True, collate_fn=dict_collate)
    inline = train(make_odd_model, tr, te, **one)
    ahead = train(make_odd_model, tr, te, loader_workers=1, **one)
    assert torch.equal(inline.flat_params, ahead.flat_params)
    with pytest.raises(ConfigError, match="^loader_workers: must be an integer >= 0"):
        train(make_odd_model, tr, te, loader_workers=-1, **one)

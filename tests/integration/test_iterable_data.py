"""An IterableDataset as training or test data: each replica streams its own share (positions i % R == r),
pass after pass; strategies that need random access refuse a stream before any worker starts; a finite test
stream is evaluated to its end."""

import itertools

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

from distbelief import ConfigError, train
from distbelief.data.batches import StreamBatches
from distbelief.data.loading import Loading, LoadingDataset
from distbelief.evaluation import evaluate
from tests.conftest import make_odd_model, toy_classification

_ALL = toy_classification(n=1200, seed=5).tensors
TRAIN, TEST = TensorDataset(_ALL[0][:1000], _ALL[1][:1000]), TensorDataset(_ALL[0][1000:], _ALL[1][1000:])


class Numbers(IterableDataset):
    """Items ``(tensor([i]), i)`` for positions 0..n-1 of the stream."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor([float(i)]), i


class Counting(IterableDataset):
    """An endless stream of numbered items."""

    def __iter__(self):
        for i in itertools.count():
            yield torch.tensor([float(i)]), i


class Stream(IterableDataset):
    """The items of a TensorDataset, in order, as a stream (no __len__, no __getitem__)."""

    def __init__(self, ds: TensorDataset):
        self.ds = ds

    def __iter__(self):
        x, y = self.ds.tensors
        yield from zip(x, y)


class DictStream(Stream):
    """The same stream with dict items, which torch's default collate would not turn into (inputs, targets)."""

    def __iter__(self):
        for x, y in super().__iter__():
            yield {"features": x, "label": int(y)}


def dict_collate(items):
    return torch.stack([it["features"] for it in items]), torch.tensor([it["label"] for it in items])


def labels(source, n):
    return [source.next_batch()[1].tolist() for _ in range(n)]


def test_a_replica_streams_the_positions_of_its_share_in_order_batched_and_restarts_at_the_end():
    n, replicas, bs = 23, 3, 4
    seen = []
    for r in range(replicas):
        share = [i for i in range(n) if i % replicas == r]
        per_pass = -(-len(share) // bs)  # batches per pass, the last one shorter
        src = StreamBatches(Numbers(n), r, replicas, bs)
        first, second = labels(src, per_pass), labels(src, per_pass)
        assert [len(b) for b in first] == [bs] * (per_pass - 1) + [len(share) - bs * (per_pass - 1)]
        assert sum(first, []) == share  # exactly positions i % R == r, in the stream's order
        assert second == first and src.epochs == 2  # the stream ended: a second pass, the same batches
        x, y = src.next_batch()
        assert src.epochs == 3 and torch.equal(x[:, 0], y.float())  # inputs and targets stay paired
        seen += sum(first, [])
    assert sorted(seen) == list(range(n))  # the shares are disjoint and together cover the stream once per pass
    # an endless stream is a single pass
    endless = StreamBatches(Counting(), 1, 2, 3)
    assert labels(endless, 3) == [[1, 3, 5], [7, 9, 11], [13, 15, 17]] and endless.epochs == 1
    # a replica whose share is empty says so rather than waiting forever
    with pytest.raises(ValueError, match="replica 2's share of the training stream is empty"):
        StreamBatches(Numbers(2), 2, 3, 4).next_batch()


@pytest.mark.slow
def test_loader_workers_prepare_the_same_batches_in_the_same_order():
    for workers in (1, 2):
        src = StreamBatches(LoadingDataset(Numbers(23), Loading(None, workers)), 1, 2, 3)
        assert labels(src, 10) == labels(StreamBatches(Numbers(23), 1, 2, 3), 10)
        assert src.epochs == 3


@pytest.mark.slow
def test_downpour_learns_from_a_stream_as_from_the_same_examples_in_a_map_style_dataset():
    run = dict(strategy="downpour", runtime="inprocess", replicas=2, shards=2, batch_size=32, max_steps=150,
               max_seconds=0, eval_every_seconds=3600, quiet=True)
    streamed = train(make_odd_model, Stream(TRAIN), TEST, **run)
    mapped = train(make_odd_model, TRAIN, TEST, **run)
    untrained = evaluate(make_odd_model(), TEST)[0]
    acc = streamed.summary["final_test_accuracy"]
    assert untrained < 0.6 and acc >= 0.85, (untrained, acc)
    assert acc >= mapped.summary["final_test_accuracy"] - 0.05
    assert streamed.summary["steps_per_replica"] == [150, 150]  # 1000 items, 16 batches a pass: over 9 passes
    # a factory of the stream works as a factory of a map-style dataset does, and so do sgd and sync (whose
    # training probe, train_eval_samples, is the stream's first items)
    single = train(make_odd_model, lambda: Stream(TRAIN), TEST, **{**run, "strategy": "sgd"})
    assert single.summary["final_test_accuracy"] >= 0.85
    synced = train(make_odd_model, Stream(TRAIN), TEST, train_eval_samples=100, **{**run, "strategy": "sync"})
    assert synced.summary["final_test_accuracy"] >= 0.85 and synced.metrics[-1]["train_accuracy"] >= 0.85


@pytest.mark.slow
def test_a_collate_fn_turns_a_stream_of_dicts_into_the_same_batches(tmp_path):
    one = dict(strategy="downpour", runtime="inprocess", replicas=1, shards=2, batch_size=16, max_steps=80,
               max_seconds=0, eval_every_seconds=3600, quiet=True)
    with pytest.raises(ConfigError, match="^train_data: two items of the training set do not collate"):
        train(make_odd_model, DictStream(TRAIN), TEST, **one)
    dicts = train(make_odd_model, DictStream(TRAIN), DictStream(TEST), collate_fn=dict_collate, **one)
    tensors = train(make_odd_model, Stream(TRAIN), TEST, **one)
    # one replica over the same items in the same order: the same run bit for bit, evaluated alike
    assert torch.equal(dicts.flat_params, tensors.flat_params)
    assert dicts.summary["final_test_accuracy"] == tensors.summary["final_test_accuracy"] > 0.6
    ahead = train(make_odd_model, DictStream(TRAIN), DictStream(TEST), collate_fn=dict_collate, loader_workers=2,
                  **{**one, "strategy": "sgd", "threads": 1, "max_steps": 40})
    inline = train(make_odd_model, DictStream(TRAIN), DictStream(TEST), collate_fn=dict_collate,
                   **{**one, "strategy": "sgd", "threads": 1, "max_steps": 40})
    assert torch.equal(ahead.flat_params, inline.flat_params)


@pytest.mark.parametrize("strategy,extra", [("hogwild", {}), ("ddp", {}), ("sandblaster", {}),
                                            ("downpour", {"partitions": 2})])
def test_strategies_that_need_random_access_refuse_a_stream_before_any_worker_starts(strategy, extra, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^train_data: an IterableDataset is streamed by the sgd, sync, "
                                          r"downpour strategies"):
        train(make_odd_model, Stream(TRAIN), TEST, strategy=strategy, runtime="inprocess", replicas=2, shards=2,
              max_steps=5, max_seconds=0, quiet=True, out=str(out), **extra)
    assert not out.exists()  # refused before the run directory, let alone a worker


def test_a_stream_too_short_for_the_replicas_or_empty_is_refused(tmp_path):
    run = dict(strategy="downpour", runtime="inprocess", shards=2, max_steps=5, max_seconds=0, quiet=True)
    with pytest.raises(ConfigError, match="^train_data: the training stream yielded 2 items, fewer than the 3"):
        train(make_odd_model, Stream(TensorDataset(*[t[:2] for t in TRAIN.tensors])), TEST, replicas=3, **run)
    with pytest.raises(ConfigError, match="^train_data: the training stream yielded no items$"):
        train(make_odd_model, Numbers(0), TEST, replicas=1, **run)


def test_a_test_stream_evaluates_as_the_same_items_in_a_map_style_dataset():
    run = dict(strategy="sgd", batch_size=32, max_steps=40, max_seconds=0, eval_every_seconds=3600, quiet=True)
    res = train(make_odd_model, TRAIN, Stream(TEST), **run)
    acc, loss = evaluate(res.model, TEST, batch_size=64)  # 200 items: the last batch is a short one
    assert evaluate(res.model, Stream(TEST), batch_size=64) == (acc, loss)
    assert res.summary["final_test_accuracy"] == pytest.approx(acc, abs=1e-12) and 0.6 < acc < 1.0
    # eval_samples: the stream's first N items, as the first N of a map-style test set
    first = train(make_odd_model, TRAIN, Stream(TEST), eval_samples=50, **run)
    head = TensorDataset(*[t[:50] for t in TEST.tensors])
    assert first.summary["final_test_accuracy"] == pytest.approx(evaluate(first.model, head)[0], abs=1e-12)
    assert evaluate(first.model, head)[0] != evaluate(first.model, TEST)[0]  # the subset, not the whole set


def test_elastic_replicas_refuse_a_stream(tmp_path):
    """A stream is cut into one share per replica; elastic replicas come and go, so it is refused up front."""
    with pytest.raises(ConfigError, match="^train_data: .*elastic"):
        train(make_odd_model, Stream(TRAIN), TEST, runtime="inprocess", replicas=1, max_replicas=3, shards=2,
              max_steps=5, max_seconds=0, quiet=True, out=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()

"""Task and evaluation options: the speech class prior, the evaluation subsets, the training-accuracy probe."""

import hashlib
import json

import pytest
import torch

from distbelief import RunConfig
from distbelief.api import train_task
from distbelief.data.tasks import TaskSpec, _key, load_task
from distbelief.exceptions import ConfigError


def test_zipf_class_prior_skews_the_speech_labels_and_keeps_old_cache_keys():
    flat = load_task(TaskSpec("speech", 6000, 64, 0))
    skew = load_task(TaskSpec("speech", 6000, 64, 0, class_prior=1.5))
    cf = torch.bincount(flat.train.tensors[1], minlength=64).float()
    cs = torch.bincount(skew.train.tensors[1], minlength=64).float()
    assert cf.max() / cf.mean() < 2.0  # balanced: no class far above its share
    assert cs[:4].sum() > 0.35 * cs.sum() and cs[32:].sum() < 0.25 * cs.sum()  # a few frequent, many rare
    assert torch.equal(flat.train.tensors[0], skew.train.tensors[0])  # same frames, other labels
    # class_prior = 0 keeps the cache key of specs made before the option existed
    assert _key(TaskSpec("speech", 6000, 64, 0)) != _key(TaskSpec("speech", 6000, 64, 0, class_prior=1.0))
    old = {"name": "speech", "num_samples": 6000, "num_classes": 64, "seed": 0, "test_fraction": 0.2}
    assert _key(TaskSpec("speech", 6000, 64, 0)) == hashlib.sha256(
        json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]


@pytest.mark.parametrize("settings,field", [(dict(task="mnist1d", class_prior=1.0), "class_prior"),
                                            (dict(task="speech", class_prior=-1.0), "class_prior"),
                                            (dict(eval_samples=-5), "eval_samples"),
                                            (dict(train_eval_samples=-1), "train_eval_samples")])
def test_bad_task_options_name_the_field(settings, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        RunConfig(**settings).validate()


def test_training_accuracy_probe_and_evaluation_subset():
    base = dict(runtime="inprocess", strategy="sgd", num_samples=2000, max_steps=60, max_seconds=0,
                eval_every_seconds=3600, batch_size=32, lr=0.1)
    plain = train_task(RunConfig(**base), quiet=True)
    assert plain.metrics[-1]["train_accuracy"] is None
    probed = train_task(RunConfig(**base, train_eval_samples=300, eval_samples=100), quiet=True)
    rec = probed.metrics[-1]
    assert 0.0 <= rec["train_accuracy"] <= 1.0
    # 100 test examples: accuracy is a multiple of 1/100; the parameters are those of the plain run
    assert abs(rec["test_accuracy"] * 100 - round(rec["test_accuracy"] * 100)) < 1e-9
    assert torch.equal(probed.flat_params, plain.flat_params)

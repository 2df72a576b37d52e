"""Task and evaluation options: the speech class prior, the evaluation subsets, the training-accuracy probe."""

import dataclasses
import hashlib
import json

import pytest
import torch

from distbelief import RunConfig
from distbelief.api import task_parts, train_task
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
    cfg = RunConfig(**base, train_eval_samples=300, eval_samples=100).validate()
    probed = train_task(cfg, quiet=True)
    rec = probed.metrics[-1]
    # the parameters are those of the plain run: the probe and the subset change what is measured, not training
    assert torch.equal(probed.flat_params, plain.flat_params)
    # recomputed here from the final model: the training accuracy on the run's fixed sample of 300 training
    # examples (drawn with seed + 17), the test accuracy on the first 100 test examples
    parts = task_parts(cfg)
    train = parts.train_fn()
    pick = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed + 17))[:300]
    x, y = train[pick]
    tx, ty = parts.test[:100]
    model = probed.model.eval()
    with torch.no_grad():
        train_right, test_right = int((model(x).argmax(1) == y).sum()), int((model(tx).argmax(1) == ty).sum())
    assert rec["train_accuracy"] == train_right / 300 and rec["test_accuracy"] == test_right / 100


@pytest.mark.parametrize("model,classes", [("speech-paper", 8192), ("speech-tiny", 256), ("speech-small", 256)])
def test_speech_classes_follow_the_model_unless_given(model, classes):
    assert RunConfig(task="speech", model=model).validate().num_classes == classes
    assert RunConfig(task="speech", model=model, num_classes=64).validate().num_classes == 64
    assert RunConfig(task="mnist1d").validate().num_classes is None  # fixed by the data; not a knob


def test_auto_settings_resolve_per_model_and_strategy_and_keep_user_values():
    from distbelief.defaults import RECOMMENDED_LR

    cfg = RunConfig(task="speech", model="speech-paper").validate()
    assert cfg.lr == RECOMMENDED_LR[("speech-paper", "adagrad")] < 0.05 and cfg.batch_size == 32
    assert RunConfig(optimizer="sgd").validate().lr == RECOMMENDED_LR[("mlp", "sgd")]
    assert RunConfig(lr=0.3).validate().lr == 0.3
    sb = RunConfig(strategy="sandblaster").validate()
    assert (sb.lbfgs_batch, sb.portion_size) == (8000, 500)
    assert RunConfig(strategy="sandblaster", lbfgs_batch=640).validate().portion_size == 40
    again = dataclasses.replace(sb).validate()  # validating a validated config changes nothing
    assert again == sb
    for field in ("lr", "batch_size", "lbfgs_batch", "portion_size", "num_classes"):
        with pytest.raises(ConfigError, match=f"^{field}:"):
            RunConfig(**{field: -1}).validate()

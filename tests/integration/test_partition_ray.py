"""Partitions as real Ray actors: exact equality with the unpartitioned model, and Downpour with P x R x S."""

import json
from functools import partial

import numpy as np
import pytest
import torch

from distbelief import RunConfig
from distbelief.api import train_task
from distbelief.partition import PartitionedModel
from distbelief.partition.executor import StepWorkerRecipe
from distbelief.runtime.ray_runtime import RayRuntime
from tests.unit.test_partition import STACKS, batch

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(240), pytest.mark.usefixtures("ray_local")]


def _model(name, P):
    shape, stack, _ = STACKS[name]
    return PartitionedModel(shape, stack(), P)


# Every P = 1..4 on Ray, the two mixed stacks (every layer type between them) taking turns; every (stack, P) pair
# is covered in-process by tests/unit/test_partition.py. P = 3, 4 have middle partitions sending both ways.
@pytest.mark.parametrize("name,P", [("mixed_1d", 1), ("mixed_2d", 2), ("mixed_1d", 3), ("mixed_2d", 4)])
def test_ray_partitions_outputs_and_gradients_equal_unpartitioned(name, P):
    x, y, loss_fn = batch(name)
    torch.manual_seed(1)
    ref = _model(name, P)  # same seed and layout; run as one partition in this process
    loss = loss_fn(ref(x), y)
    loss.backward()
    want = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)  # empty tiles: no grad
                      for p in ref.parameters()])
    runtime = RayRuntime(remote_timeout_s=60)
    shape, stack, _ = STACKS[name]
    model_fn = partial(PartitionedModel, shape, stack(), P)  # layers are plain picklable objects
    role = runtime.create_partition_group(0, StepWorkerRecipe(model_fn, loss_fn, seed=1), None, None, 1, P)
    try:
        answers = runtime.call(role, "broadcast", "step", x, y).result(60)
    finally:
        runtime.call(role, "close").result(30)  # frees its CPUs for the next test's placement group
        runtime.kill(role)
    head = next(a for a in answers if a["partition_id"] == 0)
    assert head["loss"] == pytest.approx(loss.item(), abs=1e-5)
    np.testing.assert_allclose(head["output"], ref(x).detach().numpy(), atol=1e-5, rtol=1e-5)
    got = torch.zeros_like(want)
    for a in answers:
        got[a["lo"]: a["lo"] + len(a["grad"])] = torch.tensor(a["grad"])  # a copy: the fetched array is read-only
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if P > 1:
        assert all(a["bytes_sent"] > 0 for a in answers)


def test_ray_downpour_lc1d_two_replicas_two_partitions_two_shards_learns(tmp_path):
    """The partitioned run on Ray actors learns (8 processes on 2 cores: 25-65 s to 0.65 here, so the test asks
    for 0.5, five times chance). Reaching 80% with the same 2 x 2 x 2 layout is tested in-process
    (test_partition_downpour), where it takes under a minute instead of a minute and a half."""
    cfg = RunConfig(runtime="ray", model="lc1d", replicas=2, partitions=2, shards=2, optimizer="adagrad",
                    lr=0.05, batch_size=128, max_seconds=120, target_accuracy=0.5, eval_every_seconds=1,
                    out=str(tmp_path / "run"))
    train_task(cfg, quiet=True)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["runtime"] == "ray" and summary["partitions"] == 2
    assert summary["stop_reason"] == "target accuracy reached" and summary["best_test_accuracy"] >= 0.5
    assert len(summary["partition_bytes_per_step"]) == 2 and min(summary["partition_messages_per_step"]) > 0
    # each partition process's CPU in a step: some, and no more than the run's wall time over its steps allows
    steps = min(summary["steps_per_replica"])
    cpu = summary["partition_cpu_s_per_step"]
    assert len(cpu) == 2 and all(0 < c * steps < 2 * summary["wall_s"] for c in cpu), (cpu, steps)

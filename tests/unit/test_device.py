"""The ``device`` setting: its validation, the mirrored (host <-> device copy) path of a replica, and a CPU run.

The build machine has no GPU: the mirrored path is exercised on the CPU (``WholeModel(..., mirror=True)``), where
it must give bit-for-bit the gradients and parameters of the direct path.
"""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from distbelief import RunConfig
from distbelief.api import train_task
from distbelief.cli import main
from distbelief.data.batches import BatchSource
from distbelief.downpour.replica import LocalUpdates, ModelReplica, ReplicaSettings, WholeModel
from distbelief.exceptions import ConfigError
from distbelief.ps.optimizers import make_server_optimizer


def refused(**settings) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        RunConfig(**settings).validate()
    assert e.value.field == "device"
    return e.value


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("value", ["gpu", "CUDA", "cuda:", "cuda:x", "mps", ""])
def test_an_unknown_device_is_refused_naming_it(value):
    assert "choose one of: cpu, cuda, cuda:N, auto" in str(refused(device=value))


@pytest.mark.parametrize("strategy", ["hogwild", "ddp", "sandblaster"])
def test_strategies_on_the_cpu_refuse_cuda_and_say_what_to_use(strategy):
    msg = str(refused(device="cuda", strategy=strategy))
    assert f"the {strategy} strategy computes on the CPU only" in msg and 'device = "cpu"' in msg
    assert RunConfig(device="auto", strategy=strategy).validate().device == "auto"  # auto: the CPU there
    assert RunConfig(device="cpu", strategy=strategy).validate().device == "cpu"


def test_partitioned_replicas_refuse_cuda():
    msg = str(refused(device="cuda", model="lc1d", partitions=2))
    assert "partitions = 1" in msg and 'device = "cpu"' in msg
    assert RunConfig(device="auto", model="lc1d", partitions=2).validate().partitions == 2


def test_on_ray_cuda_is_the_gpu_ray_assigns():
    # no local check on Ray: the replicas' GPUs are the cluster's (RayRuntime.check_capacity counts them)
    assert RunConfig(device="cuda", strategy="downpour").validate().device == "cuda"
    assert RunConfig(device="cuda", strategy="sync").validate().device == "cuda"
    assert 'use device = "cuda"' in str(refused(device="cuda:1", strategy="downpour"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("settings", [dict(runtime="inprocess"), dict(runtime="inprocess", strategy="sync"),
                                      dict(strategy="sgd"), dict(strategy="sgd", device="cuda:0")])
def test_cuda_in_this_process_without_a_cuda_device_is_refused(settings):
    msg = str(refused(**{"device": "cuda", **settings}))
    assert "no CUDA device here" in msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_an_inprocess_runtime_passed_to_train_refuses_cuda_before_any_worker_starts():
    from distbelief.runtime.inprocess import InProcessRuntime

    cfg = RunConfig(device="cuda", replicas=2, shards=2, num_samples=200, max_steps=5)  # runtime "ray" in cfg
    with pytest.raises(ConfigError, match="^device: 'cuda': no CUDA device here"):
        train_task(cfg, quiet=True, runtime=InProcessRuntime())


def test_the_cli_refuses_cuda_with_hogwild_naming_the_flag(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", "--device", "cuda", "--strategy", "hogwild", "--num-samples", "200", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert "error: --device: the hogwild strategy computes on the CPU only; use --device cpu" in err
    assert not (out / "metrics.jsonl").exists()


# ---------------------------------------------------------------- the mirrored path
def small_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 5))


def test_the_mirrored_path_gives_the_direct_paths_gradients_bit_for_bit():
    direct = WholeModel(0, small_model(), F.cross_entropy)
    mirrored = WholeModel(0, small_model(), F.cross_entropy, device="cpu", mirror=True)
    assert not direct.mirrored and mirrored.mirrored
    assert torch.equal(direct.flat, mirrored.flat)
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        if step == 3:  # a fetch: new parameters written into the host vector
            new = torch.randn(direct.flat.numel(), generator=gen) * 0.1
            direct.flat.copy_(new)
            mirrored.flat.copy_(new)
        x, y = torch.randn(8, 12, generator=gen), torch.randint(0, 5, (8,), generator=gen)
        assert direct.gradient(x, y) == mirrored.gradient(x, y)
        assert torch.equal(direct.grads, mirrored.grads) and direct.grads.abs().sum() > 0
        for src in (direct, mirrored):  # a local step on the host vector, as the replica loop takes one
            src.params.add_(src.grads, alpha=-0.1)
        assert torch.equal(direct.flat, mirrored.flat)
    bd, bm = direct.module_buffers(), mirrored.module_buffers()
    assert bd.keys() == bm.keys() and all(torch.equal(bd[k], bm[k]) and bm[k].device.type == "cpu" for k in bd)


def test_the_mirrored_model_reads_the_host_vector_only_when_it_computes():
    mirrored = WholeModel(0, small_model(), F.cross_entropy, mirror=True)
    weight = mirrored.model[0].weight
    before = weight.detach().clone()
    mirrored.flat.zero_()  # a fetch writes the host vector, not the model
    assert torch.equal(weight, before)
    mirrored.gradient(torch.randn(4, 12), torch.randint(0, 5, (4,)))
    assert torch.equal(weight, torch.zeros_like(weight))  # copied in before the step


def test_a_mirrored_replica_adopts_shared_buffers():
    direct = WholeModel(0, small_model(), F.cross_entropy)
    mirrored = WholeModel(0, small_model(), F.cross_entropy, mirror=True)
    n = mirrored.flat.numel()
    shared = (np.full(n, 7.0, dtype=np.float32), np.full(n, 7.0, dtype=np.float32))
    assert mirrored.adopt_buffers(shared)
    assert np.array_equal(shared[0], direct.flat.numpy())  # the current parameters moved into the buffer
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    direct.gradient(x, y)
    mirrored.gradient(x, y)
    assert np.array_equal(shared[1], direct.grads.numpy())  # the gradient lands in the shared buffer


def run_replica(mirror: bool, steps: int = 8) -> tuple[torch.Tensor, dict]:
    gen = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(256, 12, generator=gen), torch.randint(0, 5, (256,), generator=gen))
    source = WholeModel(0, small_model(), F.cross_entropy, mirror=mirror)
    client = LocalUpdates(source.params, make_server_optimizer("adagrad", 0.05))
    settings = ReplicaSettings(overlap=False, local_lr=0.01)
    replica = ModelReplica(0, source, BatchSource(ds, range(256), 16, seed=5), client, settings)
    stats = replica.run(max_steps=steps)
    return source.flat.clone(), stats


def test_a_replica_on_the_mirrored_path_trains_bit_for_bit_like_the_direct_one():
    start = WholeModel(0, small_model(), F.cross_entropy).flat.clone()
    flat_direct, stats_direct = run_replica(mirror=False)
    flat_mirrored, stats_mirrored = run_replica(mirror=True)
    assert stats_direct["steps"] == stats_mirrored["steps"] == 8
    assert not torch.equal(flat_direct, start)  # it trained
    assert torch.equal(flat_direct, flat_mirrored)
    assert stats_direct["loss_ema"] == stats_mirrored["loss_ema"]


# ---------------------------------------------------------------- runs
def test_an_inprocess_downpour_run_on_the_cpu_learns(tmp_path):
    cfg = RunConfig(runtime="inprocess", device="cpu", replicas=2, shards=2, num_samples=4000, batch_size=32,
                    max_steps=300, max_seconds=0, eval_every_seconds=3600, out=str(tmp_path / "run"))
    res = train_task(cfg, quiet=True)
    assert res.summary["steps_per_replica"] == [300, 300]
    assert res.summary["final_test_accuracy"] >= 0.4  # 10 classes: chance is 0.1
    assert 'device = "cpu"' in (tmp_path / "run" / "config.toml").read_text()


@pytest.mark.parametrize("strategy", ["sgd", "downpour"])
def test_device_auto_runs_where_this_process_computes_and_learns(strategy):
    # here: the CPU (no CUDA on the build machine); on a machine with CUDA, the GPU path end to end
    cfg = RunConfig(runtime="inprocess", strategy=strategy, device="auto", replicas=1, shards=1, num_samples=4000,
                    batch_size=32, threads=1, max_steps=300, max_seconds=0, eval_every_seconds=3600)
    res = train_task(cfg, quiet=True)
    assert res.summary["final_test_accuracy"] >= 0.4
    assert all(p.device.type == "cpu" for p in res.model.parameters())  # the returned model is on the CPU

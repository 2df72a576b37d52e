"""The public Python API: :func:`train`."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from distbelief.config import APPLIES_TO, LOCAL_STRATEGIES, RunConfig, config_from, ignored_by_strategy
from distbelief.exceptions import ConfigError
from distbelief.metrics import DIVERGENCE_CEILING, RunRecorder
from distbelief.summary import RunSummary


@dataclass
class TrainResult:
    """What a run produced.

    Attributes:
        summary: the run's summary (the same dict as ``summary.json``).
        metrics: one dict per evaluation (the lines of ``metrics.jsonl``).
        flat_params: the final server parameters as one flat float32 vector.
        model: a model from ``model_fn`` holding the final parameters.
        run_dir: the run directory, or None when ``out`` was empty.
    """

    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    flat_params: torch.Tensor
    model: torch.nn.Module
    run_dir: Path | None

    @property
    def checkpoint(self) -> Path | None:
        """The final parameters on disk (``params.safetensors`` in the run directory: what ``init_params`` and
        ``distbelief.warmstart.load_flat_params`` read), or None without a run directory."""
        if self.run_dir is None:
            return None
        path = self.run_dir / "params.safetensors"
        return path if path.is_file() else None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained model's ``state_dict()`` (load it into ``model_fn()`` with ``load_state_dict``)."""
        return self.model.state_dict()


def _resolve_threads(cfg: RunConfig) -> int:
    if cfg.threads:
        return cfg.threads
    cores = os.cpu_count() or 1
    if cfg.strategy == "sgd":
        return cores
    return max(1, cores // max(cfg.replicas_started, cfg.max_replicas))  # elastic: as if all MAX were here


STREAM_STRATEGIES = ("sgd", "sync", "downpour")  # those that stream an IterableDataset (data/batches.py)


def check_stream(cfg: RunConfig, ds) -> None:
    """Refuse a training stream (an IterableDataset) for a run that needs random access into its data, or that
    has more replicas than the stream has items."""
    from itertools import islice

    from distbelief.data.loading import stream_of

    stream = stream_of(ds)
    if stream is None:
        return
    if cfg.strategy not in STREAM_STRATEGIES:
        raise ConfigError("train_data", f"an IterableDataset is streamed by the {', '.join(STREAM_STRATEGIES)} "
                                        f"strategies only; {cfg.strategy} needs a map-style dataset (one with "
                                        f"__len__ and __getitem__)")
    if cfg.partitions > 1:
        raise ConfigError("train_data", f"an IterableDataset is streamed by the {', '.join(STREAM_STRATEGIES)} "
                                        f"strategies without partitions only: the partitions of a replica must "
                                        f"draw the same minibatches, which a stream does not promise; use a "
                                        f"map-style dataset with partitions={cfg.partitions}")
    if cfg.max_replicas:
        raise ConfigError("train_data", "an IterableDataset is split into one share per replica, which elastic "
                                        "replicas (replicas = MIN:MAX) cannot keep as they come and go; use a "
                                        "map-style dataset or a fixed replica count")
    replicas = 1 if cfg.strategy == "sgd" else cfg.replicas_started
    n = len(list(islice(iter(stream), replicas)))
    if n < replicas:
        raise ConfigError("train_data", f"the training stream yielded {n} items, fewer than the {replicas} "
                                        f"replicas that each stream a share of it")


def check_model_and_data(model_fn, train_ds, loss_fn, metric_fn=None, cfg: RunConfig | None = None) -> None:
    """Run one tiny forward+backward in this process so shape errors surface before any worker starts (and,
    given the run's ``cfg``, refuse a training stream it cannot read)."""
    from itertools import islice

    from distbelief.data.loading import loading_of, stream_of
    from distbelief.job import materialize

    ds = materialize(train_ds)
    stream = stream_of(ds)
    if stream is not None:  # an IterableDataset: its first two items
        items = list(islice(iter(stream), 2))
        if not items:
            raise ConfigError("train_data", "the training stream yielded no items")
        if cfg is not None:
            check_stream(cfg, ds)
    elif len(ds) == 0:
        raise ConfigError("train_data", "the training dataset is empty")
    model = model_fn()
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("model", "the model has no trainable parameters")
    for name, p in model.named_parameters():
        if p.dtype != torch.float32:  # the shards, the data plane and the checkpoints hold float32
            raise ConfigError("model", f"parameter {name!r} is {p.dtype}; distbelief trains float32 parameters "
                                       f"(build the model in float32, e.g. return model.float() from model_fn)")
    try:
        batch = loading_of(ds).collate(items if stream is not None else [ds[i] for i in range(min(2, len(ds)))])
    except Exception as e:  # noqa: BLE001 - the user's items or collate_fn, named before any worker starts
        raise ConfigError("train_data", f"two items of the training set do not collate into (inputs, targets): "
                                        f"{e}") from None
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and torch.is_tensor(batch[1])):
        raise ConfigError("train_data", f"two items of the training set do not collate into (inputs, targets) "
                                        f"but into a {type(batch).__name__}: pass collate_fn= to build that pair")
    x, y = batch
    try:
        out = model(x)
    except RuntimeError as e:
        raise ConfigError(
            "model", f"the model rejects the dataset's inputs of shape {tuple(x.shape)} (batch of 2): {e}"
        ) from None
    try:
        loss = loss_fn(out, y)
        loss.backward()
    except (RuntimeError, IndexError, ValueError) as e:
        raise ConfigError(
            "model",
            f"the model's output of shape {tuple(out.shape)} does not fit the labels of shape {tuple(y.shape)} "
            f"(values up to {int(y.max()) if y.numel() else 0}): {e}",
        ) from None
    if metric_fn is not None:
        try:  # a wrong signature or a result that is not a number; a metric undefined on 2 examples is fine
            float(metric_fn(out.detach(), y))
        except (TypeError, AttributeError) as e:
            raise ConfigError("metric_fn", f"metric_fn(outputs, targets) must return a number: {e}") from None
        except Exception:  # noqa: BLE001 - e.g. an AUC of one class: judged on the whole test set instead
            pass


def check_tables(model: torch.nn.Module, cfg: RunConfig) -> None:
    """Refuse, before any worker starts, what a model with embedding tables cannot do yet (the tables are held
    row-sharded on the shards by downpour, in every consistency mode, and by sync, backup replicas included; see
    ps/slicer.py). The single-process and local baselines train the user's module as it is. Every durability mode
    covers the rows, and a run with tables resumes, with the same or another number of shards."""
    from distbelief.ps.slicer import find_tables

    if cfg.strategy in ("sgd", *LOCAL_STRATEGIES):
        return
    tables = find_tables(model)  # ConfigError for a table no shard can serve (max_norm, mode="max")
    if not tables:
        return
    names = ", ".join(repr(n) for n, _ in tables[:3]) + (", ..." if len(tables) > 3 else "")
    why = f"the model has embedding tables ({names})"
    if cfg.strategy not in ("downpour", "sync"):
        raise ConfigError("strategy", f"{why}: their rows are served by --strategy downpour or sync (or the sgd, "
                                      f"hogwild and ddp baselines); {cfg.strategy} does not serve table rows yet")
    if cfg.partitions > 1:
        raise ConfigError("partitions", f"{why}: a partitioned replica does not serve table rows yet")
    if cfg.device not in ("cpu", "auto"):
        raise ConfigError("device", f"{why}: replicas with tables compute on the CPU")
    if cfg.compress != "none":
        raise ConfigError("compress", f"{why}: their pushes carry only the rows a minibatch touched already; "
                                      f"compressing the rest is not built yet (use --compress none)")
    if cfg.compress_fetch != "none":
        raise ConfigError("compress_fetch", f"{why}: their replicas fetch only the rows a minibatch uses already; "
                                            f"compressed fetches are not built for them yet (use none)")


def compact_subset(dataset, indices) -> "torch.utils.data.TensorDataset":
    """The items at ``indices`` as a TensorDataset of their own (a Subset would keep the whole dataset alive)."""
    from torch.utils.data import TensorDataset

    from distbelief.data.loading import loading_of

    x, y = loading_of(dataset).collate([dataset[i] for i in indices])
    return TensorDataset(x, y)


def first_items(dataset, n: int, name: str) -> "torch.utils.data.TensorDataset":
    """The first ``n`` items of a stream (all of them if it has fewer) as a TensorDataset of their own."""
    from itertools import islice

    from torch.utils.data import TensorDataset

    from distbelief.data.loading import loading_of, stream_of

    items = list(islice(iter(stream_of(dataset)), n))
    if not items:
        raise ConfigError(name, "the stream yielded no items")
    x, y = loading_of(dataset).collate(items)
    return TensorDataset(x, y)


def train(
    model_fn: Callable[[], torch.nn.Module],
    train_data,
    test_data,
    config: RunConfig | None = None,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    runtime=None,
    quiet: bool = False,
    resume: bool = False,
    callbacks: list | None = None,
    metric_fn: Callable[[torch.Tensor, torch.Tensor], float] | None = None,
    collate_fn: Callable | None = None,
    loader_workers: int = 0,
    hooks=None,
    **settings: Any,
) -> TrainResult:
    """Train ``model_fn()`` on ``train_data`` with the strategy in ``config`` (Downpour by default;
    ``strategy="sandblaster"`` runs Sandblaster L-BFGS).

    Args:
        model_fn: zero-argument factory of the ``nn.Module`` (picklable: it runs in every worker process).
        train_data: a map-style ``torch.utils.data.Dataset`` of ``(input, label)``, or a picklable zero-argument
            factory returning one (each worker then builds its own copy instead of receiving it). For sgd, sync
            and downpour it may be an ``IterableDataset`` (or a factory of one): each replica streams its share
            (data/batches.py ``StreamBatches``), pass after pass.
        test_data: a Dataset evaluated in the driver with the server's parameters; an ``IterableDataset`` is read
            to its end at every evaluation (so it must be finite).
        config: a RunConfig; ``settings`` (any RunConfig field, e.g. ``replicas=4``) override it.
        loss_fn: ``loss_fn(output, target)``; cross-entropy by default.
        metric_fn: ``metric_fn(outputs, targets) -> float`` over the whole test set (higher is better: return
            e.g. minus the mean squared error, or an AUC); the test and training metric of every evaluation,
            ``final_test_accuracy`` and ``target_accuracy`` are this metric. Classification accuracy by default.
            An object may also carry ``name`` (what the progress lines call the metric, e.g. "AUC") and
            ``summary_fields(summary, model, test_data) -> dict`` (fields of ``RunSummary`` it adds to the summary
            once the run ended, ``model`` holding the final parameters): see ``distbelief.metrics.ctr.AUCMetric``.
        runtime: a Runtime instance, or the name of one (``"ray"``, ``"inprocess"``); by default
            ``config.runtime``.
        quiet: suppress progress output.
        collate_fn: turns a list of dataset items into ``(inputs, targets)`` (torch's ``default_collate`` if None),
            for training, evaluation and the early shape check; picklable where the workers are processes.
        loader_workers: DataLoader worker processes per replica that prepare its next minibatches ahead (for
            datasets whose items are costly to load; a TensorDataset is sliced directly instead).
        callbacks: functions ``f(evaluation)`` called in this process after each evaluation, for every strategy,
            with a ``distbelief.Evaluation`` (training time, examples, test accuracy and loss, training loss,
            and the whole ``metrics.jsonl`` record in ``values``). Raising stops the run with that error.
        resume: continue the run in ``config.out`` from its shards' checkpoints (possibly with a different
            number of shards); its metrics and counters continue.
        hooks: a ``distbelief.hooks.RunHooks``: code called at run steps it asks for, after each evaluation
            and inside each replica after each step, without the strategies knowing what it does (e.g.
            ``distbelief.testing.Faults``, which injects failures and slow machines for tests and benchmarks).

    Returns:
        TrainResult with the summary, metrics, final flat parameters and a model holding them.

    Raises:
        ConfigError: invalid settings, or a model/dataset mismatch, before any worker starts.
        RemoteTimeoutError, RoleFailedError: a remote role timed out or failed beyond the restart policy.
    """
    if isinstance(runtime, str):  # runtime="inprocess" is a setting, not an instance
        settings["runtime"], runtime = runtime, None
    cfg = config_from(settings, config).validate()
    for name in ignored_by_strategy(settings, cfg.strategy):  # those given here; the CLI warns of its own
        import warnings

        warnings.warn(f"{name} has no effect with strategy {cfg.strategy!r} (it is read by: "
                      f"{', '.join(APPLIES_TO[name])})", stacklevel=2)
    from distbelief.hooks import RunHooks

    hooks = hooks if hooks is not None else RunHooks()
    if not isinstance(hooks, RunHooks):
        raise ConfigError("hooks", f"must be a distbelief.hooks.RunHooks, got {type(hooks).__name__}")
    hooks.check(cfg)
    if not isinstance(loader_workers, int) or isinstance(loader_workers, bool) or loader_workers < 0:
        raise ConfigError("loader_workers", f"must be an integer >= 0, got {loader_workers!r}")
    if collate_fn is not None or loader_workers:
        from distbelief.data.loading import Loading, LoadingDataset, WithLoading

        train_data = WithLoading(train_data, Loading(collate_fn, loader_workers))
        test_data = LoadingDataset(test_data, Loading(collate_fn))
    custom_loss = loss_fn
    loss_fn = loss_fn or F.cross_entropy
    check_model_and_data(model_fn, train_data, loss_fn, metric_fn, cfg)
    probe = model_fn()
    n_params = sum(p.numel() for p in probe.parameters())
    check_tables(probe, cfg)
    if cfg.init_params and not resume:  # a resumed run continues from its own checkpoints instead
        from distbelief.warmstart import WarmStarted, load_flat_params

        model_fn = WarmStarted(model_fn, load_flat_params(cfg.init_params, n_params))
    if cfg.strategy not in ("sgd", *LOCAL_STRATEGIES) and cfg.shards > n_params:
        raise ConfigError("shards", f"{cfg.shards} shards for a model with only {n_params} parameters")

    from distbelief.job import Job, materialize

    if resume and cfg.strategy == "sgd":
        raise ConfigError("resume", "single-process sgd runs keep no checkpoints; resume a downpour, sync or "
                                    "sandblaster run")
    if resume and cfg.strategy in LOCAL_STRATEGIES:
        raise ConfigError("resume", f"{cfg.strategy} runs keep no checkpoints; resume a downpour, sync or "
                                    f"sandblaster run")
    if resume and cfg.durability in ("off", "replicate") and cfg.strategy != "sandblaster":
        raise ConfigError("resume", f"a run with --durability {cfg.durability} keeps no checkpoints; resume needs "
                                    f"--durability snapshot or log")
    if resume and not (cfg.out and (Path(cfg.out) / "checkpoints").is_dir()):
        raise ConfigError("resume", f"{cfg.out or '(no run directory)'} has no checkpoints/ to resume from")
    from distbelief.data.loading import stream_of

    if cfg.eval_samples and stream_of(test_data) is not None:  # a test stream: its first eval_samples items
        test_data = first_items(test_data, cfg.eval_samples, "test_data")
    elif cfg.eval_samples and cfg.eval_samples < len(test_data):
        test_data = compact_subset(test_data, range(cfg.eval_samples))
    train_probe = None
    if cfg.train_eval_samples:
        ds = materialize(train_data)
        if stream_of(ds) is not None:  # a stream: its first train_eval_samples items
            train_probe = first_items(ds, cfg.train_eval_samples, "train_data")
        else:
            pick = torch.randperm(len(ds), generator=torch.Generator().manual_seed(cfg.seed + 17))
            train_probe = compact_subset(ds, pick[: cfg.train_eval_samples].tolist())
    job = Job(cfg, model_fn, train_data, test_data, loss_fn, _resolve_threads(cfg), train_probe, hooks,
              metric_fn)
    # A mean cross-entropy above the ceiling is divergence; a custom loss's scale is unknown: relative rule only.
    ceiling = DIVERGENCE_CEILING if custom_loss is None else math.inf
    metric_name = getattr(metric_fn, "name", "accuracy")
    recorder = RunRecorder(cfg.out or None, cfg.to_dict(), quiet=quiet, write_config=not resume,
                           loss_ceiling=ceiling, callbacks=callbacks or (), metrics_port=cfg.metrics_port,
                           metric_name=metric_name)
    threads_before = torch.get_num_threads()
    try:
        summary, flat, buffers = _run_strategy(job, recorder, runtime, resume)
    except BaseException:
        recorder.close_exporter()
        raise
    finally:
        torch.set_num_threads(threads_before)  # runs set this process's torch threads; the caller gets its own back
    model = model_fn()
    from distbelief.ps.sharding import unflatten_into

    unflatten_into(model, flat)
    if buffers:
        from distbelief.buffers import load_buffers

        load_buffers(model, buffers)
    summary = _with_metric_fields(summary, metric_fn, model, test_data)
    recorder.finish(summary, flat, buffers=buffers)
    recorder.log(
        f"done: {summary['stop_reason']}; final test {metric_name} {summary['final_test_accuracy']:.4f} "
        f"(best {summary['best_test_accuracy']:.4f}) in {summary['wall_s']:.1f}s, "
        f"{summary['examples_per_s']:,.0f} examples/s"
        + (f"; run directory {recorder.out_dir}" if recorder.out_dir else "")
    )
    return TrainResult(summary, recorder.records, flat, model, recorder.out_dir)


def _with_metric_fields(summary: dict, metric_fn, model: torch.nn.Module, test_data) -> dict:
    """``summary`` with the fields the run's metric adds (``metric_fn.summary_fields``, if it has one)."""
    add = getattr(metric_fn, "summary_fields", None)
    if add is None:
        return summary
    from dataclasses import fields

    extra = add(summary, model, test_data)
    unknown = sorted(set(extra) - {f.name for f in fields(RunSummary)})
    if unknown:
        raise ConfigError("metric_fn", f"summary_fields returned {', '.join(unknown)}, which RunSummary does not "
                                       f"name (distbelief/summary.py)")
    return {**summary, **{k: v for k, v in extra.items() if v is not None}}


def _run_strategy(job, recorder, runtime, resume: bool) -> tuple[dict, "torch.Tensor", dict | None]:
    """Run ``job`` with its strategy (on ``runtime``, or one made and shut down here); ``(summary, flat,
    buffers)``: the summary as ``summary.json`` holds it, the final parameters, and the module buffers (None where
    the strategy does not carry them)."""
    cfg = job.cfg
    if cfg.strategy == "sgd" and cfg.partitions > 1:
        # the paper's single replica split over P partition workers, no parameter server
        from distbelief.partition.baseline import run_partitioned_sgd

        own_runtime = runtime is None
        runtime = make_runtime(cfg) if own_runtime else runtime
        try:
            runtime.check_capacity(1, partitions=cfg.partitions, log=recorder.log)
            summary, flat, buffers = run_partitioned_sgd(job, runtime, recorder)
        finally:
            if own_runtime:
                runtime.shutdown()
    elif cfg.strategy == "sgd":
        from distbelief.baselines.single import run_single_process

        summary, flat, buffers = run_single_process(job, recorder)
    elif cfg.strategy in LOCAL_STRATEGIES:
        from distbelief.baselines.multiprocess import run_ddp, run_hogwild

        run = run_hogwild if cfg.strategy == "hogwild" else run_ddp
        summary, flat, buffers = run(job, recorder)
    else:
        own_runtime = runtime is None
        if own_runtime:
            runtime = make_runtime(cfg)
        try:
            _replicas_on_device(runtime, cfg)
            # a cluster joined with --address refuses a job too big for it; the local Ray runs it oversubscribed
            runtime.check_capacity(cfg.replicas_started, partitions=cfg.partitions, log=recorder.log)
            torch.set_num_threads(1)  # the driver only evaluates; leave the cores to the workers
            if cfg.strategy == "sandblaster":
                from distbelief.sandblaster.trainer import SandblasterTrainer

                trainer = SandblasterTrainer(job, runtime, recorder, resume=resume)
            elif cfg.strategy == "sync":
                from distbelief.downpour.sync import SyncTrainer

                trainer = SyncTrainer(job, runtime, recorder, resume=resume)
            else:
                from distbelief.downpour.trainer import ParameterServerTrainer

                trainer = ParameterServerTrainer(job, runtime, recorder, resume=resume)
            recorder.write_config()  # a resume's overrides were accepted by the trainer's checks
            summary = trainer.run()
            flat, buffers = trainer.final_flat, trainer.final_buffers
        finally:
            if own_runtime:
                runtime.shutdown()
    if isinstance(summary, RunSummary):
        summary = summary.to_dict()
    return summary, flat, buffers


def _replicas_on_device(runtime, cfg: RunConfig) -> None:
    """Before any replica starts: on Ray, how many GPUs each replica actor asks for (``device`` "cuda": one;
    "auto": one where the cluster has one per replica, see ``RayRuntime.check_capacity``); in this process (the
    inprocess runtime, also when passed to ``train`` as an instance), refuse a CUDA device it does not have."""
    from distbelief.devices import DEVICE_STRATEGIES, check_cuda_here, wants_gpu

    takes = cfg.strategy in DEVICE_STRATEGIES and cfg.partitions == 1
    if runtime.name == "ray":
        runtime.replica_gpus = 1.0 if takes and wants_gpu(cfg.device) else 0.0
        runtime.replica_gpus_if_free = takes and cfg.device == "auto"
    elif runtime.name == "inprocess" and takes:
        check_cuda_here(cfg.device, "the inprocess runtime")


def release_workers() -> int:
    """Stop the worker processes that finished runs left idle on the local Ray instance for the next run in this
    process (docs/api.md, "Runs in a row"); returns how many. Nothing to do without a local Ray."""
    module = sys.modules.get("distbelief.runtime.ray_runtime")
    return module.release_workers() if module is not None else 0


def make_runtime(cfg: RunConfig):
    if cfg.runtime == "inprocess":
        from distbelief.runtime.inprocess import InProcessRuntime

        return InProcessRuntime(remote_timeout_s=cfg.remote_timeout_s)
    from distbelief.runtime.ray_runtime import RayRuntime

    return RayRuntime(address=cfg.address or None, remote_timeout_s=cfg.remote_timeout_s, use_streams=cfg.streams)


@dataclass
class TaskJob:
    """What ``train`` needs for a shipped task: the model factory, the training data factory, the test set, and
    the task's loss and metric (None: cross-entropy and accuracy; for ctr the log-loss of one logit and the
    AUC)."""

    model_fn: Callable[[], torch.nn.Module]
    train_fn: Callable
    test: Any
    loss_fn: Callable | None = None
    metric_fn: Callable | None = None


def task_parts(cfg: RunConfig) -> TaskJob:
    """The model factory, data, loss and metric of the shipped task ``cfg`` (validated) names."""
    from distbelief.data.tasks import TaskSpec, load_task, load_train
    from distbelief.models import build_model

    spec = TaskSpec(cfg.task, cfg.num_samples, cfg.num_classes or 0, cfg.seed, class_prior=cfg.class_prior,
                    ctr_max_rows=cfg.ctr_max_rows if cfg.task == "ctr" else 0).resolved()
    task = load_task(spec)  # generates and caches once, here, before any worker starts
    model_fn = partial(build_model, cfg.model, task.input_shape, task.num_classes, cfg.partitions,
                       cardinalities=task.cardinalities)
    job = TaskJob(model_fn, partial(load_train, spec), task.test)
    if cfg.task == "ctr":
        from distbelief.metrics.ctr import AUCMetric, bce_loss

        job.loss_fn, job.metric_fn = bce_loss, AUCMetric(task.planted_auc)
    return job


def task_job(cfg: RunConfig):
    """Model factory and data for a shipped task (used by the CLI and benchmarks); ``task_parts`` adds the
    task's loss and metric."""
    job = task_parts(cfg)
    return job.model_fn, job.train_fn, job.test


def train_task(cfg: RunConfig, quiet: bool = False, runtime=None, resume: bool = False,
               callbacks: list | None = None, hooks=None) -> TrainResult:
    """Train a shipped task/model pair described entirely by ``cfg`` (``hooks``: see ``train``), with the task's
    loss and metric (ctr: log-loss and AUC; the others: cross-entropy and accuracy)."""
    cfg = dataclasses.replace(cfg).validate()
    job = task_parts(cfg)
    return train(job.model_fn, job.train_fn, job.test, cfg, loss_fn=job.loss_fn, metric_fn=job.metric_fn,
                 quiet=quiet, runtime=runtime, resume=resume, callbacks=callbacks, hooks=hooks)

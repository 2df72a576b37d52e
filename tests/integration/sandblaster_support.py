"""Shared pieces of the Sandblaster tests: a convex problem, a plain torch L-BFGS reference, role builders.

Module-level functions only, so that Ray workers can import them by name.
"""

from __future__ import annotations

import pickle

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from distbelief.ps.sharding import bind_flat, flatten
from distbelief.runtime.base import Future, Role, Runtime
from distbelief.sandblaster.coordinator import Coordinator, CoordinatorSettings
from distbelief.sandblaster.lbfgs import LBFGSSettings
from distbelief.sandblaster.portions import PortionState
from distbelief.sandblaster.replica import SandblasterReplicaRecipe, SandblasterReplicaSettings
from distbelief.sandblaster.trainer import read_params, start_vector_shards

D_IN, CLASSES = 10, 3


def logreg_data(n: int = 512, seed: int = 0) -> TensorDataset:
    """Multinomial logistic regression data with noisy labels (not separable: the optimum is finite) and
    features on different scales (so that L-BFGS has curvature to learn)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g) * torch.logspace(0, 1, D_IN)
    w = torch.randn(D_IN, CLASSES, generator=g)
    y = torch.multinomial(torch.softmax(x @ w / 3, dim=1), 1, generator=g).squeeze(1)
    return TensorDataset(x, y)


def logreg_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(D_IN, CLASSES)


def wide_model() -> nn.Module:
    """A 50k-parameter logistic regression for the byte-count test."""
    torch.manual_seed(0)
    return nn.Linear(500, 100)


def reference_lbfgs(model_fn, dataset: TensorDataset, iterations: int, lb: LBFGSSettings) -> torch.Tensor:
    """Plain single-process, full-batch L-BFGS with the coordinator's rules, written with explicit vectors:
    textbook two-loop recursion (gamma = s'y / y'y scaling), pairs kept when s'y > curvature_eps, first step
    t = min(1, 1/||g||), backtracking Armijo (c1, factor ``backtrack``). Vector algebra in float64."""
    model = model_fn()
    flat, grads = bind_flat(model)
    X, Y = dataset.tensors

    def loss_and_grad(v: torch.Tensor) -> tuple[float, torch.Tensor]:
        flat.copy_(v.float())
        grads.zero_()
        loss = F.cross_entropy(model(X), Y)
        loss.backward()
        return loss.item(), grads.clone().double()

    x = flat.clone().double()
    f, g = loss_and_grad(x)
    S, Ys = [], []
    for _ in range(iterations):
        q = g.clone()
        alphas = []
        for s, y in reversed(list(zip(S, Ys))):
            a = s.dot(q) / s.dot(y)
            q -= a * y
            alphas.append(a)
        alphas.reverse()
        if S:
            q *= S[-1].dot(Ys[-1]) / Ys[-1].dot(Ys[-1])
        for (s, y), a in zip(zip(S, Ys), alphas):
            q += (a - y.dot(q) / s.dot(y)) * s
        d = -q
        gd = float(g.dot(d))
        t = 1.0 if S else min(1.0, 1.0 / float(g.norm()))
        for _ in range(lb.max_evals):
            f_t, g_t = loss_and_grad(x + t * d)
            if f_t <= f + lb.c1 * t * gd:
                break
            t *= lb.backtrack
        else:
            raise AssertionError("the reference line search failed; choose a better-posed problem")
        s, y = t * d, g_t - g
        if float(s.dot(y)) > lb.curvature_eps:
            S.append(s)
            Ys.append(y)
            if len(S) > lb.history:
                S.pop(0)
                Ys.pop(0)
        x, f, g = x + s, f_t, g_t
    return x.float()


def full_batch_gradient(model_fn, dataset: TensorDataset) -> torch.Tensor:
    model = model_fn()
    _, grads = bind_flat(model)
    X, Y = dataset.tensors
    F.cross_entropy(model(X), Y).backward()
    return grads.clone()


def held_only_by(queue, rid: int) -> list[int]:
    """Portions whose only computed copy sits, unpushed, in replica ``rid`` (lost if it dies now)."""
    return [p.portion_id for p in queue.portions
            if p.holders == {rid} and p.state is PortionState.HELD and not p.running_on]


def make_replicas(runtime: Runtime, rids, shards, layout, model_fn, dataset) -> dict[int, Role]:
    """Start replicas ``rids`` together (process start-up dominates on Ray), then wait until each is built."""
    roles = {rid: runtime.create_replica(rid, SandblasterReplicaRecipe(rid, model_fn, dataset,
                                                                       SandblasterReplicaSettings(), F.cross_entropy),
                                         shards, layout, 1) for rid in rids}
    for f in [runtime.call(role, "stats") for role in roles.values()]:
        f.result(120)
    return roles


def build(runtime: Runtime, model_fn, dataset, num_shards: int, num_replicas: int, history: int = 5,
          portion_size: int = 32, push_every_portions: int = 2, coordinator_runtime: Runtime | None = None,
          on_poll=None, **settings):
    """Shards holding ``model_fn()``'s parameters, replicas, and a full-batch Coordinator over them; a failed
    replica is replaced by a new one.

    ``coordinator_runtime`` lets a test hand the coordinator an instrumented view of ``runtime``; ``settings``
    go to CoordinatorSettings. Returns ``(coordinator, read)``; ``read()`` fetches the shards' parameters (on the
    test's side, not the coordinator's).
    """
    init = flatten(model_fn())
    layout, shards = start_vector_shards(runtime, init, num_shards)
    replicas = make_replicas(runtime, range(num_replicas), shards, layout, model_fn, dataset)
    cs = CoordinatorSettings(num_examples=len(dataset), batch_size=len(dataset), portion_size=portion_size,
                             push_every_portions=push_every_portions, lbfgs=LBFGSSettings(history=history),
                             remote_timeout_s=60.0, **settings)
    client = runtime.shard_client(shards, layout)
    coord = Coordinator(coordinator_runtime or runtime, shards, replicas, cs, on_poll=on_poll,
                        restart=lambda rid, err: make_replicas(runtime, [rid], shards, layout, model_fn, dataset)[rid],
                        shard_replaced=lambda k, role: client.replace_shard(k, role.handle))
    return coord, lambda: read_params(client, init.numel(), 60.0)


# ---------------------------------------------------------------------------- byte counting
class _Opaque:
    """What an instrumented ``as_arg`` hands the coordinator: it can only be passed on, not read."""

    def __init__(self, value):
        self.value = value


class _CountingFuture(Future):
    def __init__(self, inner: Future, counter: "CountingRuntime"):
        self.inner, self.counter = inner, counter

    def result(self, timeout_s: float):
        value = self.inner.result(timeout_s)
        self.counter.received(value)
        return value

    def done(self) -> bool:
        return self.inner.done()

    def as_arg(self):
        return _Opaque(self.inner.as_arg())


class CountingRuntime(Runtime):
    """A view of a runtime that counts the bytes (pickled size) of every value its user receives."""

    def __init__(self, inner: Runtime):
        self.inner = inner
        self.name = inner.name
        self.bytes_received = 0
        self.values_received = 0
        self.largest_value = 0
        self.forwarded = 0

    def received(self, value) -> None:
        n = len(pickle.dumps(value))
        self.bytes_received += n
        self.values_received += 1
        self.largest_value = max(self.largest_value, n)

    def call(self, role, method, *args, **kwargs):
        unwrapped = []
        for a in args:
            if isinstance(a, _Opaque):
                self.forwarded += 1
                a = a.value
            unwrapped.append(a)
        return _CountingFuture(self.inner.call(role, method, *unwrapped, **kwargs), self)

    def wait_any(self, futures, timeout_s):
        by_inner = {id(f.inner): f for f in futures}
        return [by_inner[id(f)] for f in self.inner.wait_any([f.inner for f in futures], timeout_s)]

    def kill(self, role) -> None:
        self.inner.kill(role)

    def create_shard(self, shard_id, factory):
        raise NotImplementedError

    def create_replica(self, replica_id, factory, shards, layout, threads):
        raise NotImplementedError

    def shard_client(self, shards, layout, replica_id=-1):
        raise NotImplementedError  # the coordinator must never fetch parameters

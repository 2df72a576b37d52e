"""Model parallelism, simulated: the step time of one model replica split over P machines (paper §3, Fig. 3).

The partitioning is the project's own: ``ExchangePlan`` (partition/plan.py) says which units each partition owns
in every layer and which boxes of units it sends to which partition, so the bytes and messages priced here are the
ones the real partitions send (``MessageStats``). A step runs in partition/partition.py's order:

- forward, layer by layer: the partitions exchange the boxes the plan lists for the layer's input (none for
  layer 0: every partition reads its own inputs from the data), then each computes its region of the output;
- the head gathers the model's output (one message from each other partition) and scatters its gradient back;
- backward, layer by layer in reverse: each partition computes its region's gradients (two multiply-adds per
  forward one), then returns the gradient of every box it received to the box's owner.

Assumptions (one partition per machine):

- a partition computes a layer kind at ``costs.macs_per_s[kind]`` per core times its cores (perfect scaling
  across a machine's cores); with ``machines.shared_cores`` all partitions time-share those cores;
- layers are sequential and partitions within a phase run in parallel; every phase (an exchange, a layer's
  compute) ends when its slowest partition ends — the paper's "everyone waits for the slowest";
- in an exchange a partition pays ``machines.latency_s`` once (its messages are in flight together),
  ``costs.call_s`` per message it sends, and the larger of its bytes out and in at ``machines.bytes_per_s *
  costs.link_efficiency`` (full-duplex links, a non-blocking switch); communication does not overlap compute;
  partitions that share a machine (``one_machine``) pay ``costs.partition_message_s`` per message instead and
  the object store's CPU per byte sent and received;
- every partition pays the step's fixed costs (``step_s + batch * example_s``) once, all at the same time; the
  head's loss is free; activations travel as float32;
- ``jitter`` is machine-speed variance: each partition's compute in each phase is multiplied by a lognormal
  draw of median 1 and log-standard deviation ``jitter``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np

from distbelief.exceptions import ConfigError
from distbelief.partition.layers import Activation, FullyConnected, Layer, Shape, box_volume
from distbelief.partition.model import normalize_input_shape
from distbelief.partition.plan import HEAD, ExchangePlan, PartitionSpec
from distbelief.simulate.costs import Costs
from distbelief.simulate.machines import Machines
from distbelief.simulate.profile import ModelProfile, layer_kind

BYTES_PER_UNIT = 4  # float32 activations and gradients
JITTER_DRAWS = 64  # steps averaged when jitter > 0 (even: the draws come in +/- pairs)


@dataclass(frozen=True)
class PartitionStep:
    """One training step of one model replica split over ``partitions`` machines.

    ``seconds`` is the step (mean over the jitter draws); it is ``compute_path_s + message_path_s +
    straggler_s``: the slowest partition of every compute phase without jitter (plus the fixed costs), the
    slowest of every exchange, and what jitter adds. The per-partition tuples are what each partition does on its
    own: its compute (no jitter, no waiting), the bytes and messages it sends per step (forward activations,
    backward gradients, the output gather and scatter). ``bottleneck`` names the largest of the three parts:
    "compute", "messages" or "stragglers".
    """

    partitions: int
    batch: int
    seconds: float
    compute_s: tuple[float, ...]
    message_bytes: tuple[int, ...]
    messages: tuple[int, ...]
    compute_path_s: float
    message_path_s: float
    straggler_s: float
    bottleneck: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def partition_stack(profile: ModelProfile) -> tuple[Shape, list[Layer]]:
    """The input shape and partition layers of ``profile``: its own layers when it was built from them
    (``profile_layers``), else, for a dense MLP profile (``profile_model`` of a fully connected model), the
    ``FullyConnected``/``Activation`` stack ``models.build_partitioned`` makes of it (which activation does not
    change a cost)."""
    if profile.layers:
        return normalize_input_shape(profile.input_shape), list(profile.layers)
    dense_only = profile.matrices and not profile.macs.get("local") and not profile.macs.get("other")
    if not dense_only or any(m[1] != prev[0] for prev, m in zip(profile.matrices, profile.matrices[1:])):
        raise ConfigError("partitions", f"model {profile.name!r} is neither built from partition layers nor a "
                                        f"fully connected stack, so it cannot be partitioned")
    layers: list[Layer] = []
    for out_features, _ in profile.matrices[:-1]:
        layers += [FullyConnected(out_features), Activation("sigmoid")]
    return (1, profile.matrices[0][1]), layers + [FullyConnected(profile.matrices[-1][0])]


def _exchange_s(units_out: np.ndarray, units_in: np.ndarray, msgs_out: np.ndarray, msgs_in: np.ndarray,
                batch: int, costs: Costs, machines: Machines, one_machine: bool) -> float:
    """One exchange, ended by its slowest partition: per partition that sends or receives, the latency once, a
    call per message sent and the larger of its bytes out and in at the link's rate. Where the partitions share
    a machine (``one_machine``: no link) a message takes ``costs.partition_message_s`` (measured in real
    model-parallel steps on one machine; ``call_s`` when not) and the bytes go through the object store: the CPU
    per byte both ends spend (``local_object_cpu_s_per_byte``), half for what a partition sends and half for what
    it receives."""
    rate = machines.bytes_per_s * costs.link_efficiency
    busy = (msgs_out + msgs_in) > 0
    if not busy.any():
        return 0.0
    if one_machine:
        per_message = costs.call_s if costs.partition_message_s is None else costs.partition_message_s
        moved = (units_out + units_in) * batch * BYTES_PER_UNIT / 2 * costs.local_object_cpu_s_per_byte
    else:
        per_message = costs.call_s
        moved = np.maximum(units_out, units_in) * batch * BYTES_PER_UNIT / rate
    return float((machines.latency_s + msgs_out * per_message + moved)[busy].max())


def _jitter(sigma: float, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """``JITTER_DRAWS`` lognormal speed multipliers (median 1, log-sd ``sigma``) for every entry of ``shape``,
    shape ``(JITTER_DRAWS, *shape)``. Stratified: each entry gets every one of the ``JITTER_DRAWS`` quantiles
    once, in an order a seeded numpy Generator shuffles, so only which machines are slow together is random.
    The quantiles are symmetric pairs ``exp(+-sigma z)`` with mean ``cosh(sigma z) >= 1``, so jitter never makes
    a step faster on average."""
    half = np.array([NormalDist().inv_cdf((k + 0.5) / JITTER_DRAWS) for k in range(JITTER_DRAWS // 2)])
    quantiles = np.exp(sigma * np.concatenate([half, -half[::-1]]))
    order = np.broadcast_to(np.arange(JITTER_DRAWS), (*shape, JITTER_DRAWS))
    picks = np.random.default_rng(seed).permuted(order, axis=-1)
    return np.moveaxis(quantiles[picks], -1, 0)


def partition_step(profile: ModelProfile, partitions: int, batch: int, costs: Costs, machines: Machines, *,
                   cores_per_partition: int | None = None, jitter: float = 0.0, seed: int = 0,
                   one_machine: bool | None = None) -> PartitionStep:
    """The step time of one replica of ``profile`` over ``partitions`` machines, minibatch ``batch`` (see the
    module's assumptions). ``cores_per_partition`` defaults to ``machines.cores_per_node``; ``jitter`` > 0
    averages ``JITTER_DRAWS`` steps with machine-speed variance drawn from ``seed``; ``one_machine``: the
    partitions share one machine, no link between them (by default, when ``machines`` has no link limit)."""
    if batch < 1:
        raise ConfigError("batch", f"must be >= 1, got {batch}")
    if jitter < 0:
        raise ConfigError("jitter", f"must be >= 0, got {jitter}")
    input_shape, layers = partition_stack(profile)
    plan = ExchangePlan.build(input_shape, layers, PartitionSpec(partitions))
    P = partitions
    cores = cores_per_partition or machines.cores_per_node
    if machines.shared_cores:
        cores = min(cores, machines.shared_cores / P)

    # Forward compute of every layer on every partition, then each phase in step order.
    forward = np.array([[box_volume(plan.regions[i][p]) * plan.shapes[i + 1][0] * layer.flops_per_unit(shape)
                         * batch / (costs.macs_per_s[layer_kind(layer)] * cores) for p in range(P)]
                        for i, (layer, shape) in enumerate(zip(layers, plan.shapes))])
    phases = np.concatenate([forward, 2 * forward[::-1]])  # (2 * layers, P): forward, then backward in reverse
    fixed = costs.step_s + batch * costs.example_s
    # a model whose own step the calibration timed computes at that step's pace (as an unpartitioned replica
    # does: simulate/downpour.py ``compute_seconds``), its multiply-adds spread over the partitions as above
    whole = float(phases.sum()) * cores  # the multiply-adds' seconds on one core
    measured = costs.measured_step(profile.name, profile.params, batch, fixed + whole)
    if measured is not None and whole > 0:
        phases = phases * max(0.0, measured - fixed) / whole

    exchanges = []  # (units out, units in, messages out, messages in) per partition, for each exchange
    for i in range(1, len(layers)):
        out = np.array([sum(t.units for t in plan.sends[i][p]) for p in range(P)])
        inn = np.array([sum(t.units for t in plan.recvs[i][p]) for p in range(P)])
        n_out = np.array([len(plan.sends[i][p]) for p in range(P)])
        n_in = np.array([len(plan.recvs[i][p]) for p in range(P)])
        # forward: my boxes to those who need them; backward: their gradients, back along the same edges
        exchanges += [(out, inn, n_out, n_in), (inn, out, n_in, n_out)]
    # the head gathers the output regions and scatters their gradients
    head = np.arange(P) == HEAD
    gathered = np.where(head, 0, [box_volume(plan.regions[-1][p]) * plan.shapes[-1][0] for p in range(P)])
    to_head = (gathered > 0).astype(np.int64)
    at_head, n_head = np.where(head, gathered.sum(), 0), np.where(head, to_head.sum(), 0)
    exchanges += [(gathered, at_head, to_head, n_head), (at_head, gathered, n_head, to_head)]
    if one_machine is None:
        one_machine = math.isinf(machines.bytes_per_s)
    message_path = sum(_exchange_s(*x, batch, costs, machines, one_machine) for x in exchanges)
    units_sent = sum(x[0] for x in exchanges)
    messages_sent = sum(x[2] for x in exchanges)

    compute_path = fixed + float(phases.max(axis=1).sum())
    if jitter > 0:
        seconds = fixed + float((phases * _jitter(jitter, phases.shape, seed)).max(axis=2).sum(axis=1).mean())
    else:
        seconds = compute_path
    straggler = seconds - compute_path  # >= 0 up to rounding (see _jitter)
    seconds += message_path
    parts = {"compute": compute_path, "messages": message_path, "stragglers": straggler}
    return PartitionStep(
        partitions=P, batch=batch, seconds=seconds,
        compute_s=tuple(float(fixed + s) for s in phases.sum(axis=0)),
        message_bytes=tuple(int(u) * batch * BYTES_PER_UNIT for u in units_sent),
        messages=tuple(int(n) for n in messages_sent),
        compute_path_s=compute_path, message_path_s=message_path, straggler_s=straggler,
        bottleneck=max(parts, key=parts.get))


def fig3_curve(profile: ModelProfile, partition_counts: list[int], batch: int, costs: Costs, machines: Machines,
               jitter: float = 0.0, *, seed: int = 0) -> list[dict]:
    """Fig. 3 for ``profile``: for each partition count, the step, its speed-up over one partition (same costs,
    machines and jitter) and the speed-up the same steps would have without jitter (``compute_path_s +
    message_path_s``), what each partition sends and what limits the step."""
    one = partition_step(profile, 1, batch, costs, machines, jitter=jitter, seed=seed)
    rows = []
    for P in partition_counts:
        s = partition_step(profile, P, batch, costs, machines, jitter=jitter, seed=seed)
        rows.append({"P": P, "step_s": s.seconds, "speedup": one.seconds / s.seconds,
                     "speedup_no_jitter": (one.compute_path_s + one.message_path_s) /
                                          (s.compute_path_s + s.message_path_s),
                     "compute_path_s": s.compute_path_s, "message_path_s": s.message_path_s,
                     "straggler_s": s.straggler_s, "max_bytes_per_partition": max(s.message_bytes),
                     "max_messages_per_partition": max(s.messages), "bottleneck": s.bottleneck})
    return rows

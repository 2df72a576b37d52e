"""What things cost on one machine: the numbers the simulator reads.

``distbelief simulate --calibrate`` measures them with the project's own code paths (simulate/calibrate.py) and
writes them as JSON; the simulator reads that file (``--costs FILE``), or the calibration shipped with the package
(``calibration.json``, measured on the benchmark machine: see benchmarks/RESULTS.md). Every field is a plain
number in seconds or bytes per second, so a user can also write one by hand for a machine they cannot calibrate
on (``plan`` for a cluster they do not have yet).

How the simulator uses them:

- a replica's step on one core: ``step_s + batch * (example_s + 3 * macs / macs_per_s[kind])`` summed over the
  model's layer kinds (forward is one multiply-add per weight use, backward two); with ``t`` threads the
  multiply-adds go ``1 + (t - 1) * thread_efficiency`` times faster; each step's time varies by ``compute_cv``
  (a seeded lognormal draw), as real steps do; a model whose step the calibration timed (``step_measured``)
  takes its own measured time instead of the fit's; a step that starts while other computations hold the node's
  other cores runs up to ``contention`` times slower (memory bus and caches shared: all cores busy gives the
  full factor, one other of three a third of it); and ``separate_process_slowdown`` times slower again where the
  replica's shards are not co-located with it but run in processes of their own on the same cores (measured in
  real Downpour runs; replicas on machines of their own, as at the paper's scale, do not pay it);
- Ray's own processes (raylet, GCS, agents) keep ``ray_idle_cores`` of every node busy: every CPU job on a
  node takes ``cores / (cores - ray_idle_cores * nodes on those cores)`` times longer;
- a shard's update of ``n`` values: ``n * update_s_per_value[rule]``; a Ray actor call costs ``call_cpu_s`` of
  CPU (half on the caller's node, half on the callee's: scheduling, arguments, reply) and takes ``call_s`` where
  only its time matters (a model partition's message to a partition on another machine); between two partitions
  sharing a machine a message takes ``partition_message_s`` beyond its bytes (from real model-parallel steps on
  Ray: what a step takes beyond the simulated step without message costs, per message; ``call_s`` when not
  measured);
- bytes between two processes on one node: ``copy_bytes_per_s`` (the shared-memory plane copies once), or,
  through the node's object store (a call's argument or reply over Ray's inline limit),
  ``local_object_cpu_s + bytes * local_object_cpu_s_per_byte`` of CPU, half on each end;
- bytes between nodes through Ray's object store: a fixed cost per object plus the bytes at the slower of
  ``objstore_bytes_per_s`` (the object manager's own rate, measured with no link limit) and the link's rate times
  ``link_efficiency``; the fixed cost is ``objstore_call_s`` on an unlimited link (loopback) and
  ``link_object_s`` on a rate-limited one (the pull protocol's round trips wait in the link's queue); the
  object manager's work is CPU on both nodes (``objstore_cpu_s`` per object, half on each node, and
  ``objstore_cpu_s_per_byte``);
- compression: ``encode_s_per_value[scheme]`` on the replica, ``decode_s_per_value[scheme]`` on the shard, and
  ``delta_s_per_value`` for a shard to find the values changed since a replica's last fetch by a scan of its
  range; a top-k push that the shard steps value by value costs ``sparse_push_s_per_value`` per value it carries
  (instead of decoding and the rule over the range), and a delta fetch after such pushes reads the shard's log of
  changed positions: ``delta_log_s_per_value`` per value it answers; the replica writes a delta answer into its
  parameters at ``delta_load_s_per_value`` per value, and a call carrying an encoded push costs it
  ``encoded_call_cpu_s`` more than a plain call's half (the push's parts pickled, the answer's arrays unpickled).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distbelief.exceptions import ConfigError

SHIPPED = Path(__file__).with_name("calibration.json")
KINDS = ("dense", "local", "other", "elementwise")  # layer kinds with a rate each (simulate/profile.py)


@dataclass
class Costs:
    machine: str = ""
    date: str = ""
    cpus: int = 1
    # replica compute (one core)
    macs_per_s: dict[str, float] = field(default_factory=lambda: {"dense": 2.0e9, "local": 5.0e8, "other": 1.0e9,
                                                                  "elementwise": 2.0e8})
    step_s: float = 1.0e-3
    example_s: float = 1.0e-6
    thread_efficiency: float = 0.8  # each thread beyond a replica's first adds this share of one thread's rate
    compute_cv: float = 0.03  # step-to-step variation of a replica's compute time (standard deviation / mean)
    contention: float = 1.0  # a step's time when every core of its node computes at once, over its time alone
    # a step's time when the shards run in processes of their own on the replica's cores (every push and fetch a
    # Ray call), over its time when the replicas apply their pushes to the shards' memory (co-located)
    separate_process_slowdown: float = 1.0
    # a model's own step, timed (one thread): "model:parameters" -> {batch size: seconds} (``measured_step``)
    step_measured: dict[str, dict[str, float]] = field(default_factory=dict)
    # parameter shards
    update_s_per_value: dict[str, float] = field(default_factory=lambda: {"sgd": 1.0e-9, "adagrad": 4.0e-9})
    call_s: float = 1.0e-3
    call_cpu_s: float = 1.0e-3  # the CPU one call costs the machine: caller, callee and raylet together
    # a boundary message between two partitions of a replica on one machine, beyond its bytes (None: call_s)
    partition_message_s: float | None = None
    # an argument or reply through one node's object store (over Ray's inline limit): CPU per object and per byte
    local_object_cpu_s: float = 3.0e-4
    local_object_cpu_s_per_byte: float = 1.0e-9
    ray_idle_cores: float = 0.0  # cores Ray's own processes keep busy on a node with nothing running
    # data planes
    copy_bytes_per_s: float = 5.0e9
    objstore_call_s: float = 2.0e-3
    objstore_bytes_per_s: float = 1.0e9
    objstore_cpu_s_per_byte: float = 5.0e-10
    objstore_cpu_s: float = 0.0  # ... and per object (both nodes' object managers, the two ends)
    link_efficiency: float = 0.9
    link_object_s: float = 4.0e-3  # fixed cost of one object over a rate-limited link (replaces objstore_call_s)
    # a replica's stream to a shard across nodes (runtime/streams.py): CPU per byte on each end, gloo over TCP
    # (calibrate.py times the product's two ends over loopback: about 0.5 ns a byte for both)
    stream_cpu_s_per_byte: float = 2.5e-10
    # compression
    encode_s_per_value: dict[str, float] = field(default_factory=lambda: {
        "fp16": 1e-9, "topk": 1e-8, "qsgd": 7e-8, "powersgd": 5e-9})
    decode_s_per_value: dict[str, float] = field(default_factory=lambda: {
        "fp16": 1e-9, "topk": 1e-9, "qsgd": 2e-8, "powersgd": 5e-9})
    delta_s_per_value: float = 1.0e-9
    # top-k pushes stepped value by value (ps/shard.py ``_push_values``) and the delta fetches answered from the
    # shard's log of changed positions after them: seconds per value a push carries, per value a fetch answers
    sparse_push_s_per_value: float = 1.0e-7
    delta_log_s_per_value: float = 2.0e-8
    # the replica's side of such answers and pushes (calibrate.py times them through real shards and the
    # product's client): writing a delta answer's values into its parameters, per value; and the CPU a call that
    # carries an encoded push costs its caller beyond a plain call's half and its objects (Ray pickles the
    # push's parts and unpickles the answer's arrays)
    delta_load_s_per_value: float = 2.0e-8
    encoded_call_cpu_s: float = 0.0
    # what was measured, for the record (calibrate.py fills it; the simulator does not read it)
    measurements: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, values: dict[str, Any], source: str = "costs") -> "Costs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError("costs", f"{source}: unknown field(s) {', '.join(unknown)}; a costs file has "
                                       f"{', '.join(sorted(names))}")
        costs = cls(**values)
        costs.check(source)
        return costs

    def check(self, source: str = "costs") -> None:
        """ConfigError naming the field whose value cannot be a cost (negative, zero where it divides, a missing
        layer kind or rule)."""
        positive = ("copy_bytes_per_s", "objstore_bytes_per_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError("costs", f"{source}: {name} must be > 0, got {getattr(self, name)!r}")
        for name in ("step_s", "example_s", "call_s", "objstore_call_s", "link_object_s", "objstore_cpu_s_per_byte",
                     "stream_cpu_s_per_byte", "delta_s_per_value", "sparse_push_s_per_value", "call_cpu_s",
                     "objstore_cpu_s", "local_object_cpu_s", "local_object_cpu_s_per_byte", "delta_log_s_per_value",
                     "delta_load_s_per_value", "encoded_call_cpu_s"):
            if not getattr(self, name) >= 0:
                raise ConfigError("costs", f"{source}: {name} must be >= 0, got {getattr(self, name)!r}")
        if self.partition_message_s is not None and not self.partition_message_s >= 0:
            raise ConfigError("costs", f"{source}: partition_message_s must be >= 0 (or null: call_s), got "
                                       f"{self.partition_message_s!r}")
        if not 0 <= self.thread_efficiency <= 1:
            raise ConfigError("costs", f"{source}: thread_efficiency must be in [0, 1], got {self.thread_efficiency!r}")
        if not self.contention >= 1:
            raise ConfigError("costs", f"{source}: contention must be >= 1, got {self.contention!r}")
        if not self.separate_process_slowdown >= 1:
            raise ConfigError("costs", f"{source}: separate_process_slowdown must be >= 1, got "
                                       f"{self.separate_process_slowdown!r}")
        if not self.ray_idle_cores >= 0:
            raise ConfigError("costs", f"{source}: ray_idle_cores must be >= 0, got {self.ray_idle_cores!r}")
        if not 0 <= self.compute_cv < 1:
            raise ConfigError("costs", f"{source}: compute_cv must be in [0, 1), got {self.compute_cv!r}")
        if not 0 < self.link_efficiency <= 1:
            raise ConfigError("costs", f"{source}: link_efficiency must be in (0, 1], got {self.link_efficiency!r}")
        for kind in KINDS:
            if not self.macs_per_s.get(kind, 0) > 0:
                raise ConfigError("costs", f"{source}: macs_per_s[{kind!r}] must be > 0")
        for rule in ("sgd", "adagrad"):
            if not self.update_s_per_value.get(rule, -1) >= 0:
                raise ConfigError("costs", f"{source}: update_s_per_value[{rule!r}] must be >= 0")

    def scaled(self, factor: float, memory: float | None = None) -> "Costs":
        """These costs on a machine ``factor`` times slower at computing (the replicas' steps, the codecs'
        encodes, Ray's calls: fixed costs) and ``memory`` times slower (``factor`` when None) at the work that
        streams through memory (the shards' updates and reads per value, the decodes, copies and transfers per
        byte): what ``simulate --validate`` predicts a run with when its own timings of a step and of a shard's
        push, just before and after the run, say the machine's speed moved since the calibration. Links and their
        fixed costs stay as they are."""
        f = float(factor)
        m = f if memory is None else float(memory)
        return dataclasses.replace(
            self, macs_per_s={k: v / f for k, v in self.macs_per_s.items()}, step_s=self.step_s * f,
            example_s=self.example_s * f,
            step_measured={k: {b: t * f for b, t in by.items()} for k, by in self.step_measured.items()},
            call_s=self.call_s * f, call_cpu_s=self.call_cpu_s * f, local_object_cpu_s=self.local_object_cpu_s * f,
            partition_message_s=None if self.partition_message_s is None else self.partition_message_s * f,
            encoded_call_cpu_s=self.encoded_call_cpu_s * f,
            objstore_cpu_s=self.objstore_cpu_s * f,
            encode_s_per_value={k: v * f for k, v in self.encode_s_per_value.items()},
            update_s_per_value={k: v * m for k, v in self.update_s_per_value.items()},
            local_object_cpu_s_per_byte=self.local_object_cpu_s_per_byte * m,
            copy_bytes_per_s=self.copy_bytes_per_s / m, objstore_bytes_per_s=self.objstore_bytes_per_s / m,
            objstore_cpu_s_per_byte=self.objstore_cpu_s_per_byte * m,
            stream_cpu_s_per_byte=self.stream_cpu_s_per_byte * m,
            decode_s_per_value={k: v * m for k, v in self.decode_s_per_value.items()},
            delta_s_per_value=self.delta_s_per_value * m, sparse_push_s_per_value=self.sparse_push_s_per_value * m,
            delta_log_s_per_value=self.delta_log_s_per_value * m,
            delta_load_s_per_value=self.delta_load_s_per_value * m)

    def measured_step(self, model: str, params: int, batch: int, fitted: float) -> float | None:
        """Seconds of one step (one thread) of ``model`` with ``params`` parameters at minibatch ``batch`` from
        its timed steps (``step_measured``): the time at the nearest batch size timed, scaled by what the layer
        kinds' fit says (``fitted`` at ``batch`` against the fit at that size: exact at a size timed); None
        when the calibration did not time this model."""
        timed = self.step_measured.get(f"{model}:{params}")
        if not timed:
            return None
        nearest = min(timed, key=lambda b: (abs(int(b) - batch), int(b)))
        seconds = timed[nearest]
        if int(nearest) == batch:
            return seconds
        per_example = (fitted - self.step_s) / batch  # the fit, at the size timed and at this one
        return seconds * fitted / max(1e-12, self.step_s + int(nearest) * per_example)

    def update_s(self, rule: str) -> float:
        """Seconds per value of server rule ``rule`` (rules without a measurement cost what Adagrad costs)."""
        return self.update_s_per_value.get(rule, self.update_s_per_value["adagrad"])


def load_costs(path: str | Path | None = None) -> Costs:
    """The costs in ``path``, or the shipped calibration when ``path`` is None."""
    p = Path(path) if path else SHIPPED
    if not p.is_file():
        if path:
            raise ConfigError("costs", f"no such file: {path} (write one with: distbelief simulate --calibrate "
                                       f"--costs {path})")
        return Costs(machine="uncalibrated defaults")
    try:
        values = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError("costs", f"{p} is not JSON: {e}") from None
    return Costs.from_json(values, str(p))

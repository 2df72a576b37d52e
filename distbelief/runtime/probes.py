"""Ray's costs, timed for the simulator's calibration (simulate/calibrate.py fits and records them).

The engine's side of ``distbelief simulate --calibrate``: actor calls of the runtime's own ``RoleActor`` (replies
small and large, with the CPU they cost the machine); objects fetched between the object stores of two nodes of a
fake cluster (two raylets on this machine, over loopback); the same between two nodes of a shaped cluster
(runtime/netcluster.py). Every Ray instance and cluster started here is shut down before the function returns,
on error too; probes inside a ``local_ray`` block share its instance, which is shut down when the block ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray

Log = Callable[[str], None]


def ray_connected() -> bool:
    return ray.is_initialized()


def on_local_ray(body: Callable[[], Any]) -> Any:
    """``body()`` (runs that start this process's local Ray themselves, as ``train`` does), then Ray shut down,
    on error too: a run leaves its Ray instance up for the next run of the process, and the calibration's next
    measurement starts its own."""
    try:
        return body()
    finally:
        ray.shutdown()


def _local_cpus() -> int:
    return max(2, os.cpu_count() or 1)  # (a local run's: every core; two at least, for two actors on one)


@contextlib.contextmanager
def local_ray():
    """One local Ray instance, started as a local run starts it (``connect``), for the probes and runs inside
    the block: each of them uses it instead of starting one of its own (several seconds of CPU each here). Shut
    down when the block ends, on error too."""
    from distbelief.runtime.ray_runtime import connect

    connect(num_cpus=_local_cpus())
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def _actors_on_local_ray():
    """A list to put the actors a probe makes in, on this process's local Ray: the one ``local_ray`` keeps up
    (then the actors are killed after the probe), else one started for the probe and shut down after it."""
    from distbelief.runtime.ray_runtime import connect

    owned = not ray.is_initialized()
    connect(num_cpus=_local_cpus())
    actors: list = []
    try:
        yield actors
    finally:
        if owned:
            ray.shutdown()
        else:
            for a in actors:
                ray.kill(a, no_restart=True)


def ray_version() -> str:
    return ray.__version__


def actor_call_times(role: type, role_args: tuple, method: str, method_args: tuple, repeats: int, warmup: int,
                     settle: Callable[[], Any]) -> list[float]:
    """Seconds of each of ``repeats`` Ray actor calls (after ``warmup`` untimed ones): the runtime's
    ``RoleActor.call`` of ``role(*role_args).method(*method_args)``, on a local Ray started as a local run starts
    it (``connect``). ``settle()`` runs before the timing (to let Ray's start-up work end)."""
    return actor_call_costs([(role, role_args, method, method_args)], repeats, warmup, settle)[0]["times"]


def actor_call_costs(calls: Sequence[tuple[type, tuple, str, tuple]], repeats: int, warmup: int,
                     settle: Callable[[], Any], cpu: Callable[[], float] = lambda: 0.0) -> list[dict[str, Any]]:
    """For each ``(role, role_args, method, method_args)`` of ``calls``, on one local Ray started as a local run
    starts it (``connect``): the seconds of each of ``repeats`` calls of the runtime's ``RoleActor.call`` of
    ``role(*role_args).method(*method_args)`` (after ``warmup`` untimed ones; ``times``) and what ``cpu()``
    (this machine's busy CPU seconds) grew by over them (``cpu_s``, with ``wall_s``). ``settle()`` runs once,
    before the first timing (to let Ray's start-up work end)."""
    from distbelief.runtime.ray_runtime import role_actor

    with _actors_on_local_ray() as actors:
        actors += [role_actor().options(num_cpus=0, max_concurrency=1).remote(1, role, *args)
                   for role, args, _, _ in calls]
        for a, (_, _, method, margs) in zip(actors, calls):
            ray.get(a.call.remote(method, *margs))
        settle()
        out = []
        for a, (_, _, method, margs) in zip(actors, calls):
            for _ in range(warmup):
                ray.get(a.call.remote(method, *margs))
            times = []
            cpu0, t0 = cpu(), time.perf_counter()  # (the caller's clock: ``cpu_s`` is what it grew by)
            for _ in range(repeats):
                t = time.perf_counter()
                ray.get(a.call.remote(method, *margs))
                times.append(time.perf_counter() - t)
            out.append({"times": times, "cpu_s": cpu() - cpu0, "wall_s": time.perf_counter() - t0})
        return out


class _Producer:
    """An actor on the far node: puts objects into its node's object store for the driver to fetch."""

    def where(self) -> tuple[str, int]:
        """This actor's node id and process id."""
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def put(self, nbytes: int, count: int) -> list:
        return [ray.put(np.full(nbytes // 4, i, np.float32)) for i in range(count)]  # in a list: not fetched


def fetch_times(producer, sizes: Sequence[int], count: int, cpu: Callable[[], float] = lambda: 0.0
                ) -> tuple[list[tuple[int, float]], list[dict[str, float]]]:
    """``(bytes, seconds)`` of each ``ray.get`` by this process of an object that ``producer`` (an actor on
    another node) put, ``count`` objects of each of ``sizes`` (of a large size, only as many as fill 256 MiB);
    and, per size, what ``cpu()`` (CPU seconds so far) grew by over its gets, their wall seconds and count
    (``{"bytes", "objects", "cpu_s", "wall_s"}``)."""
    points, spent = [], []
    for nbytes in sizes:
        # made and sealed there before any timing; at most 256 MiB at once (the probes' stores hold 512 MiB)
        refs = ray.get(producer.put.remote(nbytes, max(2, min(count, 2**28 // nbytes))))
        cpu0, t0 = cpu(), time.perf_counter()  # (the caller's clock, as it is read after)
        for ref in refs:
            t = time.perf_counter()
            value = ray.get(ref)
            points.append((value.nbytes, time.perf_counter() - t))
            del value
        spent.append({"bytes": nbytes // 4 * 4, "objects": len(refs), "cpu_s": cpu() - cpu0,
                      "wall_s": time.perf_counter() - t0})
        del refs
    return points, spent


def objstore_fetches(sizes: Sequence[int], count: int, warmup: int, settle: Callable[[], Any],
                     cpu_seconds: Callable[[Sequence[int]], float]) -> dict[str, Any]:
    """Ray's object store between two raylets (a fake two-node cluster on this machine, no link limit): the
    driver, on the head node, fetches ``count`` objects of each of ``sizes`` that an actor on the other node
    put. Also the CPU seconds (``cpu_seconds(pids)``) that the two raylets (each runs its node's object manager
    and store), the driver and the actor spent during each size's fetches, and what they spend idle per second
    (measured just before)."""
    from distbelief.runtime.local_cluster import fake_cluster
    from distbelief.runtime.ray_runtime import connect

    store = 512 * 2**20
    cluster = fake_cluster(num_cpus=1, object_store_memory=store, include_dashboard=False,
                           _system_config={"enable_metrics_collection": False})
    try:
        cluster.add_node(num_cpus=1, resources={"calibrate_far": 1}, object_store_memory=store)
        cluster.wait_for_nodes()
        connect(address=cluster.address)
        producer = ray.remote(_Producer).options(num_cpus=0, resources={"calibrate_far": 1}).remote()
        far_node, far_pid = ray.get(producer.where.remote())
        if far_node == ray.get_runtime_context().get_node_id():
            raise RuntimeError("the object store probe landed on the driver's node: nothing would cross")
        raylets = [node.all_processes["raylet"][0].process.pid for node in cluster.list_all_nodes()]
        pids = [os.getpid(), far_pid, *raylets]
        fetch_times(producer, sizes[:1], warmup)  # warm-up: the connections between the nodes
        t0 = time.perf_counter()
        settle()
        waited = time.perf_counter() - t0
        idle0, t0 = cpu_seconds(pids), time.perf_counter()
        time.sleep(0.5)
        idle_per_s = (cpu_seconds(pids) - idle0) / (time.perf_counter() - t0)
        points, spent = fetch_times(producer, sizes, count, lambda: cpu_seconds(pids))
    finally:
        ray.shutdown()
        cluster.shutdown()
    return {"points": points, "cpu": spent, "idle_cpu_per_s": idle_per_s, "waited_quiet_s": waited}


_LINK_PROBE = """
import json, sys
from distbelief.runtime.probes import link_probe
print(json.dumps(link_probe(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]))))
"""


def link_probe(address: str, far_ip: str, sizes: Sequence[int], count: int) -> list[tuple[int, float]]:
    """Run on node 0 of a shaped cluster (in its namespace): join the cluster, put an actor on the node at
    ``far_ip`` and fetch ``count`` objects of each of ``sizes`` from it. Returns ``(bytes, seconds)`` per
    fetch."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from distbelief.runtime.ray_runtime import connect

    connect(address=address)
    try:
        far = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == far_ip)
        producer = ray.remote(_Producer).options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(far, soft=False)).remote()
        fetch_times(producer, sizes[:1], 1)  # warm-up
        return fetch_times(producer, sizes, count)[0]
    finally:
        ray.shutdown()


def link_fetches(sizes: Sequence[int], count: int, bandwidth: str, name: str, subnet: str,
                 log: Log) -> tuple[list[tuple[int, float]], float]:
    """``(bytes, seconds)`` of fetches between the two nodes of a shaped cluster (netcluster ``name`` on
    ``subnet``, each link ``bandwidth``; the driver on node 0, the objects put on node 1), and the shaped rate in
    bits/s. Needs root on Linux; the cluster is down again when this returns."""
    from distbelief.runtime import netcluster

    c = netcluster.up(name, nodes=2, bandwidth=bandwidth, cpus_per_node=1, subnet=subnet, log=log)
    try:
        r = subprocess.run(["ip", "netns", "exec", c.nodes[0].netns, sys.executable, "-c", _LINK_PROBE,
                            c.address, c.nodes[1].ip, json.dumps(list(sizes)), str(count)], capture_output=True,
                           text=True, timeout=300, env={**os.environ, "RAY_AUTH_MODE": "token"}, check=False)
    finally:
        netcluster.down(name, log=log)
    if r.returncode != 0:
        raise RuntimeError(f"the link probe failed (status {r.returncode}): {r.stderr.strip()[-2000:]}")
    return [tuple(p) for p in json.loads(r.stdout.strip().splitlines()[-1])], c.bandwidth_bps


def stream_cpu(values: int, count: int, timeout_s: float = 60.0) -> dict[str, float]:
    """A replica's stream to a shard (runtime/streams.py), both ends in this process over loopback: ``count``
    pushes of ``values`` float32 values, each taken by the shard's end, then ``count`` fetch answers the other
    way. Returns the CPU seconds this process spent per byte moved (both ends' work together: gloo's TCP pairs,
    the copies each end makes) and the bytes per second."""
    from distbelief.runtime import streams

    _store, replica, shard = streams.loopback_pair(values, "calibrate", timeout_s)
    v = np.ones(values, np.float32)

    def push():
        index, work = replica.push(v)
        streams.wait(work, time.monotonic() + timeout_s, "push")
        shard.take_push(index, timeout_s)
        shard.applied(index)

    try:
        for _ in range(2):  # warm-up: the connection and the buffers
            push()
        cpu0, t0 = time.process_time(), time.perf_counter()  # (this process's CPU, every thread's)
        for _ in range(count):
            push()
        for _ in range(count):
            index, work, _buf = replica.fetch()
            shard.send_fetch(index, v, timeout_s)
            streams.wait(work, time.monotonic() + timeout_s, "fetch")
        moved = 2 * count * values * 4
        return {"cpu_s_per_byte": (time.process_time() - cpu0) / moved, "bytes_per_s": moved / (time.perf_counter() - t0)}
    finally:
        shard.close()
        replica.close()


def with_actors(roles: Sequence[tuple[type, tuple]], body: Callable[[list], Any]) -> Any:
    """``body(handles)`` on one local Ray started as a local run starts it (``connect``), with one of the
    runtime's role actors per ``(role, role_args)`` of ``roles`` (one call at a time each, as shards run; a
    replica's client of them: ``shard_client``). When ``body`` returns, on error too, the actors are killed
    and Ray is shut down, unless ``local_ray`` keeps it up."""
    from distbelief.runtime.ray_runtime import role_actor

    with _actors_on_local_ray() as handles:
        handles += [role_actor().options(num_cpus=0, max_concurrency=1).remote(1, role, *args)
                    for role, args in roles]
        return body(handles)


def shard_client(handles: list, layout, replica_id: int, timeout_s: float = 60.0):
    """A replica's client of shards ``handles`` (runtime/ray_runtime.py ``RayShardClient``), over the
    object-store transport."""
    from distbelief.runtime.ray_runtime import RayShardClient

    return RayShardClient(handles, layout, replica_id, timeout_s, None, False, False)

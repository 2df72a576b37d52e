"""A multi-node Ray cluster faked on this machine (``ray.cluster_utils.Cluster``), for trying placement, node loss
and elastic runs without a cluster; the tests and benchmarks use it. Every node shares one loopback: no link limits.

Why not ``Cluster(...)`` directly: with a token on this machine (``~/.ray/auth_token``, which any local Ray >= 2.59
creates), a driver joining with an address turns token authentication on (``use_token_if_available``), but nodes
started by ``Cluster`` without ``RAY_AUTH_MODE`` do not, and Ray then cancels every actor placed on them ("shard 0
died: ActorDiedError" at start-up). Deciding the mode first, here, makes the nodes and the driver agree."""

from __future__ import annotations

from ray.cluster_utils import Cluster

from distbelief.runtime.ray_runtime import use_token_if_available


def fake_cluster(**head_node_args) -> Cluster:
    """A ``Cluster`` with its head node started with ``head_node_args``; add nodes with ``add_node``, join it with
    ``RayRuntime(address=cluster.address)``, and ``shutdown()`` it when done."""
    use_token_if_available()
    return Cluster(initialize_head=True, head_node_args=head_node_args)

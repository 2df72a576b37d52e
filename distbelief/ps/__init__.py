"""The sharded parameter server: layout, shards, server update rules."""

from distbelief.ps.optimizers import SGD, Adagrad, make_server_optimizer
from distbelief.ps.shard import ParameterShard
from distbelief.ps.sharding import ShardLayout, bind_flat, flatten, param_specs, unflatten_into

__all__ = [
    "SGD",
    "Adagrad",
    "make_server_optimizer",
    "ParameterShard",
    "ShardLayout",
    "bind_flat",
    "flatten",
    "param_specs",
    "unflatten_into",
]

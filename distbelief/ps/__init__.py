"""The sharded parameter server: layout, shards, server update rules."""

from distbelief.ps.optimizers import make_server_optimizer
from distbelief.ps.rules import RULES, SGD, Adagrad, RowwiseAdagrad, make_rule, register, rule_names
from distbelief.ps.shard import ParameterShard
from distbelief.ps.sharding import ShardLayout, bind_flat, flatten, param_specs, unflatten_into

__all__ = [
    "RULES",
    "SGD",
    "Adagrad",
    "RowwiseAdagrad",
    "make_rule",
    "make_server_optimizer",
    "register",
    "rule_names",
    "ParameterShard",
    "ShardLayout",
    "bind_flat",
    "flatten",
    "param_specs",
    "unflatten_into",
]

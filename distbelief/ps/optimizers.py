"""Compatibility: the server update rules now live in :mod:`distbelief.ps.rules` (one module per rule, a
registry). This module keeps the old names importable.

``staleness_aware`` (beyond the paper; Zhang, Gupta, Lian and Liu, "Staleness-aware Async-SGD", IJCAI 2016):
a push computed from parameters ``tau`` updates old is applied with the rate divided by ``tau`` (by 1 when
``tau`` <= 1), so stale gradients move the parameters less. Adagrad's accumulator still adds the full ``g^2``.
"""

from __future__ import annotations

from distbelief.ps.rules import SGD, Adagrad, RowwiseAdagrad, make_rule

__all__ = ["SGD", "Adagrad", "RowwiseAdagrad", "make_server_optimizer"]


def make_server_optimizer(name: str, lr: float, eps: float = 1e-10, initial_accumulator: float = 0.0,
                          staleness_aware: bool = False):
    """``make_rule`` with the old positional signature."""
    return make_rule(name, lr=lr, eps=eps, initial_accumulator=initial_accumulator,
                     staleness_aware=staleness_aware)

"""The vector ops Sandblaster adds to ParameterShard: lincomb, fused multi-dot, and op programs."""

import numpy as np
import pytest
import torch

from distbelief.ps.shard import PARAMS, ParameterShard


def shard():
    s = ParameterShard(0, 0, 4, np.array([1, 2, 3, 4], np.float32), None, 4)
    s.vectors["x"] = torch.tensor([1.0, 0, 0, 1])
    s.vectors["d"] = torch.tensor([0.0, 1, 1, 0])
    return s


def test_lincomb_writes_params_in_place_so_fetch_sees_it():
    s = shard()
    fetched, _ = s.fetch()
    s.lincomb(PARAMS, [(1.0, "x"), (0.5, "d")])  # a line-search trial point
    assert fetched.tolist() == [1.0, 0.5, 0.5, 1.0]


def test_lincomb_with_the_destination_among_its_terms():
    s = shard()
    s.lincomb("x", [(2.0, "x"), (-1.0, "d"), (1.0, "x")])  # x = 3x - d
    assert s.vectors["x"].tolist() == [3.0, -1.0, -1.0, 3.0]
    s.lincomb("new", [(3.0, "d")])  # a new name starts from zero
    assert s.vectors["new"].tolist() == [0.0, 3.0, 3.0, 0.0]


def test_dots_match_dot_and_are_float64():
    s = shard()
    got = s.dots([("x", "d"), (PARAMS, "x"), (PARAMS, PARAMS)])
    assert got == [s.dot("x", "d"), s.dot(PARAMS, "x"), s.dot(PARAMS, PARAMS)] == [0.0, 5.0, 30.0]
    s.vectors["tiny"] = torch.full((4,), 1e-4)
    assert s.dots([("tiny", "tiny")])[0] == pytest.approx(4e-8, rel=1e-6)


def test_execute_runs_a_program_in_order_and_refuses_other_methods():
    s = shard()
    out = s.execute([("copy", PARAMS, "x0"), ("lincomb", PARAMS, [(1.0, "x0"), (-1.0, "d")]),
                     ("dots", [(PARAMS, "d")]), ("zero", "d"), ("dot", "d", "d")])
    assert out == [None, None, [3.0], None, 0.0]
    assert s.vectors[PARAMS].tolist() == [1.0, 1.0, 2.0, 4.0]
    with pytest.raises(ValueError, match="not a vector op"):
        s.execute([("push", 0, np.zeros(4, np.float32), 0, 0)])

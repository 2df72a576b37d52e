"""The scalar (vector-free) two-loop recursion equals the textbook two-loop on explicit vectors."""

import pytest
import torch

from distbelief.sandblaster.lbfgs import Gram, directional_derivative, two_loop_coefficients


def dense_two_loop(S, Y, g):
    q = g.clone()
    alphas = []
    for s, y in reversed(list(zip(S, Y))):
        a = s.dot(q) / s.dot(y)
        q -= a * y
        alphas.append(a)
    alphas.reverse()
    if S:
        q *= S[-1].dot(Y[-1]) / Y[-1].dot(Y[-1])
    for (s, y), a in zip(zip(S, Y), alphas):
        b = y.dot(q) / s.dot(y)
        q += (a - b) * s
    return -q


@pytest.mark.parametrize("m", [0, 1, 3, 7])
def test_coefficients_reproduce_the_dense_direction(m):
    gen = torch.Generator().manual_seed(m)
    n = 40
    A = torch.randn(n, n, generator=gen, dtype=torch.float64)
    H = A @ A.T + n * torch.eye(n, dtype=torch.float64)  # SPD: every pair has <s, y> > 0
    S = [torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(m)]
    Y = [H @ s for s in S]
    g = torch.randn(n, generator=gen, dtype=torch.float64)
    vecs = {"g": g, **{f"s{i}": s for i, s in enumerate(S)}, **{f"y{i}": y for i, y in enumerate(Y)}}
    gram = Gram()
    for a, va in vecs.items():
        for b, vb in vecs.items():
            gram.set(a, b, float(va.dot(vb)))
    coeffs = two_loop_coefficients([(f"s{i}", f"y{i}") for i in range(m)], "g", gram)
    d = sum(c * vecs[name] for name, c in coeffs.items())
    expected = dense_two_loop(S, Y, g)
    torch.testing.assert_close(d, expected, rtol=1e-10, atol=1e-10)
    assert directional_derivative(coeffs, "g", gram) == pytest.approx(float(g.dot(expected)), rel=1e-10)
    assert float(g.dot(d)) < 0  # a descent direction


def test_gram_is_symmetric_and_forgets_overwritten_vectors():
    gram = Gram()
    gram.set("a", "b", 2.0)
    gram.set("b", "c", 3.0)
    assert gram("b", "a") == 2.0 and ("a", "b") in gram
    gram.forget("b")
    assert ("a", "b") not in gram and ("c", "b") not in gram

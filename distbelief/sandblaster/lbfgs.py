"""L-BFGS in scalars: the two-loop recursion written over a Gram matrix of named shard vectors.

The coordinator never holds a vector. It knows the L-BFGS basis only by the *names* of vectors that live sliced on
the shards (``s0..s{m-1}``, ``y0..y{m-1}`` and the current gradient) and by their pairwise inner products, which
the shards return as partial scalars. The classic two-loop recursion

    q = g
    for i = newest .. oldest:  alpha_i = rho_i <s_i, q>;  q -= alpha_i y_i
    r = gamma q                                  (gamma = <s, y> / <y, y> of the newest pair)
    for i = oldest .. newest:  beta = rho_i <y_i, r>;  r += (alpha_i - beta) s_i
    d = -r

only ever forms linear combinations of the basis vectors, so ``q`` and ``r`` can be carried as coefficients over
the basis and every inner product ``<b_l, q>`` expanded through the Gram matrix (the "vector-free" L-BFGS of
Chen et al., NIPS 2014). The result is the direction's coefficients; one ``lincomb`` on the shards then builds
``d``. This turns the 4m dependent round trips of a literal shard-op two-loop into zero: the only round trips per
iteration are one fused multi-dot (new Gram entries) and one ``lincomb``.

Everything here is pure Python on floats, testable without shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class LBFGSSettings:
    """L-BFGS and line-search constants (the paper names none of them; see docs/sandblaster.md).

    Attributes:
        history: m, the number of (s, y) pairs kept.
        c1: Armijo sufficient-decrease constant: accept t when f(x + t d) <= f(x) + c1 t <g, d>.
        backtrack: factor applied to t after a rejected trial point.
        max_evals: trial points per line search before it is declared failed.
        curvature_eps: a pair is stored only when <s, y> > curvature_eps (keeps H positive definite).
        grad_tol: stop when ||g|| <= grad_tol (0 = never).
    """

    history: int = 10
    c1: float = 1e-4
    backtrack: float = 0.5
    max_evals: int = 20
    curvature_eps: float = 1e-10
    grad_tol: float = 0.0


class Gram:
    """Symmetric table of inner products between named shard vectors (float64 scalars)."""

    def __init__(self) -> None:
        self._v: dict[tuple[str, str], float] = {}

    @staticmethod
    def _key(a: str, b: str) -> tuple[str, str]:
        return (a, b) if a <= b else (b, a)

    def __call__(self, a: str, b: str) -> float:
        return self._v[self._key(a, b)]

    def __contains__(self, pair: tuple[str, str]) -> bool:
        return self._key(*pair) in self._v

    def set(self, a: str, b: str, value: float) -> None:
        self._v[self._key(a, b)] = float(value)

    def forget(self, name: str) -> None:
        """Drop every entry involving ``name`` (its vector was overwritten)."""
        self._v = {k: v for k, v in self._v.items() if name not in k}

    def clear(self) -> None:
        self._v.clear()

    def entries(self) -> list[tuple[str, str, float]]:
        """Every stored inner product as ``(a, b, value)`` (for the coordinator's durable state)."""
        return [(a, b, v) for (a, b), v in sorted(self._v.items())]

    @classmethod
    def from_entries(cls, entries) -> "Gram":
        gram = cls()
        for a, b, v in entries:
            gram.set(a, b, v)
        return gram


def two_loop_coefficients(pairs: list[tuple[str, str]], g: str, dot: Callable[[str, str], float]) -> dict[str, float]:
    """Coefficients ``c`` with ``d = sum_l c[l] * b_l = -H g`` (the L-BFGS direction).

    Args:
        pairs: the live ``(s_name, y_name)`` pairs, oldest first; every pair has ``<s, y> > 0``.
        g: the name of the current gradient.
        dot: ``dot(a, b)`` -> ``<a, b>`` for any two names among the pairs and ``g``.

    With no pairs the direction is steepest descent, ``d = -g``.
    """
    q: dict[str, float] = {g: 1.0}

    def inner(name: str, coeffs: dict[str, float]) -> float:
        return sum(c * dot(name, b) for b, c in coeffs.items() if c != 0.0)

    alphas: list[float] = []
    for s, y in reversed(pairs):
        alpha = inner(s, q) / dot(s, y)
        q[y] = q.get(y, 0.0) - alpha
        alphas.append(alpha)
    alphas.reverse()
    if pairs:
        s, y = pairs[-1]
        gamma = dot(s, y) / dot(y, y)
        q = {b: gamma * c for b, c in q.items()}
    for (s, y), alpha in zip(pairs, alphas):
        beta = inner(y, q) / dot(s, y)
        q[s] = q.get(s, 0.0) + alpha - beta
    return {b: -c for b, c in q.items() if c != 0.0}


def directional_derivative(coeffs: dict[str, float], g: str, dot: Callable[[str, str], float]) -> float:
    """``<g, d>`` for ``d = sum_l coeffs[l] * b_l``, from the Gram matrix alone."""
    return sum(c * dot(g, b) for b, c in coeffs.items())

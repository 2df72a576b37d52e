"""Server update rules: how a ParameterShard turns a pushed gradient into new parameters, in place.

A rule is a frozen dataclass (it is pickled to every shard and co-located replica) holding its settings
(``lr`` and whatever else it reads, e.g. ``eps``). It implements:

``summary: ClassVar[str]``
    a few words for ``--help`` and the docs.
``scratch: ClassVar[tuple[str, ...]]``
    names of state entries that are scratch space: never checkpointed, replicated or shared with co-located
    replicas (each process keeps its own).
``init_state(n) -> dict[str, Tensor]``
    the state of a dense slice of ``n`` float32 parameters (e.g. Adagrad's ``sum_sq``, shape ``(n,)``).
``rate_scale(staleness) -> float``
    the factor on the rate for a push computed ``staleness`` updates ago (1.0 unless ``staleness_aware``).
``apply(w, g, state, scale=1.0)``
    ``w`` (a slice, float32) takes the step for gradient ``g`` (same shape) with rate ``lr * scale``, in place;
    ``state`` is ``init_state``'s dict, sliced like ``w``.
``init_row_state(num_rows, dim) -> dict[str, Tensor]``
    the state of an embedding-table slice of ``num_rows`` rows of ``dim`` floats.
``apply_rows(weight, rows, g, state, scale=1.0)``
    sparse step on a table slice: ``weight`` ``(num_rows, dim)``, ``rows`` a 1-D int64 tensor of *unique* local
    row indices, ``g`` ``(len(rows), dim)`` (the caller has summed duplicate ids, e.g. with
    ``torch.sparse_coo_tensor(...).coalesce()``), ``state`` ``init_row_state``'s dict. Only those rows of
    ``weight`` and of the state change; every other row stays bit for bit as it was.

Optional: ``zero_gradient_keeps: ClassVar[bool]``, True when a value whose gradient is 0 stays bit for bit
(and its state too): a shard then tells a replica's delta fetch (``--compress-fetch delta``) only the values a
push changed; without it every value a push covers counts as changed.

Optional: ``elementwise: ClassVar[bool]``, True when each value's step reads only its own gradient and state
entries. With ``zero_gradient_keeps`` too, a shard applies a sparse push (``--compress topk``) to the values it
carries alone, gathered and scattered back, at a cost that follows the push's size, not the range's.

Optional: ``torch_optimizer(params) -> torch.optim.Optimizer``, the same rule in ``torch.optim`` for the
strategies that train without a parameter server (sgd, hogwild, ddp). A rule without one (or with
``torch_optimizer = None``) is refused for them by ``RunConfig.validate``.

Adding a rule: one module here with the class, one line in ``RULES``. Its name is then a valid
``--optimizer`` / ``optimizer =`` choice (config.py and the CLI read their choices from ``RULES``). Rules
defined outside the package register with ``@register("name")``.
"""

from __future__ import annotations

import dataclasses

from distbelief.ps.rules.adagrad import Adagrad
from distbelief.ps.rules.rowwise_adagrad import RowwiseAdagrad
from distbelief.ps.rules.sgd import SGD

__all__ = ["RULES", "SGD", "Adagrad", "RowwiseAdagrad", "has_torch_optimizer", "make_rule", "persistent",
           "register", "rule_names", "steps_pushed_values_alone"]

# name (the --optimizer choice) -> rule class. One line per rule.
RULES: dict[str, type] = {
    "sgd": SGD,
    "adagrad": Adagrad,
    "rowwise-adagrad": RowwiseAdagrad,
}


def register(name: str):
    """Class decorator: make ``cls`` the rule called ``name`` (for rules defined outside this package).

    Raises:
        ValueError: ``name`` is taken.
    """

    def add(cls: type) -> type:
        if name in RULES:
            raise ValueError(f"server rule {name!r} is already registered ({RULES[name].__name__})")
        RULES[name] = cls
        return cls

    return add


def rule_names() -> tuple[str, ...]:
    """The registered rule names, in registration order."""
    return tuple(RULES)


def make_rule(name: str, *, lr: float, eps: float = 1e-10, initial_accumulator: float = 0.0,
              staleness_aware: bool = False):
    """The rule called ``name`` with the run's settings; a rule takes those of its fields it declares (SGD
    ignores ``eps`` and ``initial_accumulator``).

    Raises:
        ValueError: ``name`` is not registered; the message lists the choices.
    """
    cls = RULES.get(name)
    if cls is None:
        raise ValueError(f"unknown server optimizer {name!r}; choose one of: {', '.join(RULES)}")
    settings = {"lr": lr, "eps": eps, "initial_accumulator": initial_accumulator,
                "staleness_aware": staleness_aware}
    declared = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in settings.items() if k in declared})


def steps_pushed_values_alone(rule) -> bool:
    """Whether ``rule`` may step only the values a sparse push carries: it is ``elementwise`` and leaves a value
    whose gradient is 0 as it is (``zero_gradient_keeps``)."""
    return bool(getattr(rule, "elementwise", False) and getattr(rule, "zero_gradient_keeps", False))


def has_torch_optimizer(name: str) -> bool:
    """Whether rule ``name`` has a ``torch.optim`` counterpart (the sgd, hogwild and ddp strategies need one)."""
    return getattr(RULES[name], "torch_optimizer", None) is not None


def persistent(rule, state: dict) -> dict:
    """``state`` without ``rule``'s scratch entries: what is checkpointed, replicated and shared. ``rule`` None
    (a shard holding only vectors) has no scratch."""
    scratch = rule.scratch if rule is not None else ()
    return {k: v for k, v in state.items() if k not in scratch}

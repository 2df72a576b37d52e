"""The Fig. 4/5 benchmark recipes: the calibrated FULL recipe and the tiny QUICK one, the methods' labels, and each
method's RunConfig settings at a given core count.

The recipes are data: their values live in ``recipes.toml`` next to this module (installed with the package) and
are read once, at import.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass
from importlib import resources
from typing import Any

from distbelief.exceptions import ConfigError

RECIPES_FILE = "recipes.toml"


@dataclass(frozen=True)
class Recipe:
    """Task, model, budget and each method's calibrated settings for one sweep."""

    label: str
    common: dict[str, Any]  # RunConfig settings every run shares (task, model, batch size, eval cadence...)
    warmstart: dict[str, Any]  # the single-process SGD warmstart run's settings
    target_accuracy: float
    max_seconds: float  # budget per run
    methods: dict[str, dict[str, Any]]  # method name -> RunConfig settings (calibrated rates)
    shards: int = 2
    notes: str = ""


def _load() -> dict[str, Any]:
    text = resources.files(__package__).joinpath(RECIPES_FILE).read_text(encoding="utf-8")
    return tomllib.loads(text)


def _recipe_from(table: dict[str, Any], name: str) -> Recipe:
    fields = {f.name for f in dataclasses.fields(Recipe)}
    unknown = sorted(set(table) - fields)
    if unknown:
        raise ValueError(f"{RECIPES_FILE} [{name}]: unknown key(s) {', '.join(unknown)}; "
                         f"a recipe has {', '.join(sorted(fields))}")
    return Recipe(**table)


_DATA = _load()
# The calibrated recipe (docs/reproducing.md tells how each number was chosen; recipes.toml says why).
FULL = _recipe_from(_DATA["full"], "full")
# Tiny sizes: the whole sweep's mechanics in a few minutes (CI runs it); its numbers mean nothing.
QUICK = _recipe_from(_DATA["quick"], "quick")
LABELS: dict[str, str] = dict(_DATA["labels"])
del _DATA


def method_settings(recipe: Recipe, method: str, cores: int) -> dict[str, Any]:
    """RunConfig settings of ``method`` using ``cores`` cores: threads for one process, else one worker a core."""
    s = dict(recipe.common, **recipe.methods[method])
    if s["strategy"] == "sgd":
        s.setdefault("threads", cores)
    else:
        s.update(replicas=cores, threads=1)
        if s["strategy"] in ("downpour", "sandblaster"):
            s.setdefault("shards", recipe.shards)
    return s


def label(method: str, cores: int) -> str:
    text = LABELS[method].format(c=cores)
    return re.sub(r"\b1 (thread|replica|rank|worker)s\b", r"1 \1", text)


def recipe_for(quick: bool, max_seconds: float | None) -> Recipe:
    """QUICK or FULL, with its per-run budget replaced by ``max_seconds`` when given (it must be > 0)."""
    recipe = QUICK if quick else FULL
    if max_seconds is not None:
        if not max_seconds > 0:
            raise ConfigError("max_seconds", f"the per-run budget must be > 0, got {max_seconds}")
        recipe = dataclasses.replace(recipe, max_seconds=float(max_seconds))
    return recipe

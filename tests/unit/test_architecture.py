"""The import graph of the package (imports inside functions included) has no cycle, and only the runtime layer
imports the engine (Ray)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "distbelief"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _imports(path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(package modules imported, top-level external packages imported) by one file, anywhere in it."""
    inner, outer = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "distbelief":
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    inner.add(sub if sub in modules else node.module)
            else:
                outer.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "distbelief":
                    inner.add(alias.name)
                else:
                    outer.add(alias.name.split(".")[0])
    return inner, outer


def _graph():
    modules = _modules()
    edges, external = {}, {}
    for name, path in modules.items():
        inner, outer = _imports(path, modules)
        edges[name] = {m for m in inner if m in modules and m != name}
        external[name] = outer
    return edges, external


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    edges, _ = _graph()
    assert len(edges) > 40  # the walk really saw the package
    assert _cycles(edges) == []


def test_a_planted_cycle_is_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_the_runtime_layer_imports_ray():
    _, external = _graph()
    users = sorted(m for m, pkgs in external.items() if "ray" in pkgs)
    assert users and all(m.startswith("distbelief.runtime.") for m in users), users


def test_the_runtime_layer_knows_roles_not_algorithms():
    """runtime/ imports only itself and the exceptions — plus the one documented upward edge: the co-located
    update runs the shard's own update code (ps/colocated.py) in the replica's process."""
    edges, _ = _graph()
    allowed = {"distbelief.exceptions", "distbelief.ps.colocated"}
    bad = {m: sorted(d for d in deps if not d.startswith("distbelief.runtime") and d not in allowed)
           for m, deps in edges.items() if m.startswith("distbelief.runtime")}
    assert {m: d for m, d in bad.items() if d} == {}


def test_roles_and_their_internals_never_import_a_driver():
    """Imports point down: nothing below the strategies imports a trainer, the API, the CLI or the benchmarks."""
    edges, _ = _graph()
    drivers = ("distbelief.api", "distbelief.cli", "distbelief.bench", "distbelief.downpour.trainer",
               "distbelief.downpour.sync", "distbelief.sandblaster.trainer", "distbelief.baselines.multiprocess",
               "distbelief.baselines.single", "distbelief.partition.baseline")
    below = [m for m in edges if m.startswith(("distbelief.ps", "distbelief.runtime", "distbelief.partition.",
                                               "distbelief.sandblaster.", "distbelief.downpour.replica",
                                               "distbelief.supervisor", "distbelief.summary", "distbelief.metrics",
                                               "distbelief.testing"))
             and not m.startswith(drivers)]
    assert len(below) > 20
    bad = {m: sorted(d for d in edges[m] if d.startswith(drivers)) for m in below}
    assert {m: d for m, d in bad.items() if d} == {}


def test_the_product_never_imports_its_test_tooling():
    """Fault injection lives in distbelief/testing and reaches a run only through the run hooks (hooks.py): no
    driver, replica or shard imports it (imports inside functions included). A test hook in the product would make
    a test run differ from a user's."""
    edges, _ = _graph()
    product = [m for m in edges if not m.startswith("distbelief.testing")]
    assert len(product) > 50
    bad = {m: sorted(d for d in edges[m] if d.startswith("distbelief.testing")) for m in product}
    assert {m: d for m, d in bad.items() if d} == {}

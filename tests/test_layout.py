"""The house's layout (docs/design.md, "Layout"): no import circle among the project's modules,
counting imports inside functions and under TYPE_CHECKING (they hide a circle, they do not
remove it), and each layer importing only the layers below it."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"strata_jax": ROOT / "strata_jax", "strata_runtime": ROOT / "runtime"}
LAYERS = {
    "strata_jax.formats": set(),
    "strata_jax.ops": {"strata_jax.formats"},
    "strata_jax.model": {"strata_jax.formats", "strata_jax.ops", "strata_jax.step.plan"},
    "strata_jax.step": {"strata_jax.formats", "strata_jax.ops", "strata_jax.model"},
    "strata_jax.batching": {"strata_jax.formats", "strata_jax.ops", "strata_jax.model",
                            "strata_jax.step"},
    "strata_jax.api": {"strata_jax.formats", "strata_jax.ops", "strata_jax.model",
                       "strata_jax.step", "strata_jax.batching"},
    "strata_jax.tools": {"strata_jax.formats", "strata_jax.ops", "strata_jax.model",
                         "strata_jax.step", "strata_jax.batching", "strata_jax.api"},
    "strata_runtime.residency": {"strata_jax"},
    "strata_runtime.engine": {"strata_jax", "strata_runtime.residency"},
    "strata_runtime.serving": {"strata_jax", "strata_runtime.residency",
                               "strata_runtime.engine"},
    "strata_runtime.lab": {"strata_jax", "strata_runtime.residency", "strata_runtime.engine"},
    "strata_runtime.cli": {"strata_jax", "strata_runtime"},
}
"""Each layer and the layers it may import (a prefix names a package and all below it)."""


def modules() -> dict[str, Path]:
    """Every project module by its dotted name (a package by its __init__)."""
    out = {}
    for name, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [name, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in it (`from pkg import mod` names the
    module; a name defined in a package names the package)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module in known:
            subs = {f"{node.module}.{a.name}" for a in node.names}
            found |= {s for s in subs if s in known} or {node.module}
            if subs - known:
                found.add(node.module)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, set(mods)) - {name} for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _layer(module: str) -> str | None:
    return next((k for k in sorted(LAYERS, key=len, reverse=True)
                 if module == k or module.startswith(k + ".")), None)


def test_no_import_circle():
    edges = graph()
    edges.pop("strata_jax", None)  # the package's face re-exports the API; nothing imports it
    edges = {k: v - {"strata_jax"} for k, v in edges.items()}
    assert cycles(edges) == []


def test_each_layer_imports_only_the_layers_below():
    wrong = []
    for module, targets in graph().items():
        layer = _layer(module)
        if layer is None:
            continue
        allowed = LAYERS[layer] | {layer}
        for target in targets:
            if target in ("strata_jax", "strata_runtime"):
                continue
            if not any(target == a or target.startswith(a + ".") for a in allowed):
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_the_graph_is_read():
    """The walk sees the edges it must (a guard against a vacuous pass)."""
    edges = graph()
    assert "strata_jax.model.decoder" in edges["strata_jax.step.programs"]
    assert "strata_runtime.serving.server" in edges["strata_runtime.cli.serve"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]

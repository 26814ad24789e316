"""The package's boundaries, read from its source: no import cycle (deferred imports included), mpi4py only
in ``mpicomm/comm/``, and no private codec module imported from outside ``mpicomm/codecs/``."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "mpicomm"


def modules() -> dict[str, pathlib.Path]:
    """Dotted name -> file of every module of the package (a package by its ``__init__``)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported(name: str, path: pathlib.Path, known: dict) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its body (``from x import y`` counts module
    ``x.y`` when that is a module, else ``x``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in known else base)
    return {m for m in out if m in known}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) - {name} for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def without_ancestors(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The edges, less those from a module to a package that contains it: Python runs a package's
    ``__init__`` before any of its modules, so such an import finds it loaded and cannot close a cycle."""
    return {v: {w for w in ws if not v.startswith(w + ".")} for v, ws in edges.items()}


def test_no_import_cycle():
    assert cycles(without_ancestors(graph())) == []


def test_mpi4py_only_in_comm():
    offenders = []
    for name, path in modules().items():
        if name.startswith("mpicomm.comm"):
            continue
        source = path.read_text()
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "mpi4py" for a in node.names):
                offenders.append(name)
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mpi4py":
                offenders.append(name)
            if isinstance(node, ast.Attribute) and node.attr == "comm" and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "comm":
                offenders.append(f"{name} (.comm.comm)")
    assert offenders == []


def test_private_codec_modules_stay_inside_codecs():
    offenders = []
    for name, path in modules().items():
        if name.startswith("mpicomm.codecs"):
            continue
        for target in imported(name, path, modules()):
            if target.startswith("mpicomm.codecs") and any(p.startswith("_") for p in target.split(".")):
                offenders.append(f"{name} -> {target}")
    assert offenders == []

"""The package's boundaries, read from its source: no import cycle (deferred imports included), mpi4py and the
raw MPI communicator only in ``mpicomm/comm/``, nothing imported from the apps, no private codec module imported
from outside ``mpicomm/codecs/``, ``algorithms/`` holding only its family packages at the top, and no module
longer than a newcomer can read (500 lines)."""

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


MPI_METHODS = {"Get_rank", "Get_size", "Barrier", "Dup", "Free", "Split", "Abort", "Allreduce", "Allgather",
               "Iallgather", "Iallreduce", "Bcast", "Alltoall", "Isend", "Irecv", "Send", "Recv", "Test", "Wait",
               "Waitall", "Testall", "Win", "Create_dist_graph_adjacent"}
"""mpi4py's spellings of the calls on a raw communicator or request (the Communicator's are lower case)."""


def root_modules(tree: ast.AST) -> set[str]:
    """The first component of every absolute import in ``tree``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.add((node.module or "").split(".")[0])
    return out


def test_mpi_only_in_comm():
    offenders = []
    for name, path in modules().items():
        if name.startswith("mpicomm.comm"):
            continue
        tree = ast.parse(path.read_text())
        if "mpi4py" in root_modules(tree):
            offenders.append(f"{name} imports mpi4py")
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            if node.attr in MPI_METHODS:
                offenders.append(f"{name} calls .{node.attr} (line {node.lineno})")
            inner = node.value
            if node.attr == "comm" and (isinstance(inner, ast.Attribute) and inner.attr == "comm"
                                        or isinstance(inner, ast.Name) and inner.id == "comm"):
                offenders.append(f"{name} reaches the raw communicator (line {node.lineno})")
    assert offenders == []


def test_the_library_never_imports_the_apps():
    apps = {p.stem for p in (ROOT.parent / "apps").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()
            or p.is_dir()} | {"apps"}
    offenders = []
    for name, path in modules().items():
        source = path.read_text()
        tree = ast.parse(source)
        hits = root_modules(tree) & apps
        paths = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                 and (n.value == "apps" or n.value.startswith("apps/"))]
        if hits or (paths and "sys.path" in source):  # apps/ put on sys.path to import from it
            offenders.append(f"{name}: {sorted(hits) + paths}")
    assert offenders == []


def test_algorithms_top_holds_only_families_base_and_registry():
    top = ROOT / "algorithms"
    loose = sorted(p.name for p in top.iterdir() if p.suffix == ".py" and p.name not in ("__init__.py", "registry.py"))
    assert loose == []
    assert (top / "base" / "__init__.py").is_file()


def test_no_module_over_500_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > 500}
    assert long == {}


def test_private_codec_modules_stay_inside_codecs():
    offenders = []
    for name, path in modules().items():
        if name.startswith("mpicomm.codecs"):
            continue
        for target in imported(name, path, modules()):
            if target.startswith("mpicomm.codecs") and any(p.startswith("_") for p in target.split(".")):
                offenders.append(f"{name} -> {target}")
    assert offenders == []

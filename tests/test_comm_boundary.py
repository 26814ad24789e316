"""Only ``mpicomm/comm/`` speaks to MPI: no other module imports mpi4py or calls a method of its communicators.

The modules are read, not run (their syntax trees). A call is raw MPI when its method has the name of a
method of one of mpi4py's classes as its own stub file (``mpi4py/MPI.pyi``) lists them in capitals
(``Allreduce``, ``Iallgather``, ``Barrier``, ...: mpicomm's Communicator and World name theirs in lower
case), or when it goes through the raw communicator a Communicator or World holds (``comm.comm.x``,
``world.comm.x``), whatever its case. ``importlib.metadata.version("mpi4py")`` (the checkpoint's record of
versions) reads a package's metadata: no import, no call.
"""

import ast
import importlib.util
import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mpicomm"
HOLDERS = {"comm", "world", "_comm", "_world"}  # names a Communicator or World goes by


def _mpi_methods() -> set[str]:
    """The capitalised method names of every class in mpi4py's ``MPI.pyi``."""
    stub = Path(os.path.dirname(importlib.util.find_spec("mpi4py").origin)) / "MPI.pyi"
    return {f.name for cls in ast.parse(stub.read_text()).body if isinstance(cls, ast.ClassDef)
            for f in cls.body if isinstance(f, ast.FunctionDef) and f.name[:1].isupper()}


def _name(node) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def raw_mpi(source: str, methods: set[str]) -> list[str]:
    """``line: code`` for each import of mpi4py, call of an MPI method and use of a raw communicator in
    ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] == "mpi4py"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mpi4py":
            found.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in methods:
            found.append(f"{node.lineno}: {ast.unparse(node.func)}()")
        elif isinstance(node, ast.Attribute) and node.attr == "comm" and _name(node.value) in HOLDERS:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(set(found), key=lambda hit: int(hit.split(":")[0]))


def test_the_scan_finds_raw_mpi_and_passes_the_communicator():
    methods = _mpi_methods()
    assert {"Allreduce", "Iallgather", "Barrier", "Bcast", "Isend", "Get_rank"} <= methods
    raw = ("from mpi4py import MPI\nimport mpi4py.MPI\ncomm.comm.Allreduce(a, b)\nx.Iallgather(a, b)\n"
           "job.world.comm.bcast(x)\nself._world.comm.barrier()\n")
    assert sorted({int(hit.split(":")[0]) for hit in raw_mpi(raw, methods)}) == [1, 2, 3, 4, 5, 6]
    mine = ("algo.comm.allreduce(x, 'max')\nself.comm.allgather_object(v, 'why')\ncomm.iallreduce(g)\n"
            "job.world.allgather_object(v, 'why')\nimportlib.metadata.version('mpi4py')\n")
    assert raw_mpi(mine, methods) == []


def test_only_comm_speaks_to_mpi():
    methods = _mpi_methods()
    found = [f"{path.relative_to(PACKAGE.parent)}:{hit}" for path in sorted(PACKAGE.rglob("*.py"))
             if path.relative_to(PACKAGE).parts[0] != "comm" for hit in raw_mpi(path.read_text(), methods)]
    assert found == [], "MPI outside mpicomm/comm/ (go through the Communicator or World):\n" + "\n".join(found)


def test_comm_names_none_of_its_own_methods_like_mpi4py():
    """A capitalised MPI name is never one of mpicomm's own methods, so the scan cannot take those for raw calls."""
    methods = _mpi_methods()
    own = [f"{path.name}: {f.name}" for path in sorted((PACKAGE / "comm").glob("*.py"))
           for f in ast.walk(ast.parse(path.read_text())) if isinstance(f, ast.FunctionDef) and f.name in methods]
    assert own == []

"""BERT's larger offline corpus, ``python-docs``: the standard library's own documentation, as plain English.

About 5 MB of real text (13 times the pydoc topics) that every Python installation carries: for each
source file of the standard library (its tests included), one document of its docstrings (module, class,
function; read with ``ast``, never imported) followed by its comment paragraphs (runs of ``#`` lines),
plus the 79 pydoc topics. Built once by the set-up (``python apps/fetch_data.py python-docs``) into the
data cache as ``python-docs/documents.json`` with a manifest holding its SHA-256 and the Python version it
came from (the corpus, hence the tokenizer and every result on it, depends on that version).
:func:`load_python_docs` verifies the file against the manifest and refuses a missing or damaged one in
one line naming the command that builds it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import re
import sysconfig
from collections import deque
from pathlib import Path

__all__ = ["BUILD_COMMAND", "build_python_docs", "load_python_docs"]

BUILD_COMMAND = "python apps/fetch_data.py python-docs"
_COMMENT = re.compile(r"^\s*#+ ?(.*)$")
_SKIP = {"site-packages", "__pycache__"}


_DEFINITIONS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_HOLDERS = (ast.stmt, ast.excepthandler, ast.match_case)  # the only nodes a definition can sit in or below


def _walk_statements(tree: ast.AST):
    """``ast.walk``'s breadth-first order without descending into expressions (no definition is ever inside
    one): the same definitions in the same order, without visiting the millions of expression nodes."""
    todo = deque([tree])
    while todo:
        node = todo.popleft()
        todo.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, _HOLDERS))
        yield node


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # a few test files are deliberately broken
        return []
    nodes = (n for n in _walk_statements(tree) if isinstance(n, _DEFINITIONS))
    return [doc for doc in (ast.get_docstring(n) for n in nodes) if doc]


def _comment_paragraphs(source: str) -> list[str]:
    """Consecutive comment lines joined into paragraphs (shebangs, encodings and bare rulers dropped)."""
    paragraphs, current = [], []
    for line in source.splitlines():
        found = _COMMENT.match(line)
        text = found.group(1).strip() if found else ""
        if found and text and not text.startswith(("!", "-*-")) and re.search(r"[A-Za-z]{3}", text):
            current.append(text)
            continue
        if current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return [p for p in paragraphs if len(p.split()) >= 4]


def _documents() -> list[str]:
    from pydoc_data.topics import topics

    root = Path(sysconfig.get_paths()["stdlib"])
    docs = [topics[name] for name in sorted(topics)]
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in _SKIP)
        for name in sorted(f for f in files if f.endswith(".py")):
            try:
                source = (Path(folder) / name).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            text = "\n\n".join(_docstrings(source) + _comment_paragraphs(source)).strip()
            if text:
                docs.append(text)
    return docs


def build_python_docs(cache_root: Path, force: bool = False) -> Path:
    """Write ``cache_root/python-docs/documents.json`` and its manifest (unless present and intact); the folder."""
    folder = Path(cache_root) / "python-docs"
    if not force and _problem(folder) == "":
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    data = json.dumps(_documents(), ensure_ascii=False).encode("utf-8")
    partial = folder / ".documents.partial"
    partial.write_bytes(data)
    os.replace(partial, folder / "documents.json")
    manifest = {"sha256": hashlib.sha256(data).hexdigest(), "python": platform.python_version(), "bytes": len(data)}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return folder


def _problem(folder: Path) -> str:
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        data = (folder / "documents.json").read_bytes()
    except (OSError, ValueError) as exc:
        return f"{folder} has no usable corpus ({type(exc).__name__})"
    if hashlib.sha256(data).hexdigest() != manifest.get("sha256"):
        return f"{folder / 'documents.json'} does not match its manifest's SHA-256 (damaged)"
    return ""


def load_python_docs(cache_root: Path) -> list[str]:
    """The corpus's documents, verified against the manifest; a ``ValueError`` naming the fix otherwise."""
    folder = Path(cache_root) / "python-docs"
    problem = _problem(folder)
    if problem:
        raise ValueError(f"--dataset python-docs: {problem}; build it with {BUILD_COMMAND} "
                         "(or set MPICOMM_DATA_DIR to where it was built)")
    return json.loads((folder / "documents.json").read_text(encoding="utf-8"))

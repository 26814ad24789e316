"""The part of ``mpicomm slurm check`` that runs in the job's own Python, from the job's project folder.

Run as ``python probe.py SPECS`` (``SPECS``: a JSON list of objects with ``app``, ``argv``, ``data``,
``fetcher``, ``ranks``): for each, it imports the app (once per file), parses ``argv`` with the app's own parser
and the algorithm's options (no MPI is started), accepts the options as the launch of ``ranks`` ranks does
before it builds anything (``mpicomm.training.arguments.accept_args``: the loop's config, the app module's
``check_args``, the topology, the network), builds the algorithm's config, checks the data the command line
names, and prints, as its last line of output, the JSON list of answers, each ``{"problems": [one line each],
"notes": [what the job will do, e.g. fetch the data], "algorithm": the method the job runs}``.
It imports only what any mpicomm install has, so an older or newer install in the job's environment still
answers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import json
import os
import sys

CIFAR10_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)


def _import(path: str, name: str):
    """The Python file ``path`` as module ``name``, its folder on ``sys.path`` and its start-up output swallowed."""
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    with contextlib.redirect_stdout(io.StringIO()):
        spec.loader.exec_module(module)
    return module


def _options(app, argv: list[str], ranks: int):
    """``(args, problem)``: ``argv`` through the app's parser, then what the launch of ``ranks`` ranks accepts
    before building anything (the loop's config, the app's ``check_args``, the topology, the network:
    ``accept_args``, where the job's mpicomm has it), then the algorithm's config."""
    from mpicomm.algorithms import ALGORITHMS
    from mpicomm.training import arguments
    from mpicomm.training.options import config_kwargs

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = arguments.parse_app_args(app.build_parser(), argv)
        if hasattr(arguments, "accept_args"):
            arguments.accept_args(args, ranks, getattr(app, "check_args", None))
        else:  # an older mpicomm in the job's environment
            arguments.train_config(args)
        if args.algorithm in ALGORITHMS:  # not "auto", which the launch resolves
            options = config_kwargs(args, args.algorithm)
            fields = {f.name for f in dataclasses.fields(ALGORITHMS[args.algorithm].config_class)}
            if "total_steps" in fields:
                options.setdefault("total_steps", 100_000)  # the app sets it from the epochs and the data
            ALGORITHMS[args.algorithm].config_class(**options)
    except SystemExit:  # argparse: its last line is the one that says what is wrong
        lines = err.getvalue().strip().splitlines()
        return None, lines[-1].split(": error: ", 1)[-1] if lines else "the app's parser refused the options"
    except (ValueError, TypeError, OSError) as exc:
        return None, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return args, ""


def _data(args, data: str, fetcher, notes: list[str]) -> list[str]:
    """Problems with the data ``args`` names: ``data`` is the job's DATA, ``fetcher`` the project's fetch_data;
    what the job will do about the data goes to ``notes``."""
    problems = []
    if data and fetcher is not None:
        why = fetcher.problem(data)
        if why and data in fetcher.FETCHERS:
            notes.append(f"{data} is not in {fetcher.dataset_folder(data)} yet: the job fetches it before the launch")
        if why and data not in fetcher.FETCHERS:
            problems.append(f"data: {data} is missing ({why}) and cannot be fetched by the job; on a login node: "
                            f"{fetcher.login_command(data)}")
    data_dir = getattr(args, "data_dir", "") or ""
    if data_dir and data != "cifar10":
        folder = os.path.join(data_dir, "cifar-10-batches-py")
        folder = folder if os.path.isdir(folder) else data_dir
        missing = [n for n in CIFAR10_BATCHES if not os.path.isfile(os.path.join(folder, n))]
        if missing:
            problems.append(f"data: --data-dir {data_dir}: no CIFAR-10 archive there (lacks {', '.join(missing)}; "
                            f"relative paths are from {os.getcwd()})")
    corpus = getattr(args, "data", "") or ""
    if corpus and not os.path.exists(corpus):
        problems.append(f"data: --data {corpus} does not exist (relative paths are from {os.getcwd()})")
    named = getattr(args, "dataset", "") or ""
    if not corpus and named in ("mnist", "python-docs") and named != data and fetcher is not None:
        why = fetcher.problem(named)
        if why:
            problems.append(f"data: --dataset {named} is missing ({why}) and DATA does not fetch it: set "
                            f"DATA={named}, or on a login node run: {fetcher.login_command(named)}")
    return problems


def _answer(spec: dict, imported: dict) -> dict:
    """The problems and notes of one spec; ``imported`` caches each Python file's module (or import error)."""
    problems, notes = [], []
    if spec["app"] not in imported:
        try:
            imported[spec["app"]] = _import(spec["app"], f"mpicomm_checked_app_{len(imported)}")
        except Exception as exc:  # noqa: BLE001 - whatever stops the import stops the job the same way
            imported[spec["app"]] = f"app: importing {spec['app']} failed: {type(exc).__name__}: {exc}"
    app = imported[spec["app"]]
    if isinstance(app, str):
        return {"problems": [app], "notes": notes}
    args, problem = _options(app, spec["argv"], spec.get("ranks", 1))
    if problem:
        return {"problems": [f"options: {problem}"], "notes": notes}
    fetcher = None
    if os.path.isfile(spec["fetcher"]):
        if spec["fetcher"] not in imported:
            imported[spec["fetcher"]] = _import(spec["fetcher"], f"mpicomm_checked_fetch_data_{len(imported)}")
        fetcher = imported[spec["fetcher"]]
    elif spec["data"]:
        problems.append(f"data: DATA={spec['data']} but {spec['fetcher']} does not exist")
    problems += _data(args, spec["data"], fetcher, notes)
    return {"problems": problems, "notes": notes, "algorithm": args.algorithm}


def main() -> None:
    """Read the JSON list of specs from ``sys.argv[1]`` and print the JSON list of answers."""
    imported: dict = {}
    print(json.dumps([_answer(spec, imported) for spec in json.loads(sys.argv[1])]))


if __name__ == "__main__":
    main()

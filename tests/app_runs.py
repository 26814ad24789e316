"""Launching the apps under mpiexec from tests: the command, the short ResNet case, strict metrics reading.

Every test that starts an MPI job takes ``mpiexec`` from :func:`mpiexec`: the one installed next to this
Python (the MPICH wheel's, the library mpi4py uses), never whichever is first on PATH, and a missing one
fails the test instead of skipping it.
"""

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESNET = ["--model", "resnet20", "--batch-size", "8", "--eval-limit", "32", "--max-steps", "4", "--log-every", "1",
          "--no-progress"]


def mpiexec() -> str:
    """The ``mpiexec`` next to ``sys.executable``; fails the calling test when there is none."""
    path = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(f"no mpiexec next to {sys.executable} ({path}): the tests launch the MPI library mpi4py uses "
                    "(pip install mpich, or scripts/setup_env.sh)", pytrace=False)
    return path


def with_mpiexec_on_path(env: dict | None = None) -> dict:
    """``env`` (default: this process's) with :func:`mpiexec`'s folder first on PATH, for scripts that call it."""
    env = dict(os.environ if env is None else env)
    env["PATH"] = os.path.dirname(mpiexec()) + os.pathsep + env.get("PATH", "")
    return env


def app_module(name: str):
    """``apps/<name>.py`` imported in this process (its start-up line swallowed), for its ``build_parser``."""
    apps = os.path.join(REPO, "apps")
    if apps not in sys.path:
        sys.path.insert(0, apps)
    spec = importlib.util.spec_from_file_location(name, os.path.join(apps, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    with contextlib.redirect_stdout(io.StringIO()):
        spec.loader.exec_module(module)
    return module


def launch(ranks: int, app: str, args: list[str], timeout: int = 240,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``apps/<app>`` on ``ranks`` ranks with ``env`` added; its output (the timeout only catches a hang)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([mpiexec(), "-n", str(ranks), sys.executable, os.path.join(REPO, "apps", app), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def run_apps(ranks: int, runs: dict[str, tuple[str, list[str]]], folder, timeout: int = 600,
             env: dict | None = None) -> dict[str, subprocess.CompletedProcess]:
    """Several app runs on ``ranks`` ranks, one after another in one ``mpiexec`` (``tests/app_batch_job.py``):
    ``runs`` maps a name to ``(app, args)``; each name gets what :func:`launch` would return for it (the exit
    status, the highest of the ranks' as mpiexec reports it; stdout and stderr, the ranks' in rank order).

    For runs whose tests read their exit status, output and files: one start of Python and torch per rank for
    the whole batch instead of one per run. A run that needs its own process (a signal from outside, an
    environment of its own, a crash that aborts the job) is launched alone."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    spec = os.path.join(folder, "runs.json")
    with open(spec, "w") as f:
        json.dump({"folder": folder, "runs": [{"name": name, "app": app, "argv": list(args)}
                                               for name, (app, args) in runs.items()]}, f)
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    job = subprocess.run([mpiexec(), "-n", str(ranks), sys.executable, os.path.join(REPO, "tests", "app_batch_job.py"),
                          spec], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)

    def read(path: str) -> str:
        with open(path) as f:
            return f.read()

    if job.returncode != 0:  # a run aborted the job: the last one that started is named, with what it wrote
        started = [name for name in runs if os.path.exists(os.path.join(folder, f"{name}.0.err"))]
        last = started[-1] if started else None
        said = []
        for rank in range(ranks if last else 0):
            for kind in ("out", "err"):
                path = os.path.join(folder, f"{last}.{rank}.{kind}")
                if os.path.exists(path):
                    said.append(f"--- rank {rank}, std{kind}:\n{read(path)[-3000:]}")
        command = f"{runs[last][0]} {' '.join(runs[last][1])}" if last else "none started"
        pytest.fail(f"the batch of app runs {list(runs)} ended with exit {job.returncode} in run {last!r} "
                    f"({command}):\n" + "\n".join(said) + f"\n--- the job:\n{job.stdout[-2000:]}{job.stderr[-3000:]}",
                    pytrace=False)

    statuses = [json.loads(read(os.path.join(folder, f"status.{rank}.json"))) for rank in range(ranks)]
    return {name: subprocess.CompletedProcess(
                [app, *args], max(s[name] for s in statuses),
                "".join(read(os.path.join(folder, f"{name}.{r}.out")) for r in range(ranks)),
                "".join(read(os.path.join(folder, f"{name}.{r}.err")) for r in range(ranks)))
            for name, (app, args) in runs.items()}


def strict_records(path) -> list[dict]:
    """A metrics file's records, failing on anything that is not strict JSON (NaN, Infinity)."""
    def refuse(constant):
        raise ValueError(f"{path}: {constant} is not JSON")

    with open(path) as f:
        return [json.loads(line, parse_constant=refuse) for line in f if line.strip()]

"""``mpicomm slurm check JOB.sbatch``: what would stop a rendered job, found before it waits in the queue.

It resolves the job's settings as the job's shell would from this shell (a parameter exported here, as
``sbatch`` passes the environment on, wins over the file's default), then checks, in order:

* the project: ``MPICOMM_HOME`` (exported, or written by ``mpicomm slurm render``), else the folder above the
  job file, else this folder, whichever holds ``APP`` (the job looks in the same places);
* the virtual environment ``VENV`` (default ``$MPICOMM_HOME/.venv``) and the app;
* that its Python runs, and that the app's options parse: the job's command line goes through the app's own
  ``build_parser()`` with the algorithm's options, the algorithm's config and the loop's (no MPI);
* the data: ``DATA`` in ``MPICOMM_DATA_DIR``, present or fetchable by the job; paths given with
  ``--data-dir``/``--data`` (from ``MPICOMM_HOME``); a ``--dataset`` the job does not fetch.

Each problem is one line on stdout and the exit status is 2; a job with none gets one ``OK`` line (exit 0).
"""

from __future__ import annotations

import json
import os
import subprocess

from .template import parse_template

__all__ = ["check_job", "job_settings", "main_check"]

_DEFAULT_DATA_DIR = "$HOME/.cache/mpicomm/data"


def job_settings(text: str, environ: dict | None = None) -> dict[str, str]:
    """The job's parameters as its shell would set them: an exported non-empty value, else the file's value
    (its ``$VAR`` references expanded as the shell would)."""
    environ = os.environ if environ is None else environ
    template = parse_template(text)
    out = {}
    for key in template.params:
        exported = environ.get(key, "")
        out[key] = exported or template.value(key)
    data_dir = out.get("MPICOMM_DATA_DIR", "") or _DEFAULT_DATA_DIR
    if not environ.get("MPICOMM_DATA_DIR") and "$" in data_dir:
        data_dir = os.path.expandvars(data_dir)
    out["MPICOMM_DATA_DIR"] = data_dir
    return out


def _home(settings: dict[str, str], job_path: str) -> tuple[str, str]:
    """``(home, problem)``: the project folder the job will use, as the template resolves it."""
    app = settings.get("APP", "")
    if settings.get("MPICOMM_HOME"):
        home = settings["MPICOMM_HOME"]
        if not os.path.isdir(home):
            return "", f"project: MPICOMM_HOME={home} is not a folder"
        return os.path.abspath(home), ""
    for folder in (os.path.join(os.path.dirname(os.path.abspath(job_path)), os.pardir), os.getcwd()):
        if os.path.isfile(os.path.join(folder, app)):
            return os.path.abspath(folder), ""
    return "", (f"project: MPICOMM_HOME is empty and neither the folder above the job file nor this one holds "
                f"{app}; render the job with mpicomm slurm render, or export MPICOMM_HOME=/path/to/mpicomm")


def _argv(settings: dict[str, str]) -> list[str]:
    """The app's command line as the template builds it (EXTRA_ARGS split on blanks, as the shell does)."""
    argv = ["--algorithm", settings.get("ALGORITHM", ""), "--topology", settings.get("TOPOLOGY", ""),
            "--epochs", settings.get("EPOCHS", ""), "--out-dir", os.path.join(os.getcwd(), "mpicomm-check-run"),
            "--save-every", settings.get("SAVE_EVERY", ""), "--resume", "latest", "--no-progress",
            "--device", settings.get("DEVICE", "")]
    data = settings.get("DATA", "")
    if data == "cifar10":
        argv += ["--dataset", "cifar10", "--data-dir", os.path.join(settings["MPICOMM_DATA_DIR"], "cifar10")]
    elif data:
        argv += ["--dataset", data]
    return argv + settings.get("EXTRA_ARGS", "").split()


def check_job(job_path: str, environ: dict | None = None) -> tuple[list[str], str]:
    """``(problems, summary)`` for the job file ``job_path``: one line per problem, and what the job will do."""
    with open(job_path) as f:
        settings = job_settings(f.read(), environ)
    home, problem = _home(settings, job_path)
    if problem:
        return [problem], ""
    problems = []
    venv = settings.get("VENV") or os.path.join(home, ".venv")
    venv = venv if os.path.isabs(venv) else os.path.join(home, venv)
    if not os.path.isfile(os.path.join(venv, "bin", "activate")):
        problems.append(f"venv: {venv}/bin/activate does not exist (scripts/setup_env.sh creates it; or set VENV)")
    app = os.path.join(home, settings.get("APP", ""))
    if not os.path.isfile(app):
        problems.append(f"app: {app} does not exist")
        return problems, ""
    python = os.path.join(venv, "bin", "python")
    if not os.path.isfile(python):
        python = "python3"
    spec = {"app": app, "argv": _argv(settings), "data": settings.get("DATA", ""),
            "fetcher": os.path.join(home, "apps", "fetch_data.py")}
    probe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe.py")
    run = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    env = dict(os.environ if environ is None else environ, MPICOMM_DATA_DIR=settings["MPICOMM_DATA_DIR"])
    try:
        proc = subprocess.run([python, "-c", run, probe, json.dumps(spec)], cwd=home, env=env,
                              capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return problems + [f"python: {python} does not run ({exc})"], ""
    lines = proc.stdout.strip().splitlines()
    try:
        found = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    except ValueError:
        found = None
    if not isinstance(found, dict):
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return problems + [f"python: {python} could not check the app's options: {last}"], ""
    data = settings.get("DATA", "")
    summary = (f"{settings.get('APP')} with {settings.get('ALGORITHM')} from {home}"
               + (f", data {data} in {settings['MPICOMM_DATA_DIR']}" if data else "")
               + "".join(f"; {note}" for note in found.get("notes", [])))
    return problems + found.get("problems", []), summary


def main_check(args) -> int:
    """Print one line per problem of the job file (exit 2), or one OK line (exit 0)."""
    if not os.path.isfile(args.job):
        raise ValueError(f"{args.job}: no such job file")
    problems, summary = check_job(args.job)
    for line in problems:
        print(f"{args.job}: {line}")
    if problems:
        return 2
    print(f"{args.job}: OK: {summary}")
    return 0

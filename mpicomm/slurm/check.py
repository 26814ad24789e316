"""``mpicomm slurm check JOB.sbatch [JOB.sbatch ...]``: what would stop a rendered job, found before it waits in
the queue.

It resolves the job's settings as the job's shell would from this shell (a parameter exported here, as
``sbatch`` passes the environment on, wins over the file's default), then checks, in order:

* the project: ``MPICOMM_HOME`` (exported, or written by ``mpicomm slurm render``), else the folder above the
  job file, else this folder, whichever holds ``APP`` (the job looks in the same places);
* the virtual environment ``VENV`` (default ``$MPICOMM_HOME/.venv``) and the app; with ``ON_RANK_LOSS=continue``
  the fault-tolerant stack ``$MPICOMM_HOME/.venv-ft``, whose Python then answers the checks below;
* that its Python runs, and that the launch would accept the app's options: the job's command line goes through
  the app's own ``build_parser()`` with the algorithm's options, then what the launch refuses before it builds
  anything, by the launch's own code (``accept_args``: the loop's config, the app module's ``check_args`` such
  as the model's name and the batch size, the topology on the job's ranks — ``ntasks``, else ``nodes`` x
  ``ntasks-per-node`` — and the ``--net`` setting), then the algorithm's config (no MPI). A refusal is the
  launch's own line after ``options:``; the OK line names the method the job runs (an ``--algorithm`` in
  ``EXTRA_ARGS`` wins over ``ALGORITHM``, as in the app);
* the data: ``DATA`` in ``MPICOMM_DATA_DIR``, present or fetchable by the job; paths given with
  ``--data-dir``/``--data`` (from ``MPICOMM_HOME``); a ``--dataset`` the job does not fetch.

Each problem is one line on stdout and the exit status is 2; a job with none gets one ``OK`` line (exit 0).
"""

from __future__ import annotations

import json
import os
import re
import subprocess

from .template import ON_RANK_LOSS_VALUES, parse_template

__all__ = ["check_job", "check_jobs", "job_ranks", "job_settings", "main_check"]

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


def job_ranks(text: str) -> int:
    """The ranks the job starts, as its header asks: ``ntasks``, else ``nodes`` x ``ntasks-per-node`` (1 where a
    count is absent; the lower end of a ``nodes`` range such as ``2-4``)."""
    template = parse_template(text)

    def count(key: str) -> int:
        value = (template.value(key) or "") if key in template.headers else ""
        digits = re.match(r"\d+", value.strip())
        return max(1, int(digits.group())) if digits else 1

    return count("ntasks") if "ntasks" in template.headers else count("nodes") * count("ntasks-per-node")


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
    argv += settings.get("EXTRA_ARGS", "").split()
    return argv + (["--on-rank-loss", "continue"] if settings.get("ON_RANK_LOSS") == "continue" else [])


def _probe_spec(job_path: str, environ: dict | None) -> tuple[list[str], dict | None]:
    """``(problems, probe)`` for one job file before its Python runs: what is already wrong, and what the probe
    needs (None when nothing is left to probe)."""
    with open(job_path) as f:
        text = f.read()
    settings = job_settings(text, environ)
    home, problem = _home(settings, job_path)
    if problem:
        return [problem], None
    problems = []
    venv = settings.get("VENV") or os.path.join(home, ".venv")
    venv = venv if os.path.isabs(venv) else os.path.join(home, venv)
    if not os.path.isfile(os.path.join(venv, "bin", "activate")):
        problems.append(f"venv: {venv}/bin/activate does not exist (scripts/setup_env.sh creates it; or set VENV)")
    app = os.path.join(home, settings.get("APP", ""))
    if not os.path.isfile(app):
        problems.append(f"app: {app} does not exist")
        return problems, None
    python = os.path.join(venv, "bin", "python")
    if not os.path.isfile(python):
        python = "python3"
    ft = settings.get("ON_RANK_LOSS", "stop")
    if ft not in ON_RANK_LOSS_VALUES:
        problems.append(f"ON_RANK_LOSS={ft}: expected stop or continue")
    elif ft == "continue":  # the ranks run on the fault-tolerant stack: probe with its Python, recovery on
        if not os.access(os.path.join(home, ".venv-ft", "bin", "mpirun"), os.X_OK):
            problems.append(f"ON_RANK_LOSS=continue: the fault-tolerant stack {home}/.venv-ft is not set up "
                            "(scripts/setup_env.sh --ft creates it)")
            return problems, None
        python = os.path.join(home, ".venv-ft", "bin", "python")
    spec = {"app": app, "argv": _argv(settings), "data": settings.get("DATA", ""),
            "fetcher": os.path.join(home, "apps", "fetch_data.py"), "ranks": job_ranks(text)}
    return problems, {"python": python, "home": home, "settings": settings, "spec": spec, "ft": ft == "continue"}


def _run_probe(python: str, home: str, data_dir: str, specs: list[dict], environ: dict | None,
               ft: bool = False) -> list:
    """Each spec's probe answer (a dict), or one line saying why the job's Python could not answer (a str).
    ``ft``: the job runs on the fault-tolerant stack, whose launcher turns recovery on (as ``mpirun --with-ft
    ulfm`` does for every rank), so the launch accepts ``--on-rank-loss continue``."""
    probe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe.py")
    run = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    env = dict(os.environ if environ is None else environ, MPICOMM_DATA_DIR=data_dir)
    if ft:
        env["OMPI_MCA_mpi_ft_enable"] = "1"
    try:
        proc = subprocess.run([python, "-c", run, probe, json.dumps(specs)], cwd=home, env=env,
                              capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"python: {python} does not run ({exc})"] * len(specs)
    lines = proc.stdout.strip().splitlines()
    try:
        found = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    except ValueError:
        found = None
    if not (isinstance(found, list) and len(found) == len(specs) and all(isinstance(x, dict) for x in found)):
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return [f"python: {python} could not check the app's options: {last}"] * len(specs)
    return found


def check_jobs(job_paths: list[str], environ: dict | None = None) -> list[tuple[list[str], str]]:
    """``(problems, summary)`` for each job file: one line per problem, and what the job will do. Jobs that run
    the same Python from the same project are probed by one process (the app and torch imported once)."""
    early = [_probe_spec(path, environ) for path in job_paths]
    groups: dict[tuple, list[int]] = {}
    for i, (_, todo) in enumerate(early):
        if todo is not None:
            key = (todo["python"], todo["home"], todo["settings"]["MPICOMM_DATA_DIR"], todo["ft"])
            groups.setdefault(key, []).append(i)
    answers: dict[int, dict | str] = {}
    for (python, home, data_dir, ft), members in groups.items():
        found = _run_probe(python, home, data_dir, [early[i][1]["spec"] for i in members], environ, ft)
        answers.update(zip(members, found))
    out = []
    for i, (problems, todo) in enumerate(early):
        if todo is None:
            out.append((problems, ""))
            continue
        found = answers[i]
        if isinstance(found, str):
            out.append((problems + [found], ""))
            continue
        settings, data = todo["settings"], todo["settings"].get("DATA", "")
        algorithm = found.get("algorithm") or settings.get("ALGORITHM")  # EXTRA_ARGS may name another
        summary = (f"{settings.get('APP')} with {algorithm} on {todo['spec']['ranks']} rank(s) from {todo['home']}"
                   + (f", data {data} in {settings['MPICOMM_DATA_DIR']}" if data else "")
                   + "".join(f"; {note}" for note in found.get("notes", [])))
        out.append((problems + found.get("problems", []), summary))
    return out


def check_job(job_path: str, environ: dict | None = None) -> tuple[list[str], str]:
    """``(problems, summary)`` for the job file ``job_path`` (:func:`check_jobs` of one)."""
    return check_jobs([job_path], environ)[0]


def main_check(args) -> int:
    """For each job file, one line per problem (exit 2 if any job has one), or one OK line (exit 0 if all do)."""
    for job in args.job:
        if not os.path.isfile(job):
            raise ValueError(f"{job}: no such job file")
    status = 0
    for job, (problems, summary) in zip(args.job, check_jobs(args.job)):
        for line in problems:
            print(f"{job}: {line}")
        if problems:
            status = 2
        else:
            print(f"{job}: OK: {summary}")
    return status

"""The job presets: GPU presets bind one GPU per task with --device auto, the CPU preset runs one rank per
core on the CPU, a GPU preset with gpus-per-task=0 is refused with the reason, and the template's
oversubscription switch exports MPICH's yield setting exactly when ranks outnumber the node's CPUs.

``mpicomm slurm check`` passes every rendered preset and refuses a job the app refuses at launch with the
app's own line: the app launched with each such job's options is the reference (those launches read only
their exit status and output, so they run one after another in one 1-rank MPI job, ``run_apps``)."""

import dataclasses
import os
import shlex
import subprocess
import sys

import pytest

from mpicomm.algorithms import ALGORITHMS
from mpicomm.slurm import parse_template
from mpicomm.slurm.commands import preset_text, repo_slurm_dir
from mpicomm.slurm.presets import PRESETS, check_preset, is_gpu_preset
from mpicomm.training.arguments import parse_app_args
from mpicomm.training.options import config_kwargs

from .app_runs import app_module, run_apps

GENERIC = open(os.path.join(repo_slurm_dir(), "generic.sbatch")).read()
GPU = sorted(n for n in PRESETS if is_gpu_preset(n))
CPU = sorted(n for n in PRESETS if not is_gpu_preset(n))


@pytest.mark.parametrize("name", GPU)
def test_gpu_presets_bind_one_gpu_per_task_and_pass_device_auto(name):
    text = preset_text(GENERIC, name)
    t = parse_template(text)
    assert t.value("gpus-per-task") == "1" and t.value("DEVICE") == "auto"
    assert '--device "$DEVICE"' in text


def test_a_cpu_preset_runs_one_single_threaded_rank_per_core_on_the_cpu():
    assert CPU, "no CPU preset"
    for name in CPU:
        t = parse_template(preset_text(GENERIC, name))
        assert "gpus-per-task" not in t.headers and t.value("DEVICE") == "cpu" and t.value("cpus-per-task") == "1"
    assert "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}" in GENERIC


@pytest.mark.parametrize("tasks, cpus, expected", [("8", "2", "1"), ("4", "4", ""), ("2", "", "")])
def test_template_exports_the_mpich_yield_setting_only_when_oversubscribed(tasks, cpus, expected):
    lines = GENERIC.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('if [ "${SLURM_NTASKS_PER_NODE'))
    snippet = "\n".join(lines[start:start + 3]) + '\necho "${MPIR_CVAR_ENABLE_HEAVY_YIELD:-}"'
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MPIR_CVAR"))}
    env["SLURM_NTASKS_PER_NODE"] = tasks
    if cpus:
        env["SLURM_CPUS_ON_NODE"] = cpus
    out = subprocess.run(["bash", "-c", snippet], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == expected


def test_gpu_preset_with_zero_gpus_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="resnet20_moniqua is a GPU preset .* Use a CPU preset"):
        check_preset("resnet20_moniqua", {"gpus-per-task": "0"})
    check_preset("resnet20_moniqua", {"gpus-per-task": "2"})  # more GPUs is the user's call
    proc = subprocess.run([sys.executable, "-m", "mpicomm", "slurm", "render", "resnet18_apmsqueeze",
                           "--set", "gpus-per-task=0"], capture_output=True, text=True)
    assert proc.returncode != 0
    assert proc.stderr.strip().startswith("mpicomm slurm render: error: --set gpus-per-task=0: resnet18_apmsqueeze "
                                          "is a GPU preset")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_command_line_is_accepted_by_its_app_and_algorithm(name):
    """The app's parser takes the preset's options (argparse exits on an unknown or misspelt one) and the
    algorithm's config accepts their values, so a submitted preset does not fail at start-up."""
    t = parse_template(preset_text(GENERIC, name))
    app = app_module(os.path.splitext(os.path.basename(t.value("APP")))[0])
    argv = ["--algorithm", t.value("ALGORITHM"), "--topology", t.value("TOPOLOGY"), "--epochs", t.value("EPOCHS"),
            "--save-every", t.value("SAVE_EVERY"), "--device", t.value("DEVICE"), *shlex.split(t.value("EXTRA_ARGS"))]
    args = parse_app_args(app.build_parser(), argv)
    options = config_kwargs(args, args.algorithm)
    if "total_steps" in {f.name for f in dataclasses.fields(ALGORITHMS[args.algorithm].config_class)}:
        options.setdefault("total_steps", 100_000)  # the app sets it from the epochs and the data
    ALGORITHMS[args.algorithm].config_class(**options)


# --- every preset, rendered, passes `mpicomm slurm check`; a job without its data ends before training ---

REPO = os.path.dirname(repo_slurm_dir())
CIFAR = sorted(n for n in PRESETS if PRESETS[n].get("DATA") == "cifar10")


def _cifar10_fixture(root) -> None:
    """The archive's six batch files in ``root/cifar10/cifar-10-batches-py`` (tiny ones: check only looks)."""
    import pickle

    import numpy as np

    folder = root / "cifar10" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": np.zeros((4, 3072), np.uint8), b"labels": [0, 1, 2, 3]}
        (folder / name).write_bytes(pickle.dumps(batch))


def _check(jobs: list[str], data_dir, cwd, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MPICOMM_HOME", "VENV", "DATA")}
    env.update(MPICOMM_DATA_DIR=str(data_dir), **(extra_env or {}))
    return subprocess.run([sys.executable, "-m", "mpicomm", "slurm", "check", *jobs], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600)


@dataclasses.dataclass
class Checked:
    """One job file's part of a ``mpicomm slurm check`` of several: its lines, and the command's exit status
    and whole output."""

    lines: list
    returncode: int
    output: str


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """``mpicomm slurm check`` on every preset rendered by ``mpicomm slurm render`` (run from a folder that is
    not the checkout), with the data present and, for the presets whose data the job cannot fetch, absent.
    One command per setting checks all its job files (their apps are probed by one Python); the settings run
    side by side. Returns {case: (job file, Checked)}."""
    from concurrent.futures import ThreadPoolExecutor

    work = tmp_path_factory.mktemp("check")
    present, absent = work / "data-present", work / "data-absent"
    _cifar10_fixture(present)
    absent.mkdir()
    settings = {"present": (present, None), "absent": (absent, None), "checked-in": (absent, None),
                "options": (present, {"EXTRA_ARGS": "--model resnet20 --no-such-option 3"}),
                "venv": (present, {"VENV": str(work / "nowhere")}), "mixed": (present, None)}
    jobs = {setting: [] for setting in [*settings, "launch"]}
    for name in sorted(PRESETS):
        job = work / f"{name}.sbatch"
        subprocess.run([sys.executable, "-m", "mpicomm", "slurm", "render", name, "-o", str(job)], cwd=work,
                       check=True, capture_output=True)
        jobs["present"].append((("present", name), str(job)))
        if name in CIFAR:
            jobs["absent"].append((("absent", name), str(job)))
    # the checked-in file itself (no project path written in it: found as the folder above slurm/)
    jobs["checked-in"].append((("checked-in", "resnet20_cpu"), os.path.join(repo_slurm_dir(), "resnet20_cpu.sbatch")))
    # an option the app's parser does not know, and a venv that is not there
    jobs["options"].append((("bad", "options"), str(work / "resnet20_cpu.sbatch")))
    jobs["venv"].append((("bad", "venv"), str(work / "resnet20_cpu.sbatch")))
    # a good job and a bad one in one command
    subprocess.run([sys.executable, "-m", "mpicomm", "slurm", "render", "resnet20_cpu", "-o", str(work / "bad.sbatch"),
                    "--set", "EXTRA_ARGS=--no-such-option 3"], cwd=work, check=True, capture_output=True)
    jobs["mixed"] = [(("mixed", "good"), str(work / "resnet20_cpu.sbatch")),
                     (("mixed", "bad"), str(work / "bad.sbatch"))]
    # jobs the app refuses at launch (one command checks them all), and one whose EXTRA_ARGS names the method
    settings["launch"] = (present, None)
    rendered = (work / "resnet20_cpu.sbatch").read_text()
    for case, (extra, topology) in {**LAUNCH_REFUSALS, "algorithm": (["--algorithm", "moniqua"], "ring")}.items():
        job = work / f"launch-{case}.sbatch"
        lines = [line[:-2] + "".join(f" {word}" for word in extra) + '}"' if line.startswith(': "${EXTRA_ARGS:=')
                 else f': "${{TOPOLOGY:={topology}}}"' if line.startswith(': "${TOPOLOGY:=') else line
                 for line in rendered.splitlines()]  # edited by hand: render refuses an unknown topology
        job.write_text("\n".join(lines) + "\n")
        jobs["launch"].append((("launch", case), str(job)))
    with ThreadPoolExecutor(max_workers=len(settings)) as pool:
        futures = {setting: pool.submit(_check, [job for _, job in jobs[setting]], data_dir, work, env)
                   for setting, (data_dir, env) in settings.items()}
        out = {}
        for setting, future in futures.items():
            proc = future.result()
            for key, job in jobs[setting]:
                mine = [line for line in proc.stdout.splitlines() if line.startswith(f"{job}: ")]
                out[key] = (job, Checked(mine, proc.returncode, proc.stdout + proc.stderr))
        return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_rendered_preset_passes_the_check_with_its_data_present(checked, name):
    job, got = checked[("present", name)]
    assert got.returncode == 0, got.output  # every preset of the command passed
    preset = PRESETS[name]
    ranks = int(preset["nodes"]) * int(preset["ntasks-per-node"])
    assert len(got.lines) == 1 and got.lines[0].startswith(
        f"{job}: OK: {preset['APP']} with {preset['ALGORITHM']} on {ranks} rank(s) from {REPO}, data {preset['DATA']} "
        "in "), got.output


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", CIFAR)
def test_a_preset_whose_data_is_absent_and_not_fetchable_gets_exactly_the_data_missing_line(checked, name, tmp_path):
    job, got = checked[("absent", name)]
    assert got.returncode == 2, got.output
    assert len(got.lines) == 1, got.lines
    assert got.lines[0].startswith(f"{job}: data: cifar10 is missing (")
    assert "cannot be fetched by the job; on a login node: download cifar-10-python.tar.gz" in got.lines[0]
    assert "tar xzf cifar-10-python.tar.gz -C " in got.lines[0] and "data-absent/cifar10" in got.lines[0]


@pytest.mark.timeout(900)
def test_check_finds_the_project_of_a_checked_in_template_and_takes_fetchable_data_as_fetched(checked):
    job, got = checked[("checked-in", "resnet20_cpu")]
    assert got.returncode == 0, got.output
    assert got.lines[0].startswith(f"{job}: OK: apps/train_resnet.py with dpsgd on 64 rank(s) from {REPO}, data mnist "
                                   "in ")


@pytest.mark.timeout(900)
def test_check_reports_an_unknown_option_and_a_missing_venv_in_one_line_each(checked):
    job, got = checked[("bad", "options")]
    assert got.returncode == 2 and got.lines == [
        f"{job}: options: unrecognized arguments: --no-such-option 3"], got.output
    job, got = checked[("bad", "venv")]
    assert got.returncode == 2, got.output
    assert got.lines[0] == (f"{job}: venv: {os.path.dirname(job)}/nowhere/bin/activate does not exist "
                            "(scripts/setup_env.sh creates it; or set VENV)")


def test_one_check_of_several_jobs_answers_for_each_and_fails_if_any_fails(checked):
    """A good job and one rendered with an option its app does not know, in one command: the good one's OK
    line first, then the bad one's problem, exit 2 (the all-good command above exits 0)."""
    (good, first), (bad, second) = checked[("mixed", "good")], checked[("mixed", "bad")]
    assert first.returncode == 2 and first.output.splitlines() == first.lines + second.lines, first.output
    assert len(first.lines) == 1 and first.lines[0].startswith(f"{good}: OK: apps/train_resnet.py with dpsgd")
    assert second.lines == [f"{bad}: options: unrecognized arguments: --no-such-option 3"], second.output


LAUNCH_REFUSALS = {  # case: (EXTRA_ARGS, TOPOLOGY) of a job the app refuses at launch
    "model": (["--model", "resnet999"], "ring"), "batch-size": (["--batch-size", "0"], "ring"),
    "net": (["--net", "garbage"], "ring"), "latency": (["--net", "1gbit,1e300s"], "ring"),
    "slow-ranks": (["--slow-ranks", "0:inf"], "ring"), "topology": ([], "moebius"),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Each case of :data:`LAUNCH_REFUSALS` launched (1 rank, one batch): what the app itself says."""
    root = tmp_path_factory.mktemp("launched")
    runs = {case: ("train_resnet.py", ["--max-steps", "1", "--no-progress", "--algorithm", "dpsgd", "--topology",
                                       topology, *extra])
            for case, (extra, topology) in LAUNCH_REFUSALS.items()}
    return run_apps(1, runs, root / "batch")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", sorted(LAUNCH_REFUSALS))
def test_check_refuses_what_the_launch_refuses_with_the_launchs_line(checked, launched, case):
    """The app launched with the job's options exits 2 with one error line; ``slurm check`` of the job says
    the same after ``options:`` (argparse's refusals: its last line, after ``error:``)."""
    proc = launched[case]
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if ": error: " in line]
    assert proc.returncode == 2 and len(errors) == 1, proc.stdout + proc.stderr
    job, got = checked[("launch", case)]
    assert got.returncode == 2, got.output
    assert got.lines == [f"{job}: options: {errors[0].split(': error: ', 1)[1]}"], got.output


@pytest.mark.timeout(900)
def test_check_names_the_method_extra_args_chooses(checked):
    """``--algorithm moniqua`` in EXTRA_ARGS of a job with ALGORITHM=dpsgd: the app trains Moniqua (its parser
    takes the last ``--algorithm``), and the OK line says so, with the ranks the header asks for (2 x 32)."""
    job, got = checked[("launch", "algorithm")]
    assert len(got.lines) == 1 and got.lines[0].startswith(
        f"{job}: OK: apps/train_resnet.py with moniqua on 64 rank(s) from {REPO}"), got.output


def _run_job_offline(name: str, tmp_path, data_dir) -> subprocess.CompletedProcess:
    """The rendered preset run with bash as Slurm would start it on a node (SLURM_* set, submitted from
    ``tmp_path``), inside a network namespace with no route at all."""
    if os.geteuid() != 0:
        pytest.skip("needs root for a network namespace without a route (unshare -n)")
    job = tmp_path / f"{name}.sbatch"
    subprocess.run([sys.executable, "-m", "mpicomm", "slurm", "render", name, "-o", str(job),
                    "--set", "LAUNCHER=mpiexec"], cwd=tmp_path, check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MPICOMM_", "PIP_"))}
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NAME=name, SLURM_SUBMIT_DIR=str(tmp_path), SLURM_NTASKS="2",
               SLURM_TASKS_PER_NODE="2", SLURM_NTASKS_PER_NODE="2", SLURM_CPUS_ON_NODE="2", SLURM_CPUS_PER_TASK="1",
               SLURM_JOB_NUM_NODES="1", SLURM_NODELIST="localhost", MPICOMM_DATA_DIR=str(data_dir))
    return subprocess.run(["unshare", "-n", "bash", str(job)], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)


@pytest.mark.parametrize("name, dataset", [(CIFAR[0], "cifar10"), ("resnet20_cpu", "mnist")])
def test_a_job_whose_data_is_absent_and_cannot_be_fetched_ends_before_training_in_one_line(name, dataset, tmp_path):
    """CIFAR-10 cannot be fetched at all; MNIST can, but not on a node without network: either way the job
    ends with exit 2 and one line naming what is missing and the command for a login node, before any rank
    starts (no run folder, no metrics)."""
    proc = _run_job_offline(name, tmp_path, tmp_path / "data")
    output = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 2 and len(output) == 1, proc.stdout + proc.stderr
    assert output[0].startswith(f"fetch_data: error: {dataset} is missing")
    assert "on a login node" in output[0]
    if dataset == "mnist":
        assert "this node could not fetch it" in output[0]
        assert f"MPICOMM_DATA_DIR={tmp_path / 'data'} " in output[0] and output[0].endswith("fetch_data.py mnist")
    assert not (tmp_path / "runs").exists(), "training started"


def test_the_jobs_fetch_step_fetches_what_is_missing_once_with_one_line(tmp_path):
    """``fetch_data.py --if-missing`` (the templates' step before the launch): one line when it fetched, nothing
    when the data is there (python-docs: built from the standard library, no network needed)."""
    env = dict(os.environ, MPICOMM_DATA_DIR=str(tmp_path))
    command = [sys.executable, os.path.join(REPO, "apps", "fetch_data.py"), "--if-missing", "python-docs"]
    first = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0 and first.stderr == "", first.stderr
    assert first.stdout.splitlines() == [f"fetch_data: python-docs was missing: fetched it into "
                                         f"{tmp_path / 'python-docs'} (once, before the launch)"]
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert (again.returncode, again.stdout, again.stderr) == (0, "", "")
    status = subprocess.run([*command[:2], "--status", "python-docs", "cifar10"], capture_output=True, text=True,
                            env=env)
    assert status.returncode == 1 and status.stdout.splitlines()[0].endswith(f"in {tmp_path / 'python-docs'}")

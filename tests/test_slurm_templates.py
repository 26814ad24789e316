"""The sbatch renderer: settings applied, bad values refused before anything reaches the scheduler,
and the checked-in job templates identical to their presets."""

import os
import subprocess
import sys

import pytest

import mpicomm
from mpicomm.slurm import parse_template, render
from mpicomm.slurm.commands import preset_text, repo_slurm_dir
from mpicomm.slurm.presets import PRESETS

GENERIC = open(os.path.join(repo_slurm_dir(), "generic.sbatch")).read()
REPO = os.path.dirname(repo_slurm_dir())


def test_render_sets_headers_parameters_and_adds_options():
    out = parse_template(render(GENERIC, {"nodes": "2", "ALGORITHM": "moniqua", "gpus-per-task": "1",
                                          "EXTRA_ARGS": "--bits 1 --model resnet110"}))
    assert out.value("nodes") == "2"
    assert out.value("ALGORITHM") == "moniqua"
    assert out.value("gpus-per-task") == "1"
    assert out.value("EXTRA_ARGS") == "--bits 1 --model resnet110"
    assert out.value("ntasks-per-node") == parse_template(GENERIC).value("ntasks-per-node")


def test_rendered_template_is_valid_bash():
    text = render(GENERIC, {"EXTRA_ARGS": "--max-steps 3"})
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


@pytest.mark.parametrize("key, value, message", [
    ("FOO", "1", "unknown key"),
    ("nodes", "0", "positive integer"),
    ("ntasks-per-node", "two", "positive integer"),
    ("time", "soon", "HH:MM:SS"),
    ("time", "25:99:00", "minutes and seconds below 60"),
    ("time", "1-24:00:00", "hours below 24"),
    ("APP", "apps/nope.py", r"no such Python script.*apps/train_resnet.py"),
    ("LAUNCHER", "torque", "auto, srun or mpiexec"),
    ("ALGORITHM", "sgd9000", "unknown algorithm"),
    ("TOPOLOGY", "moebius", "unknown topology"),
    ("EPOCHS", "-1", "non-negative integer"),
    ("MPI_PMI", "pmi9", "pmi2"),
    ("ON_RANK_LOSS", "maybe", r"ON_RANK_LOSS=maybe: expected stop .* or continue"),
    ("EXTRA_ARGS", "a\nb", "newlines"),
])
def test_bad_values_are_refused(key, value, message):
    with pytest.raises(ValueError, match=message):
        render(GENERIC, {key: value})


@pytest.mark.parametrize("time", ["90", "30:00", "12:00:00", "100:00:00", "2-00", "2-12:30", "2-00:00:00"])
def test_slurm_time_formats_are_accepted(time):
    assert parse_template(render(GENERIC, {"time": time})).value("time") == time


def test_launcher_is_a_parameter_like_the_others():
    assert parse_template(render(GENERIC, {"LAUNCHER": "srun"})).value("LAUNCHER") == "srun"


def test_recovery_is_refused_with_srun():
    """``ON_RANK_LOSS=continue`` starts the ranks with Open MPI's own launcher, so ``LAUNCHER=srun`` contradicts it."""
    with pytest.raises(ValueError, match="ON_RANK_LOSS=continue.*leave LAUNCHER=auto"):
        render(GENERIC, {"ON_RANK_LOSS": "continue", "LAUNCHER": "srun"})


def test_recovery_sends_the_time_limit_warning_to_the_batch_shell():
    """With ``ON_RANK_LOSS=continue`` the ranks are not in a Slurm step: USR1 must go to the job script, which
    forwards it; the default keeps the header as it is."""
    assert parse_template(render(GENERIC, {"ON_RANK_LOSS": "continue"})).value("signal") == "B:USR1@60"
    assert parse_template(render(GENERIC, {})).value("signal") == "USR1@60"


@pytest.mark.parametrize("value", ["$(touch {marker})", "`touch {marker}`", "${{X:-$(touch {marker})}}",
                                   'say "hi" \\ }} $HOME'])
def test_parameter_values_are_quoted_never_evaluated(tmp_path, value):
    """The job's shell sees exactly the text given: no command substitution, expansion or broken quoting."""
    marker = tmp_path / "ran"
    value = value.format(marker=marker)
    text = render(GENERIC, {"EXTRA_ARGS": value})
    assert parse_template(text).value("EXTRA_ARGS") == value
    assignment = next(line for line in text.splitlines() if line.startswith(': "${EXTRA_ARGS:='))
    shown = subprocess.run(["bash", "-c", f'{assignment}\nprintf %s "$EXTRA_ARGS"'], capture_output=True, text=True,
                           env={"PATH": os.environ["PATH"]})
    assert shown.returncode == 0 and shown.stdout == value, shown
    assert not marker.exists()


def test_templates_ship_inside_a_non_editable_install(tmp_path):
    """``pip install .`` (not -e) carries the templates: render works from anywhere, and --version answers."""
    target = tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                            "--target", str(target), REPO], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    assert sorted(p.name for p in (target / "mpicomm" / "slurm" / "templates").glob("*.sbatch")) == \
        sorted(f for f in os.listdir(repo_slurm_dir()) if f.endswith(".sbatch"))
    env = dict(os.environ, PYTHONPATH=str(target))
    rendered = subprocess.run([sys.executable, "-m", "mpicomm", "slurm", "render", "generic", "--set", "nodes=3"],
                              capture_output=True, text=True, cwd=tmp_path, env=env)
    assert rendered.returncode == 0, rendered.stderr
    assert "#SBATCH --nodes=3" in rendered.stdout
    version = subprocess.run([sys.executable, "-m", "mpicomm", "--version"], capture_output=True, text=True,
                             cwd=tmp_path, env=env)
    assert version.stdout.strip() == f"mpicomm {mpicomm.__version__}"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_checked_in_templates_match_their_presets(name):
    with open(os.path.join(repo_slurm_dir(), f"{name}.sbatch")) as f:
        assert f.read() == preset_text(GENERIC, name), "run `mpicomm slurm regenerate` after editing a preset"


def test_cli_reports_one_clear_error_and_nonzero_exit():
    proc = subprocess.run([sys.executable, "-m", "mpicomm", "slurm", "render", "generic", "--set", "nodes=-3"],
                          capture_output=True, text=True)
    assert proc.returncode != 0
    expected = "mpicomm slurm render: error: --set nodes=-3: expected a positive integer"
    assert proc.stderr.strip().splitlines() == [expected]


def test_templates_carry_commented_partition_and_account_lines_that_set_enables():
    for name in ["generic", *sorted(PRESETS)]:
        with open(os.path.join(repo_slurm_dir(), f"{name}.sbatch")) as f:
            lines = f.read().splitlines()
        assert "##SBATCH --partition=PARTITION" in lines and "##SBATCH --account=ACCOUNT" in lines, name
    out = render(GENERIC, {"partition": "gpu", "account": "proj42"}).splitlines()
    assert "#SBATCH --partition=gpu" in out and "#SBATCH --account=proj42" in out
    assert not any(line.startswith("##SBATCH --partition") for line in out)
    assert sum(line.startswith("#SBATCH --partition") for line in out) == 1


def test_data_must_name_a_known_dataset():
    assert parse_template(render(GENERIC, {"DATA": "mnist"})).value("DATA") == "mnist"
    with pytest.raises(ValueError, match="DATA=imagenet: expected one of cifar10, mnist, python-docs or empty"):
        render(GENERIC, {"DATA": "imagenet"})


def test_render_writes_the_project_folder_and_checked_in_templates_name_none(tmp_path):
    """`mpicomm slurm render` writes this checkout into the job (it then runs from anywhere); the checked-in
    files stay machine-independent and find the project themselves."""
    shown = subprocess.run([sys.executable, "-m", "mpicomm", "slurm", "render", "resnet20_cpu"], cwd=tmp_path,
                           capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    assert parse_template(shown.stdout).value("MPICOMM_HOME") == REPO
    mine = subprocess.run([sys.executable, "-m", "mpicomm", "slurm", "render", "generic", "--set",
                           "MPICOMM_HOME=/opt/mpicomm"], cwd=tmp_path, capture_output=True, text=True)
    assert parse_template(mine.stdout).value("MPICOMM_HOME") == "/opt/mpicomm"
    for name in ["generic", *sorted(PRESETS)]:
        with open(os.path.join(repo_slurm_dir(), f"{name}.sbatch")) as f:
            assert parse_template(f.read()).value("MPICOMM_HOME") == "", name


def _job_env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MPICOMM_"))}
    env.update(SLURM_JOB_ID="77", SLURM_SUBMIT_DIR=str(tmp_path), MPICOMM_DATA_DIR=str(tmp_path / "data"), **extra)
    return env


def test_a_checked_in_job_finds_its_project_from_the_submitted_path(tmp_path):
    """sbatch runs a spool copy of the script from another folder: the job asks Slurm for the submitted path
    (Command=) and finds the project above slurm/; here it gets as far as the data step (CIFAR-10 absent)."""
    spool = tmp_path / "spool"
    spool.mkdir()
    fake = tmp_path / "bin"
    fake.mkdir()
    submitted = os.path.join(repo_slurm_dir(), "resnet20_moniqua.sbatch")
    (fake / "scontrol").write_text(f"#!/bin/sh\necho 'JobId=77 JobName=x Command={submitted} WorkDir=/tmp'\n")
    (fake / "scontrol").chmod(0o755)
    with open(submitted) as f:
        (spool / "slurm_script").write_text(f.read())
    env = _job_env(tmp_path, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", str(spool / "slurm_script")], cwd=spool, capture_output=True, text=True, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("fetch_data: error: cifar10 is missing"), proc.stderr
    assert proc.stdout == "", proc.stdout


def test_a_job_that_cannot_find_its_project_says_so_in_one_line(tmp_path):
    env = _job_env(tmp_path, PATH=f"/nonexistent{os.pathsep}/usr/bin:/bin")  # no scontrol: Slurm cannot tell
    job = tmp_path / "job.sbatch"
    job.write_text(GENERIC)
    proc = subprocess.run(["bash", str(job)], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        "mpicomm: error: apps/train_resnet.py is not in MPICOMM_HOME=(not found): render the job with mpicomm "
        "slurm render, or submit with sbatch --export=ALL,MPICOMM_HOME=/path/to/mpicomm"]

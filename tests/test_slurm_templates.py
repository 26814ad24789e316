"""The sbatch renderer: settings applied, bad values refused before anything reaches the scheduler,
and the checked-in job templates identical to their presets."""

import os
import subprocess
import sys

import pytest

from mpicomm.slurm import parse_template, render
from mpicomm.slurm.commands import preset_text, repo_slurm_dir
from mpicomm.slurm.presets import PRESETS

GENERIC = open(os.path.join(repo_slurm_dir(), "generic.sbatch")).read()


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
    ("time", "soon", "D-HH:MM:SS"),
    ("ALGORITHM", "sgd9000", "unknown algorithm"),
    ("TOPOLOGY", "moebius", "unknown topology"),
    ("EPOCHS", "-1", "non-negative integer"),
    ("MPI_PMI", "pmi9", "pmi2"),
    ("EXTRA_ARGS", 'a"b', "double quotes"),
])
def test_bad_values_are_refused(key, value, message):
    with pytest.raises(ValueError, match=message):
        render(GENERIC, {key: value})


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

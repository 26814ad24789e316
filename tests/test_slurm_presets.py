"""The job presets: GPU presets bind one GPU per task with --device auto, the CPU preset runs one rank per
core on the CPU, a GPU preset with gpus-per-task=0 is refused with the reason, and the template's
oversubscription switch exports MPICH's yield setting exactly when ranks outnumber the node's CPUs."""

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

from .app_runs import app_module

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

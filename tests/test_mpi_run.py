"""tests/mpi_run.py refuses a world that is not the one launched, so an MPI tier cannot pass having run
N independent 1-rank sessions (an ``mpiexec`` of another MPI library than mpi4py's) or the wrong count.

The jobs here only start pytest with ``--version`` (nothing is collected): they take a second or two.
"""

import os
import subprocess
import sys

import pytest

from .app_runs import REPO, mpiexec
from .mpi_run import MISMATCH_EXIT, expected_ranks, launcher_size, size_problem

RUNNER = os.path.join(REPO, "tests", "mpi_run.py")
LAUNCH_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS",
                    "MPICOMM_EXPECT_RANKS")


def _clean_env(**extra) -> dict:
    """This environment without any launcher's size variables (as in a shell outside a job), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("PMI_")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def test_launcher_size_reads_each_launchers_variable():
    """MPICH's PMI_SIZE, Open MPI's OMPI_COMM_WORLD_SIZE, and srun's counts only inside an srun step (a batch
    script's SLURM_NTASKS says nothing about a launcher started from it)."""
    assert launcher_size({}) is None
    assert launcher_size({"PMI_SIZE": "4"}) == ("PMI_SIZE", 4)
    assert launcher_size({"OMPI_COMM_WORLD_SIZE": "2"}) == ("OMPI_COMM_WORLD_SIZE", 2)
    assert launcher_size({"PMI_SIZE": "2", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8"}) == ("PMI_SIZE", 2)
    assert launcher_size({"SLURM_NTASKS": "8"}) is None
    assert launcher_size({"SLURM_STEP_ID": "3", "SLURM_NTASKS": "8"}) == ("SLURM_NTASKS", 8)
    assert launcher_size({"SLURM_STEP_ID": "3", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "8"}) == (
        "SLURM_STEP_NUM_TASKS", 2)


def test_expected_count_comes_from_the_option_or_the_environment():
    """``--expect-ranks N`` (either spelling) wins over MPICOMM_EXPECT_RANKS and is not passed on to pytest."""
    assert expected_ranks(["-q", "-m", "mpi"], {}) == (None, ["-q", "-m", "mpi"])
    assert expected_ranks(["-q"], {"MPICOMM_EXPECT_RANKS": "3"}) == (3, ["-q"])
    assert expected_ranks(["--expect-ranks", "2", "-q"], {"MPICOMM_EXPECT_RANKS": "3"}) == (2, ["-q"])
    assert expected_ranks(["-q", "--expect-ranks=4"], {}) == (4, ["-q"])
    with pytest.raises(SystemExit, match="positive integer"):
        expected_ranks(["--expect-ranks", "0"], {})
    assert size_problem(4, 4, {"PMI_SIZE": "4"}) == ""
    assert "the launcher started 4 (PMI_SIZE=4)" in size_problem(1, None, {"PMI_SIZE": "4"})
    assert "3 were expected" in size_problem(2, 3, {"PMI_SIZE": "2"})


def test_one_rank_worlds_under_a_foreign_launcher_fail_loudly():
    """What Open MPI's mpirun does to an MPICH mpi4py: each process is a world of 1 while the launcher says 2.
    The runner exits non-zero with the reason before running any test."""
    proc = subprocess.run([sys.executable, RUNNER, "--version"], capture_output=True, text=True, timeout=120,
                          env=_clean_env(OMPI_COMM_WORLD_SIZE="2"), cwd=REPO)
    assert proc.returncode == MISMATCH_EXIT, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "MPI.COMM_WORLD has 1 rank(s), but the launcher started 2 (OMPI_COMM_WORLD_SIZE=2)" in proc.stderr


def test_expected_rank_count_is_enforced_under_mpiexec():
    """Two real ranks pass when 2 are expected and fail (every rank, same exit code) when 3 are."""
    cmd = [mpiexec(), "-n", "2", sys.executable, RUNNER, "--version"]
    good = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_clean_env(MPICOMM_EXPECT_RANKS="2"),
                          cwd=REPO)
    assert good.returncode == 0, (good.stdout[-2000:], good.stderr[-2000:])
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_clean_env(MPICOMM_EXPECT_RANKS="3"),
                         cwd=REPO)
    assert bad.returncode == MISMATCH_EXIT, (bad.returncode, bad.stdout[-2000:], bad.stderr[-2000:])
    assert bad.stderr.count("MPI.COMM_WORLD has 2 rank(s), but 3 were expected") == 2, bad.stderr[-2000:]

"""scripts/mpi_yield.sh: the launch scripts export MPI's yield settings exactly when ranks outnumber cores."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VARS = ("MPIR_CVAR_ENABLE_HEAVY_YIELD", "OMPI_MCA_mpi_yield_when_idle")


def exported(ranks: int, **preset: str) -> list[str]:
    """The two variables after ``mpi_yield_if_oversubscribed RANKS`` (OMP_NUM_THREADS=1 as demo.sh sets it)."""
    env = {k: v for k, v in os.environ.items() if k not in VARS}
    env.update(preset, OMP_NUM_THREADS="1")
    script = f". scripts/mpi_yield.sh && mpi_yield_if_oversubscribed {ranks} && " + " && ".join(
        f'echo "${{{v}:-}}"' for v in VARS)
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


CORES = len(os.sched_getaffinity(0))


@pytest.mark.parametrize("ranks, expected", [(CORES + 1, ["1", "1"]), (CORES, ["", ""]), (1, ["", ""])])
def test_yield_is_exported_only_when_ranks_outnumber_cores(ranks, expected):
    assert exported(ranks) == expected


def test_a_value_already_set_wins():
    assert exported(CORES + 1, MPIR_CVAR_ENABLE_HEAVY_YIELD="0") == ["0", "1"]


def test_demo_sources_the_helper_before_mpiexec():
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    assert demo.index('mpi_yield_if_oversubscribed "$RANKS"') < demo.index("mpiexec")

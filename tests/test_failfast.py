"""A rank that raises must end the whole job quickly with a non-zero exit, not hang the others.

These tests launch their own small MPI jobs, so they run in the serial tier (no --with-mpi).
"""

import subprocess
import sys
import time

from .app_runs import mpiexec

RAISE_THEN_BARRIER = """
from mpi4py import MPI
comm = MPI.COMM_WORLD
{prologue}
    if comm.Get_rank() == 1:
        raise RuntimeError("rank 1 fails on purpose")
    comm.Barrier()  # the other ranks wait here forever unless the job is aborted
"""


def _run(script: str, *python_args: str) -> tuple[int, float, str]:
    t0 = time.monotonic()
    proc = subprocess.run(
        [mpiexec(), "-n", "3", sys.executable, *python_args, "-c", script],
        capture_output=True, text=True, timeout=60,
    )
    return proc.returncode, time.monotonic() - t0, proc.stderr


def test_abort_on_exception_ends_job():
    script = RAISE_THEN_BARRIER.format(
        prologue="from mpicomm.comm import abort_on_exception\nwith abort_on_exception(comm):"
    )
    code, elapsed, err = _run(script)
    assert code != 0
    assert elapsed < 30, f"job took {elapsed:.1f} s to die"
    assert "rank 1 fails on purpose" in err


def test_python_m_mpi4py_convention_ends_job():
    script = RAISE_THEN_BARRIER.format(prologue="if True:")
    code, elapsed, err = _run(script, "-m", "mpi4py")
    assert code != 0
    assert elapsed < 30, f"job took {elapsed:.1f} s to die"
    assert "rank 1 fails on purpose" in err

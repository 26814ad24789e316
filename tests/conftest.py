"""Shared fixtures. MPI is imported lazily so the serial tier never needs a launcher."""

import contextlib
import subprocess
import traceback

import pytest
from hypothesis import settings

# Same examples on every run and on every MPI rank: a property test must not pass or fail by luck,
# and ranks drawing different examples would enter different collectives.
settings.register_profile("mpicomm", derandomize=True, deadline=None, database=None)
settings.load_profile("mpicomm")


@pytest.fixture
def comm():
    """``MPI.COMM_WORLD`` for tests marked ``mpi`` (run under mpiexec with --with-mpi)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def assert_all(comm, ok: bool, detail: str = "") -> None:
    """Collective assertion: every rank reaches it, and every rank fails if any rank's ``ok`` is false."""
    results = comm.allgather((bool(ok), str(detail)))
    bad = [(rank, d) for rank, (good, d) in enumerate(results) if not good]
    assert not bad, "failed on rank(s): " + "; ".join(f"{r}: {d}" for r, d in bad)


def run_all(comm, body) -> None:
    """Run ``body()`` on every rank, then fail on every rank if it raised on any (with the traceback)."""
    try:
        body()
        ok, detail = True, ""
    except Exception:  # noqa: BLE001 - reported collectively below
        ok, detail = False, traceback.format_exc(limit=6)
    assert_all(comm, ok, detail)


def mount_tmpfs(where, size: str) -> None:
    """Mount a tmpfs of ``size`` (e.g. ``"4m"``) at the new folder ``where``; skip the test without root."""
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")


@contextlib.contextmanager
def tmpfs(where, size: str):
    """:func:`mount_tmpfs` for the block, unmounted (lazily) after it; yields ``where``."""
    mount_tmpfs(where, size)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)

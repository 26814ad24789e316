"""The world communicator, for the code that starts a job (apps, the command line) without importing mpi4py."""

from __future__ import annotations

__all__ = ["world"]


def world():
    """``MPI.COMM_WORLD``: every process the launcher started (importing mpi4py initialises MPI)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD

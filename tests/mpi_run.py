"""Run pytest (with pytest-mpi's --with-mpi) on every MPI rank and agree on one exit code.

Rank 0 prints its session as usual; the other ranks write theirs to a temporary file that is shown
only when that rank failed, so the log stays readable and no failure is hidden. The process exits
with the worst exit code of all ranks.

usage: mpiexec -n N python tests/mpi_run.py [pytest args...]
"""

import os
import sys
import tempfile

import pytest
from mpi4py import MPI


def main() -> int:
    """Run pytest on this rank, then combine the exit codes of all ranks."""
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    args = ["--with-mpi", *sys.argv[1:]]
    if rank == 0:
        code = int(pytest.main(args))
        log_text = ""
    else:
        with tempfile.TemporaryFile(mode="w+") as log:
            sys.stdout.flush()
            sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                code = int(pytest.main(args))
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
            log.seek(0)
            log_text = log.read()
    codes = comm.allgather(code)
    for r in range(1, comm.Get_size()):
        comm.Barrier()
        if r == rank and code != 0:
            print(f"\n===== rank {rank} failed (pytest exit {code}); its session: =====\n{log_text}", flush=True)
    if rank == 0:
        print(f"pytest exit codes by rank: {codes}", flush=True)
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())

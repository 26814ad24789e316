"""A job that hangs on purpose, for the hang guard's tests: rank 0 waits in one collective, the others in another.

    mpiexec -n 2 python tests/hang_job.py

Rank 0 enters "the step's agreement" on one communicator while the others enter "the evaluation's
allgather" on a second one (each a duplicate of the world): the shape of the deadlock that uneven shards
once caused, without undefined mismatched collectives on one communicator. The stop-signal handlers are
installed as the training loop installs them. Rank 0 prints ``waiting`` once everything is in place.
"""

import sys

from mpi4py import MPI

from mpicomm import topology
from mpicomm.comm import Communicator
from mpicomm.training.stop import StopFlag


def main() -> None:
    """Build two communicators, install the stop handlers, then wait forever (until the guard ends it)."""
    world = MPI.COMM_WORLD
    ring = topology.ring(world.Get_size())
    first, second = Communicator(world.Dup(), ring), Communicator(world.Dup(), ring)
    StopFlag(install=True, guard=first.guard)
    first.guard.step = 7
    world.Barrier()
    if first.rank == 0:
        print("waiting", flush=True)
    with first.guard.doing("evaluation"):
        if first.rank == 0:
            first.allgather_object(0, "the step's agreement")
        else:
            second.allgather_object(0, "the evaluation's allgather")
    sys.exit("the collective completed: the job was meant to hang")


if __name__ == "__main__":
    main()

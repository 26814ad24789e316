"""Node-local rank and size: which slot of its node a rank holds (one GPU per slot, usually).

``local_rank(comm)`` / ``local_size(comm)`` split ``comm`` by shared memory
(``Split_type(COMM_TYPE_SHARED)``): ranks that can share memory, i.e. run on the same node, land in
one group, ordered by their rank in ``comm``. Each call is collective over ``comm`` (one split,
freed at once); call :func:`node_layout` to get both numbers from one split.
"""

from __future__ import annotations

from mpi4py import MPI

from .world import raw_comm

__all__ = ["local_rank", "local_size", "node_layout"]


def node_layout(comm) -> tuple[int, int]:
    """Collective: ``(local_rank, local_size)`` of this rank within its node; ``comm``: a
    :class:`~mpicomm.comm.World`, a Communicator or an mpi4py communicator."""
    raw = raw_comm(comm)
    node = raw.Split_type(MPI.COMM_TYPE_SHARED, key=raw.Get_rank())
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def local_rank(comm) -> int:
    """Collective: this rank's index among the ranks of ``comm`` on the same node (0 .. local_size - 1)."""
    return node_layout(comm)[0]


def local_size(comm) -> int:
    """Collective: how many ranks of ``comm`` run on this rank's node."""
    return node_layout(comm)[1]

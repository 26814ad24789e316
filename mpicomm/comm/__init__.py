"""The only place mpicomm imports mpi4py: the world, the communicator, buffer routing, fail-fast, node layout."""

from . import progress  # first: with MPICOMM_PROGRESS=mpich it sets MPICH's variable before mpi4py starts MPI
from .buffers import BufferRouter, query_cuda_aware
from .communicator import Communicator, Handle
from .failfast import abort_on_exception, raise_together
from .local import local_rank, local_size, node_layout
from .nodes import RANKS_PER_NODE_ENV, NodeLayout
from .world import World, as_world, mpi_finalized, world

__all__ = [
    "BufferRouter",
    "Communicator",
    "Handle",
    "NodeLayout",
    "RANKS_PER_NODE_ENV",
    "World",
    "abort_on_exception",
    "as_world",
    "local_rank",
    "local_size",
    "mpi_finalized",
    "node_layout",
    "progress",
    "query_cuda_aware",
    "raise_together",
    "world",
]

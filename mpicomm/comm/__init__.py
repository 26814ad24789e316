"""The only place mpicomm imports mpi4py: communicator, buffer routing, fail-fast helpers."""

from .buffers import BufferRouter, query_cuda_aware
from .communicator import Communicator, Handle
from .failfast import abort_on_exception, raise_together

__all__ = [
    "BufferRouter",
    "Communicator",
    "Handle",
    "abort_on_exception",
    "query_cuda_aware",
    "raise_together",
]

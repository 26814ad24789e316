"""Rounds: a non-blocking allgather of a few int64 per rank, tested without waiting, on a private communicator.

The free-running ranks of an asynchronous method (:mod:`mpicomm.training.pace`) learn how far the run has
come this way: each rank posts its own small vector (its step count, a pending stop signal) into a round and
tests it after each of its steps; the round completes once every rank has joined it, and nobody waits for it
unless it chooses to, under the Communicator's hang guard. The rounds run on a duplicate of the
Communicator's MPI communicator, so they never match the algorithm's own collectives.
"""

from __future__ import annotations

import numpy as np

from .faults import track

__all__ = ["CountRounds"]


class CountRounds:
    """Collective at construction: rounds of ``width`` int64 per rank over a private duplicate of ``comm``.

    At most one round is open at a time: :meth:`post` opens it, :meth:`test` or :meth:`wait` completes it,
    and :attr:`received` then holds every rank's vector (one row per rank). :meth:`free` (collective) frees
    the duplicate once the last round has completed.
    """

    def __init__(self, comm, width: int):
        self.size, self.guard = comm.size, comm.guard
        self._comm = comm.comm.Dup()
        track(self._comm)
        self.sent = np.zeros(width, dtype=np.int64)
        self.received = np.zeros((comm.size, width), dtype=np.int64)
        self._request = None

    @property
    def open(self) -> bool:
        """Whether a posted round has not completed yet on this rank."""
        return self._request is not None

    def post(self, values) -> None:
        """Join the next round with this rank's ``values`` (``width`` integers), without waiting."""
        assert self._request is None, "a round is still open"
        self.sent[:] = values
        self._request = self._comm.Iallgather(self.sent, self.received)

    def test(self) -> bool:
        """Whether the open round has completed (then :attr:`received` holds it); never waits."""
        if self._request is None or not self._request.Test():
            return False
        self._request = None
        return True

    def wait(self, what: str) -> None:
        """Block until the open round completes, under the hang guard (``what``: the wait's name for its message)."""
        if self._request is None:
            return
        with self.guard.waiting(what):
            self._request.Wait()
        self._request = None

    def free(self) -> None:
        """Collective: free the private communicator (every rank's last round has completed by then)."""
        if self._request is None and self._comm is not None:
            self._comm.Free()
            self._comm = None

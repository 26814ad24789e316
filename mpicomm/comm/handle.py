"""Handle, a pending non-blocking call, and the byte layouts the vector collectives give MPI."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..net import NetClock
from .buffers import as_bytes
from .guard import WaitGuard
from .progress import pending

__all__ = ["Handle", "byte_specs", "displacements"]


class Handle:
    """A pending non-blocking operation; ``wait()`` completes it and returns its result.

    While it is pending, the process's progress mechanism (:mod:`mpicomm.comm.progress`, ``MPICOMM_PROGRESS``)
    moves its messages even when the caller makes no MPI call.
    """

    def __init__(self, request, finish, clock: NetClock, deadline: float, guard: WaitGuard, op: str):
        self._request = request
        self._finish = finish
        self._clock = clock
        self._deadline = deadline
        self._guard, self._op = guard, op
        self._result = None
        self._done = False
        self._progress = pending(op)

    def test(self) -> bool:
        """True when the operation (and its modelled transfer, if any) has completed, without blocking."""
        if self._done:
            return True
        if not self._request.Test():
            return False
        self._progress.done()  # the transfer is over: nothing left to move
        return self._clock.passed(self._deadline)

    def wait(self):
        """Block until complete; return the received tensor (idempotent)."""
        if not self._done:
            self._progress.done()  # the wait itself drives MPI's progress from here on
            with self._guard.waiting(f"the wait for {self._op}"):
                self._clock.complete(self._deadline, self._request.Wait)
            self._result = self._finish()
            self._done = True
        return self._result


def byte_specs(sbuf: torch.Tensor, rbuf: torch.Tensor) -> tuple:
    """MPI buffer specs of a send and a receive buffer, as raw bytes."""
    return as_bytes(sbuf), as_bytes(rbuf)


def displacements(counts: Sequence[int]) -> list[int]:
    """Where each of ``counts``' consecutive parts starts: ``[0, c0, c0 + c1, ...]``."""
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += int(c)
    return out

"""Moniqua's agreement one step late: posted non-blocking at step k, settled at step k + 1 (``overlap=True``).

The blocking step agrees, by one allreduce(max) after the received codes are recovered, which tensors wrapped
on some edge (those are left unmixed everywhere) and theta's inputs. Nothing can post it before the exchange
is complete, so under ``overlap`` it would be the one call left in ``step()`` with nothing to hide behind.
Here it is posted at the end of step k and waited for at step k + 1, after that step's forward and backward::

    step k:    x[S_l] += gamma inc_l      for every tensor whose recovery did not wrap *on this rank*
               post allreduce(max) of (local wrap flags, theta's statistic, observed distances)
    step k+1:  wait for it; for a tensor that wrapped on some other rank's edge: x[S_l] -= gamma inc_l
               (no rank keeps step k's mix of that part, as in the blocking step); guard and theta updated

So a step differs from the blocking one in two ways only: theta of step k + 1 is computed from the agreements
up to step k - 1 (one step older; a fixed theta is unaffected, and then the result is the blocking step's bit
for bit while nothing wraps), and a part that wrapped elsewhere is un-mixed one step later (the average is
kept to float32 rounding of ``x + a - a``). The cost is one buffer of the step's increments (float32, one per
code sent) held from step k to step k + 1; after a wait only the increments of the parts to undo are kept.
"""

from __future__ import annotations

import atexit
import time
from typing import Any

import torch

from ...comm import mpi_finalized

__all__ = ["DeferredAgreement"]

_ORPHANS: list = []
"""Handles of agreements still in flight when their algorithm was dropped without ``close()``: kept alive (MPI
still writes into their buffers) and completed at exit, before MPI is finalised."""
DRAIN_S = 10.0
"""The most seconds the exit waits for orphaned agreements (a rank that died never completes one)."""


def _drain_orphans() -> None:
    if mpi_finalized():
        return
    deadline = time.monotonic() + DRAIN_S
    while _ORPHANS and time.monotonic() < deadline:
        _ORPHANS[:] = [h for h in _ORPHANS if not _done(h)]
        time.sleep(0.001)


def _done(handle) -> bool:
    """Whether an orphaned agreement has completed (or can never: its communicator failed or was revoked)."""
    try:
        return handle.test()
    except Exception:  # noqa: BLE001 - a failed peer or a revoked communicator: nothing left to wait for
        return True


atexit.register(_drain_orphans)  # registered after mpi4py's finalisation, so it runs before it


class DeferredAgreement:
    """The agreement of the last mixing step: in flight, or agreed and not yet applied (or nothing)."""

    def __init__(self, count: int):
        self.count = count
        self.handle = None  # the allreduce's handle while in flight
        self.local: torch.Tensor | None = None  # this rank's wrap flags of that step (bool per tensor)
        self.increment: torch.Tensor | None = None  # that step's increments (until the agreement arrives)
        self.spans: list[tuple[int, int, int]] = []  # per tensor: (start, stop, position in increment)
        self.step = -1
        self.agreed: torch.Tensor | None = None  # float64: flags, statistic, distances
        self.undo: list[tuple[int, int, torch.Tensor]] = []  # (start, stop, increment) applied here, wrapped elsewhere

    def __del__(self):
        if self.handle is not None:
            _ORPHANS.append(self.handle)

    def post(self, comm, values: torch.Tensor, local: torch.Tensor, increment: torch.Tensor, spans, step: int) -> None:
        """Post the allreduce(max) of ``values`` for step ``step``, keeping what settling it needs."""
        self.handle = comm.iallreduce(values.to(torch.float32).clone(), "max")
        self.local, self.increment, self.spans, self.step = local, increment, list(spans), step
        self.agreed, self.undo = None, []

    @property
    def pending(self) -> bool:
        """Whether an agreement is posted or agreed and not yet applied."""
        return self.handle is not None or self.agreed is not None

    def wait(self) -> None:
        """Complete the allreduce (if in flight): keep the agreed values and only the increments to undo."""
        if self.handle is None:
            return
        self.agreed = self.handle.wait().double()
        self.handle = None
        elsewhere = (self.agreed[:self.count] > 0) & ~self.local
        self.undo = [(start, stop, self.increment[position:position + stop - start].clone())
                     for flag, (start, stop, position) in zip(elsewhere.tolist(), self.spans) if flag]
        self.increment = None

    def take(self) -> tuple[torch.Tensor, list, int] | None:
        """The agreed values, the parts to undo and their step (waiting if needed); nothing is pending after."""
        if not self.pending:
            return None
        self.wait()
        out = self.agreed, self.undo, self.step
        self.agreed, self.undo, self.local, self.spans = None, [], None, []
        return out

    def state_dict(self) -> dict[str, Any]:
        """What is pending, waited for first: the agreed values, the step and the parts to undo (often none)."""
        self.wait()
        agreed = torch.zeros(0, dtype=torch.float64) if self.agreed is None else self.agreed.clone()
        spans = torch.tensor([[a, b] for a, b, _ in self.undo], dtype=torch.int64).reshape(-1, 2)
        values = torch.cat([u for _, _, u in self.undo]) if self.undo else torch.zeros(0, dtype=torch.float32)
        return {"agreed": agreed, "step": self.step, "undo_spans": spans, "undo": values}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (an empty one: nothing pending)."""
        self.handle, self.increment, self.local, self.spans = None, None, None, []
        agreed = state["agreed"]
        self.agreed = agreed.clone().double() if agreed.numel() else None
        self.step = int(state["step"])
        self.undo, at = [], 0
        for a, b in state["undo_spans"].tolist():
            self.undo.append((a, b, state["undo"][at:at + b - a].clone().float()))
            at += b - a

"""Errors a user can act on, and the mark that says every rank raised the same one.

A collective error check (``raise_together``, the checkpoint store's agreement) raises the same
exception on every rank; it marks it with :func:`mark_agreed`, recording the cause without the rank
and type prefixes. An app that catches a marked error knows that every rank holds it, so rank 0 alone
prints it in one line and every rank exits normally: no abort, no race that loses the message.

No MPI here: the checkpoint store and the communicator both use it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Agreed", "ScriptError", "TrainingStopped", "agreed_of", "mark_agreed", "one_line"]


class TrainingStopped(RuntimeError):
    """Training cannot go on (a non-finite loss or parameter, a checkpoint that could not be written)."""


class ScriptError(RuntimeError):
    """A mistake in the user's training script that this rank found on its own, without asking the others.

    Raised where a collective check would cost a message every step (a parameter re-homed after ``wrap``,
    an ``optimizer.step()`` outside the algorithm's step). :func:`mpicomm.init`'s error handling ends the job
    with one line and exit 2: one line from rank 0 when every rank raised it, else the line of each rank
    that did.
    """


@dataclass(frozen=True)
class Agreed:
    """How an error that every rank raised came about: the first failing rank's message, and who failed."""

    message: str
    ranks: tuple[int, ...]
    world_size: int

    def describe(self) -> str:
        """The message, prefixed by the failing rank unless every rank failed alike."""
        if len(self.ranks) == self.world_size:
            return self.message
        more = f" (and {len(self.ranks) - 1} more)" if len(self.ranks) > 1 else ""
        return f"rank {self.ranks[0]}{more}: {self.message}"


def mark_agreed(exc: BaseException, message: str, ranks, world_size: int) -> BaseException:
    """Mark ``exc`` as raised on every rank alike (the cause ``message`` failed on ``ranks``); return it."""
    exc.mpicomm_agreed = Agreed(one_line(message), tuple(ranks), int(world_size))
    return exc


def agreed_of(exc: BaseException) -> Agreed | None:
    """The agreement mark of ``exc`` (or of an exception it was raised from), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        mark = getattr(exc, "mpicomm_agreed", None)
        if mark is not None:
            return mark
        exc = exc.__cause__
    return None


def one_line(text: str) -> str:
    """``text`` with its lines joined by '; ', so a message never spans lines."""
    return "; ".join(part.strip() for part in str(text).splitlines() if part.strip())

"""The checkpoint's collective agreement: every rank raises the first failing rank's error, or all go on.

The ranks talk through ``comm.allgather_object`` only (small Python objects): ``comm`` is a
:class:`~mpicomm.comm.Communicator` or a :class:`~mpicomm.comm.World`, or any object with ``rank``, ``size`` and
``allgather_object(obj, what)``. This package never speaks MPI itself.
"""

from __future__ import annotations

import builtins

from ..errors import mark_agreed
from .tree import CheckpointError

__all__ = ["WHAT", "agree", "control"]

WHAT = "the checkpoint's agreement"
"""What the ranks wait on in the store's gathers (the hang guard names it)."""


def control(comm):
    """``comm`` itself when it has what the store gathers with; else a TypeError saying what it must be."""
    if not all(hasattr(comm, a) for a in ("rank", "size", "allgather_object")):
        raise TypeError("comm must be a Communicator or a World (mpicomm.comm.world()): an object with rank, size and "
                        f"allgather_object, got {type(comm).__name__}")
    return comm


def _error_class(error: BaseException) -> type:
    """The nearest class of ``error`` every rank can rebuild: CheckpointError or a builtin exception."""
    return next(c for c in type(error).__mro__ if c is CheckpointError or getattr(builtins, c.__name__, None) is c)


def agree(comm, error: Exception | None, what: str, payload=None) -> list:
    """Collective: every rank raises if any rank failed (first failure's type and message); else all payloads."""
    mine = None if error is None else (_error_class(error).__name__, type(error).__name__, str(error),
                                         getattr(error, "errno", None))
    gathered = comm.allgather_object((mine, payload), WHAT)
    failed = [(rank, report) for rank, (report, _) in enumerate(gathered) if report is not None]
    if failed:
        rank, (name, kind, message, code) = failed[0]
        more = f" (and on {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        text = f"{what} failed on rank {rank}{more}: {kind}: {message}"
        cls = CheckpointError if name == "CheckpointError" else getattr(builtins, name)
        try:
            exc = cls(text)
        except TypeError:  # a builtin needing more arguments (UnicodeEncodeError)
            exc = RuntimeError(text)
        if isinstance(exc, OSError):
            exc.errno = code
        raise mark_agreed(exc, message, [r for r, _ in failed], len(gathered)) from error
    return [p for _, p in gathered]

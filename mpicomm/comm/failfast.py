"""Fail fast across ranks: one rank's error ends the job, or becomes the same error on every rank.

Two tools, for two situations:

* :func:`abort_on_exception` turns an uncaught exception on any rank into ``MPI_Abort`` so that the
  other ranks, possibly blocked in a collective, are ended within seconds with a non-zero exit. It is
  what ``python -m mpi4py script.py`` does; the ``mpicomm`` entry point applies it itself.
* :func:`raise_together` is for errors every rank can reach the same point with (bad configuration,
  mismatched models): each rank passes its local error or ``None``; every rank then raises the same
  error, naming the first failing rank, and nobody is left waiting.

A third, for the errors a rank finds on its own (:class:`~mpicomm.errors.ScriptError`, a mistake in the
user's loop): :func:`settle_local_error` waits briefly for the other ranks to report one too. If they all
do, rank 0 prints one line; if not, each failing rank prints its own, so no message is ever lost.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time
import traceback

from mpi4py import MPI

from ..errors import mark_agreed
from .faults import is_rank_loss
from .world import raw_comm

__all__ = ["ABORT_GRACE_S", "SETTLE_S", "abort_on_exception", "abort_with_line", "prepare_local_errors",
           "raise_together", "settle_local_error"]

ABORT_GRACE_S = 1.0
"""Seconds between printing a rank's error and ``MPI_Abort``. The message is in the pipe to the launcher's
proxy once flushed, but the abort tears the proxies down, and without a pause the text was sometimes lost
(a 3-rank job's stderr came back empty in 1 of about 12 test-suite runs)."""

SETTLE_S = 3.0
"""Seconds :func:`settle_local_error` waits for every rank to report an error of its own."""

_LOCAL_ERRORS = None  # a duplicate of the world, used by settle_local_error alone (its barrier matches nothing else)


def _abort(comm, code: int) -> None:
    """Flush stderr, give the launcher time to forward it, then ``MPI_Abort`` (and exit if it returns)."""
    sys.stderr.flush()
    time.sleep(ABORT_GRACE_S)
    comm.Abort(code)
    os._exit(code)  # MPI_Abort may return before the launcher kills this process


@contextlib.contextmanager
def abort_on_exception(comm=None, exit_code: int = 1):
    """Run the body; on an uncaught exception print it with the rank and call ``comm.Abort(exit_code)``.

    ``comm``: a :class:`~mpicomm.comm.World`, a Communicator or an mpi4py communicator (None: the world).
    ``SystemExit`` with code 0 passes through. Under one process (size 1) the exception propagates
    normally, so tracebacks stay readable in serial use.
    """
    comm = MPI.COMM_WORLD if comm is None else raw_comm(comm)
    try:
        yield
    except SystemExit as exc:
        if exc.code in (None, 0) or comm.Get_size() == 1:
            raise
        sys.stderr.write(f"[rank {comm.Get_rank()}] exiting with {exc.code}; aborting the job\n")
        _abort(comm, exc.code if isinstance(exc.code, int) else exit_code)
    except BaseException as exc:
        if comm.Get_size() == 1:
            raise
        if is_rank_loss(exc):  # under the fault-tolerant stack, without --on-rank-loss continue
            sys.stderr.write(f"[rank {comm.Get_rank()}] a rank of the job was lost; ending the job "
                             "(--on-rank-loss continue keeps training on the survivors)\n")
            _abort(comm, exit_code)
        sys.stderr.write(f"[rank {comm.Get_rank()}] uncaught exception; aborting the job\n")
        traceback.print_exc()
        _abort(comm, exit_code)


def raise_together(comm, error: BaseException | None, exc_type: type[BaseException] | None = ValueError) -> None:
    """Collective: if any rank passes an error, raise ``exc_type`` with the first one's message on every rank.

    ``exc_type`` None: the first failing rank's own type when it is ``TypeError``, else ``ValueError`` (the
    same type on every rank, whichever rank failed). ``comm``: a :class:`~mpicomm.comm.Communicator` or a
    :class:`~mpicomm.comm.World` (their guarded ``allgather_object``), or an mpi4py communicator. The raised
    error is marked as agreed (:func:`mpicomm.errors.agreed_of`): an app prints it once.
    """
    gather = getattr(comm, "allgather_object", None) or comm.allgather
    messages = gather(None if error is None else (type(error).__name__, str(error)))
    failed = [rank for rank, m in enumerate(messages) if m is not None]
    if failed:
        name, text = messages[failed[0]]
        cls = exc_type or (TypeError if name == "TypeError" else ValueError)
        exc = cls(f"rank {failed[0]}: {name}: {text}")
        raise mark_agreed(exc, text, failed, len(messages)) from error


def prepare_local_errors(comm) -> None:
    """Collective, once per process: the communicator :func:`settle_local_error` agrees on (a duplicate of
    ``comm``, a World or an mpi4py communicator, freed before MPI is finalized)."""
    global _LOCAL_ERRORS
    if _LOCAL_ERRORS is None:
        _LOCAL_ERRORS = raw_comm(comm).Dup()
        atexit.register(_free_local_errors)  # runs before mpi4py's finalize, registered at its import


def _free_local_errors() -> None:
    global _LOCAL_ERRORS
    if _LOCAL_ERRORS is not None and not MPI.Is_finalized():
        _LOCAL_ERRORS.Free()
    _LOCAL_ERRORS = None


def settle_local_error(message: str, wait_s: float = SETTLE_S) -> tuple[str, bool]:
    """``(line, everyone)``: what this rank prints for its own error ``message`` ("" for nothing).

    Waits up to ``wait_s`` for every rank to call this too (an error every rank's script makes alike). Then
    rank 0 alone gets the line and ``everyone`` is true. Otherwise this rank's line names it. Without
    :func:`prepare_local_errors` (or in a 1-rank job) the line is this rank's at once.
    """
    comm = _LOCAL_ERRORS
    rank = MPI.COMM_WORLD.Get_rank()
    if comm is None or comm.Get_size() == 1:
        return (message if rank == 0 and MPI.COMM_WORLD.Get_size() == 1 else f"rank {rank}: {message}"), False
    request = comm.Ibarrier()
    deadline = time.monotonic() + wait_s
    while not request.Test():
        if time.monotonic() > deadline:
            return f"rank {rank}: {message}", False
        time.sleep(0.01)
    messages = comm.allgather(message)
    if rank != 0:
        return "", True
    if all(m == messages[0] for m in messages):
        return messages[0], True
    return f"rank 0: {messages[0]} (every rank failed; the others' errors differ)", True


def abort_with_line(code: int) -> None:
    """End every rank with exit status ``code`` after this rank's line was written: ``MPI_Abort`` (so the launcher
    reports ``code``, not the signal it ends the other ranks with), its own message silenced."""
    sys.stderr.flush()
    time.sleep(ABORT_GRACE_S)
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 2)  # MPICH prints "Abort(code) on node ..." itself: the line above already said it all
    MPI.COMM_WORLD.Abort(code)
    os._exit(code)

"""Progress for pending non-blocking calls: what moves a message while the rank computes outside MPI.

Over TCP, MPICH moves a pending message only inside an MPI call: an exchange posted before the forward pass
and waited for after backward otherwise mostly happens in the wait. ``MPICOMM_PROGRESS`` picks what drives it:

* ``gossip`` (the default): the progress thread below, while a non-blocking neighbour exchange
  (``ineighbor_allgather``, ``ineighbor_alltoallv``: the gossip methods' overlapped exchange) is pending.
* ``thread``: a daemon thread of this process polls MPI's progress engine every :data:`POLL_S` seconds while
  any non-blocking call of a :class:`~mpicomm.comm.Communicator` is pending, and sleeps on a condition
  variable otherwise (no cost without a pending call). It never touches the caller's request (testing one
  request from two threads is erroneous): it tests a receive of its own, posted on a private duplicate of
  ``COMM_SELF`` and never matched, and ``MPI_Test`` of a pending request runs MPICH's whole progress engine,
  the schedules of non-blocking collectives included (``MPI_Iprobe`` and ``MPI_Testall`` of no request do
  not: a pending neighbour exchange did not move with them). It needs ``MPI_THREAD_MULTIPLE`` (mpi4py's
  default); at a lower thread level it is off.
* ``mpich``: MPICH's own asynchronous progress thread (``MPIR_CVAR_ASYNC_PROGRESS=1``, read at
  ``MPI_Init``, so set in the environment before MPI starts: :func:`request_mpich_progress` does so when
  mpicomm is imported before mpi4py). It runs for the whole job and spins on a core.
* ``none``: nothing; a pending message moves only inside MPI calls.

Measured over TCP shaped to 100 Mbit/s at 4 ranks on 2 shared cores (``bench/wallclock/progress_overlap.py``,
docs/results/progress_overlap.md), the thread hides all of D-PSGD's and CHOCO's overlapped exchange (none:
0.86 and 0.64), while MPICH's spinning thread slows compute on shared cores; for bucketed AllReduce-SGD the
thread changed the hidden fraction within the spread (its buckets are ready only as backward ends) and added
compute, hence ``gossip``.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

__all__ = ["DEFAULT_MODE", "MODES", "NEIGHBOR_OPS", "POLL_S", "PROGRESS_ENV", "ProgressThread", "pending",
           "progress_mode", "request_mpich_progress", "stop_progress"]

PROGRESS_ENV = "MPICOMM_PROGRESS"
MODES = ("none", "mpich", "gossip", "thread")
DEFAULT_MODE = "gossip"
NEIGHBOR_OPS = ("ineighbor_allgather", "ineighbor_alltoallv")
"""The non-blocking calls the thread serves under ``gossip``."""
POLL_S = 0.001
"""Seconds between two polls of the progress thread while a call is pending."""


def progress_mode() -> str:
    """``MPICOMM_PROGRESS`` (``none``, ``mpich``, ``gossip`` or ``thread``), else :data:`DEFAULT_MODE`; a bad
    value is a one-line ``ValueError``."""
    text = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if not text:
        return DEFAULT_MODE
    if text not in MODES:
        raise ValueError(f"{PROGRESS_ENV} must be one of {', '.join(MODES)}, got {os.environ[PROGRESS_ENV]!r}")
    return text


def request_mpich_progress() -> bool:
    """With ``MPICOMM_PROGRESS=mpich``, set ``MPIR_CVAR_ASYNC_PROGRESS=1`` (unless already set) for MPI_Init
    (called when this module is imported); True if MPI is not yet initialised, so that the setting takes
    effect. A bad setting is left for :func:`progress_mode` to report where mpicomm agrees on errors."""
    try:
        mode = progress_mode()
    except ValueError:
        return False
    if mode != "mpich":
        return False
    os.environ.setdefault("MPIR_CVAR_ASYNC_PROGRESS", "1")
    return "mpi4py.MPI" not in sys.modules


class ProgressThread:
    """Polls MPI's progress engine while :meth:`begin` has been called more often than :meth:`end`.

    ``polls`` counts the polls made so far (what a test reads to see that the thread ran).
    """

    def __init__(self, poll_s: float = POLL_S):
        from mpi4py import MPI

        self._mpi = MPI
        self._poll_s = poll_s
        self._cond = threading.Condition()
        self._pending = 0
        self._stopping = False
        self._comm = None
        self._buffer, self._request = None, None  # the never-matched receive the thread tests (and its buffer)
        self._thread: threading.Thread | None = None
        self.polls = 0

    def begin(self) -> None:
        """A non-blocking call was posted: poll until the matching :meth:`end` (starts the thread once)."""
        with self._cond:
            if self._stopping:
                return
            self._pending += 1
            if self._thread is None:
                self._comm = self._mpi.COMM_SELF.Dup()  # local: COMM_SELF has only this rank
                self._buffer = bytearray(1)
                self._request = self._comm.Irecv(self._buffer, source=0, tag=0)  # nothing is ever sent
                self._thread = threading.Thread(target=self._run, name="mpicomm-progress", daemon=True)
                self._thread.start()
            self._cond.notify()

    def end(self) -> None:
        """A call counted by :meth:`begin` completed."""
        with self._cond:
            self._pending = max(0, self._pending - 1)

    def _run(self) -> None:
        request, cond, poll_s = self._request, self._cond, self._poll_s
        while True:
            with cond:
                while self._pending == 0 and not self._stopping:
                    cond.wait()
                if self._stopping:
                    return
            request.Test()  # never true: only the progress engine's turn
            self.polls += 1
            with cond:  # sleep, unless told to stop
                if not self._stopping:
                    cond.wait(poll_s)

    def stop(self) -> None:
        """End the thread (before MPI_Finalize: registered with ``atexit`` after mpi4py's own handler)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5.0)
        if self._comm is not None and not (thread.is_alive() or self._mpi.Is_finalized()):
            self._request.Cancel()
            self._request.Wait()
            self._comm.Free()
            self._comm, self._request = None, None


request_mpich_progress()  # at import: mpicomm.comm imports this module before anything that imports mpi4py

_THREAD: ProgressThread | None = None
_MODE: str | None = None


def _thread(op: str) -> ProgressThread | None:
    """This process's progress thread when the mode has it serve the non-blocking call ``op`` and MPI allows
    a thread, else None."""
    global _THREAD, _MODE
    if _MODE is None:
        try:
            mode = progress_mode()
        except ValueError:
            mode = DEFAULT_MODE  # the one-line error is raised where mpicomm.init agrees on settings
        from mpi4py import MPI

        if mode in ("gossip", "thread") and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            mode = "none"
        _MODE = mode
        if mode in ("gossip", "thread"):
            _THREAD = ProgressThread()
            atexit.register(_THREAD.stop)
    return _THREAD if _MODE == "thread" or op in NEIGHBOR_OPS else None


def stop_progress() -> None:
    """End this process's progress thread, if one runs (what its ``atexit`` handler does), before MPI is finalized
    by other means than mpi4py's own exit handler."""
    if _THREAD is not None:
        _THREAD.stop()


class pending:  # noqa: N801 - used like a function: ``token = pending()``
    """The pending non-blocking call ``op`` (e.g. ``"ineighbor_allgather"``): keeps the progress thread polling,
    where the mode has it serve ``op``, until :meth:`done` (idempotent)."""

    __slots__ = ("_thread",)

    def __init__(self, op: str):
        self._thread = _thread(op)
        if self._thread is not None:
            self._thread.begin()

    def done(self) -> None:
        """The call completed: stop counting it."""
        if self._thread is not None:
            self._thread.end()
            self._thread = None

    def __del__(self):
        self.done()

"""World: every process of the job, as the code that starts a job (apps, the command line, ``mpicomm.init``) sees it.

What job set-up needs before any :class:`~mpicomm.comm.Communicator` exists: this rank, the world size, an
agreement on small objects (under the hang guard) and a way to end every rank, so that no module outside
:mod:`mpicomm.comm` touches mpi4py. A Communicator is built from a World; the fail-fast helpers
(:func:`~mpicomm.comm.raise_together`, :func:`~mpicomm.comm.abort_on_exception`) and the node layout
(:func:`~mpicomm.comm.node_layout`) take one.
"""

from __future__ import annotations

from mpi4py import MPI

from .guard import WaitGuard, process_guard

__all__ = ["World", "abort_world", "as_world", "mpi_finalized", "raw_comm", "replace_world", "world"]


def mpi_finalized() -> bool:
    """Whether MPI has been finalised (no MPI call may run any more, e.g. in an exit handler)."""
    return bool(MPI.Is_finalized())


def abort_world(code: int) -> None:
    """``MPI_Abort`` on every process of the job, with exit status ``code``."""
    MPI.COMM_WORLD.Abort(code)


def _guard() -> WaitGuard | None:
    """This process's hang guard (:func:`~mpicomm.comm.guard.process_guard`), or None while a ``MPICOMM_*``
    setting it reads is bad: ``mpicomm.init`` agrees on that very error through :meth:`World.allgather_object`,
    which must still run so that the error is one line on every rank."""
    try:
        guard = process_guard(abort_world)
    except ValueError:
        return None
    guard.rank = MPI.COMM_WORLD.Get_rank()
    return guard


def _guarded(what: str, call):
    """``call()`` as a wait on ``what`` under the process's hang guard (unguarded while its settings are bad)."""
    guard = _guard()
    if guard is None:
        return call()
    with guard.waiting(what):
        return call()


class World:
    """The processes of an mpi4py intracommunicator (default ``MPI.COMM_WORLD``): ``rank``, ``size``, a guarded
    :meth:`allgather_object` and :meth:`abort`. ``comm`` is the mpi4py communicator itself, for those who want it;
    any other attribute is that communicator's, so ``job.world.allreduce(x)``, ``job.world.Barrier()`` or
    ``job.world.Get_rank()`` work as on ``MPI.COMM_WORLD`` (unguarded: mpi4py's own calls).

    ``rank``, ``size`` and ``allgather_object(obj, what)`` are the interface it shares with a Communicator, so
    code that only agrees on small objects (:func:`~mpicomm.comm.raise_together`) takes either.
    """

    def __init__(self, comm=None):
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self._rank, self._size = self.comm.Get_rank(), self.comm.Get_size()

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._rank

    @property
    def size(self) -> int:
        """How many processes the job has."""
        return self._size

    def allgather_object(self, obj, what: str = "allgather"):
        """Collective: ``obj`` from every rank, in rank order (pickled; for small control messages).

        The wait runs under the process's hang guard, as a Communicator's does, naming ``what`` if it outlasts
        the hang timeout; unguarded only while a ``MPICOMM_*`` setting the guard reads is bad (``mpicomm.init``
        reports that error through this very call).
        """
        return _guarded(what, lambda: self.comm.allgather(obj))

    def bcast_object(self, obj, root: int = 0, what: str = "bcast"):
        """Collective: ``root``'s ``obj`` on every rank (pickled; for control messages), under the hang guard."""
        return _guarded(what, lambda: self.comm.bcast(obj, root=root))

    def abort(self, code: int) -> None:
        """End every process of this World with exit status ``code`` (``MPI_Abort``)."""
        self.comm.Abort(code)

    def __getattr__(self, name: str):
        """What World does not define is the mpi4py communicator's (``allreduce``, ``Barrier``, ``bcast``, ...)."""
        if name == "comm":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.comm, name)


_WORLD: World | None = None


def world() -> World:
    """The :class:`World` of every process the launcher started (importing mpi4py initialised MPI)."""
    global _WORLD
    if _WORLD is None:
        _WORLD = World()
    return _WORLD


def replace_world(new: World) -> World:
    """Make ``new`` the process's :func:`world` (the survivors of a lost rank, :mod:`mpicomm.comm.faults`)."""
    global _WORLD
    _WORLD = new
    return new


def as_world(comm):
    """``comm`` as set-up code uses it: a :class:`World` or a Communicator as is, an mpi4py communicator (tests and
    benches pass ``MPI.COMM_WORLD``) wrapped in a World."""
    return comm if hasattr(comm, "allgather_object") else World(comm)


def raw_comm(comm):
    """The mpi4py communicator behind ``comm``: a :class:`World`'s or a Communicator's, or ``comm`` itself."""
    return getattr(comm, "comm", comm)

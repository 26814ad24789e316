"""Surviving a lost rank: MPI's User-Level Failure Mitigation (ULFM) as the training loop uses it.

Under an MPI built with ULFM and launched with it on (Open MPI 5 with ``mpirun --with-ft ulfm``, which
``scripts/ft_run.sh`` does), the death of a rank does not end the job: an MPI call that involved it fails with
``MPI_ERR_PROC_FAILED`` on the ranks that took part, and a communicator that one survivor *revoked* fails every
call on it with ``MPI_ERR_REVOKED``. Elsewhere (MPICH, the default stack) the launcher ends the job.

The protocol, for a job whose ranks step in lockstep:

* every communicator mpicomm creates is :func:`track`-ed, so a survivor that meets a failure revokes them all
  (:meth:`Membership.revoke`) and no rank stays blocked in a collective that can no longer complete;
* each step ends with :meth:`Membership.commit`, an ``MPI_Comm_agree`` over a communicator of its own: it is
  *uniform* (every survivor gets the same answer, or the same failure), so either every survivor has committed
  the step or none has; the state after the last commit is what recovery continues from;
* a survivor that met the failure anywhere but in the commit joins the others' pending agreement with a
  "failed" vote (:meth:`Membership.vote_failed`): every survivor then has made as many agreements;
* :meth:`Membership.shrink` builds the world of the survivors (``MPI_Comm_shrink``) and says which of the
  previous ranks are gone.

A rank's identity across shrinks is its rank in ``MPI_COMM_WORLD`` (:attr:`Membership.origin`).
"""

from __future__ import annotations

import functools
import os
import time

from mpi4py import MPI

from .guard import process_guard
from .world import World, abort_world, raw_comm, replace_world, world

__all__ = ["DETECTION_S", "ENABLE_HINT", "Membership", "RankLost", "available", "is_rank_loss", "track"]

ENABLE_HINT = ("to keep training on the survivors instead, set up the fault-tolerant stack once (scripts/setup_env.sh "
               "--ft) and launch with scripts/ft_run.sh -n N python ... --on-rank-loss continue")
"""What a job that cannot survive a lost rank tells its user."""

DETECTION_S = 5.0
"""Seconds an error waits for MPI to name a failed rank before it counts as an error of its own (Open MPI's
detector told the ranks of one node within milliseconds)."""

_LOSS_CLASSES = tuple(getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                      if hasattr(MPI, name))
_TRACKED: list = []  # every communicator created over the current world: revoked together on a failure


class RankLost(RuntimeError):
    """A rank of the job is gone: raised on every survivor by :meth:`Membership.commit`, or by an MPI call
    (as mpi4py's ``MPI.Exception``, which :func:`is_rank_loss` recognises)."""


@functools.cache
def available() -> bool:
    """Whether this job can survive a lost rank: the MPI library implements ULFM and the launcher turned it on
    (Open MPI 5 launched with ``--with-ft ulfm``, which sets ``OMPI_MCA_mpi_ft_enable=1`` for every rank)."""
    return MPI.Get_library_version().startswith("Open MPI") and os.environ.get("OMPI_MCA_mpi_ft_enable") == "1"


def is_rank_loss(exc: BaseException) -> bool:
    """Whether ``exc`` comes from a lost rank: MPI reporting a failed process or a communicator a survivor revoked,
    or any other error while a rank of the job is known to have failed (Open MPI's neighbour collectives report a
    dead peer as ``MPI_ERR_OTHER``; an object allgather that completed without it failed to unpickle). Always
    False where the job cannot survive one (:func:`available`)."""
    if isinstance(exc, RankLost):
        return True
    if not isinstance(exc, Exception) or not available():
        return False
    if isinstance(exc, MPI.Exception) and exc.Get_error_class() in _LOSS_CLASSES:
        return True
    deadline = time.monotonic() + DETECTION_S
    while not _known_failure(raw_comm(world())):  # the error may come before MPI has heard of the failure
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _known_failure(raw) -> bool:
    """Whether MPI knows of a failed rank of ``raw`` (local: a probe lets its progress engine hear of one first)."""
    try:
        raw.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
        return raw.Get_failed().Get_size() > 0
    except MPI.Exception:
        return True  # the query itself failed: the communicator is broken


def track(raw) -> None:
    """Remember ``raw``, an mpi4py communicator created over the current world, so that a failure revokes it."""
    _TRACKED.append(raw)


def _revoke(raw) -> None:
    """Revoke ``raw``, ignoring that it already was (or is a predefined one that cannot be)."""
    try:
        raw.Revoke()
    except MPI.Exception:
        pass


class Membership:
    """Who is in the job, and the agreements that keep the survivors of a failure in step.

    ``world``: the :class:`~mpicomm.comm.World` the job runs on now. Build it on every rank, collectively.
    """

    def __init__(self, world: World):
        self.world = world
        self._agreement = raw_comm(world).Dup()  # only agreements and the shrink run on it: never revoked
        self._agreement.Set_errhandler(MPI.ERRORS_RETURN)
        self.origin: list[int] = world.comm.allgather(MPI.COMM_WORLD.Get_rank())
        """``origin[r]``: the ``MPI_COMM_WORLD`` rank of the process that is rank ``r`` now."""
        process_guard(abort_world).after_wait = self.check

    def check(self) -> None:
        """Raise :class:`RankLost` if MPI knows of a rank of the current world that failed (local, no message).

        Under ULFM a collective may complete on some ranks although a participant died, with that rank's part
        of the result undefined (an object allgather returned garbage that failed to unpickle): every completed
        wait is checked, so such data goes no further than the step that the commit then discards."""
        if _known_failure(raw_comm(self.world)):
            raise RankLost("a rank of the job has failed")

    def commit(self, ok: bool = True) -> None:
        """Collective, uniform: end a step that every survivor finished (``ok``); raise :class:`RankLost` on every
        survivor when some rank is gone or voted failed, so that none keeps a step the others lost."""
        try:
            agreed = self._agreement.Agree(1 if ok else 0)
        except MPI.Exception as exc:
            if not is_rank_loss(exc):
                raise
            raise RankLost("a rank was lost during the step") from exc
        if not agreed & 1:
            raise RankLost("a rank was lost during the step")

    def revoke(self) -> None:
        """Revoke every communicator over the current world, so that no survivor stays blocked in one."""
        for raw in [raw_comm(self.world), *_TRACKED]:
            _revoke(raw)

    def vote_failed(self) -> None:
        """Join the survivors' pending :meth:`commit` with a failed vote (after a failure met outside it)."""
        try:
            self._agreement.Agree(0)
        except MPI.Exception as exc:
            if not is_rank_loss(exc):
                raise

    def shrink(self) -> tuple[World, list[int]]:
        """Collective over the survivors: the world of the ranks still alive (which becomes the process's world,
        :func:`~mpicomm.comm.world`) and the ``MPI_COMM_WORLD`` ranks of those that are gone."""
        survivors = self._agreement.Shrink()
        survivors.Set_errhandler(MPI.ERRORS_RETURN)
        previous = set(self.origin)
        _TRACKED.clear()
        self.world = replace_world(World(survivors))
        self._agreement = survivors.Dup()
        self._agreement.Set_errhandler(MPI.ERRORS_RETURN)
        self.origin = survivors.allgather(MPI.COMM_WORLD.Get_rank())
        return self.world, sorted(previous - set(self.origin))

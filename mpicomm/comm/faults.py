"""Surviving a lost rank: MPI's User-Level Failure Mitigation (ULFM) as the training loop uses it.

Under an MPI built with ULFM and launched with it on (Open MPI 5 with ``mpirun --with-ft ulfm``, which
``scripts/ft_run.sh`` does), the death of a rank does not end the job: an MPI call that involved it fails with
``MPI_ERR_PROC_FAILED`` on the ranks that took part, and a communicator that one survivor *revoked* fails every
call on it with ``MPI_ERR_REVOKED``. Elsewhere (MPICH, the default stack) the launcher ends the job.

The protocol, for a job whose ranks step in lockstep:

* every communicator mpicomm creates is :func:`track`-ed from its creation on (those built before the
  :class:`Membership` too: a Communicator's graphs, its node and cross communicators, the rounds'), so a survivor
  that meets a failure revokes them all (:meth:`Membership.revoke`) and no rank stays blocked in a collective that
  can no longer complete;
* each step ends with :meth:`Membership.commit`, an ``MPI_Comm_agree`` over a communicator of its own: it is
  *uniform* (every survivor gets the same answer, or the same failure), so either every survivor has committed
  the step or none has; the state after the last commit is what recovery continues from;
* a survivor that met the failure anywhere but in the commit joins the others' pending agreement with a
  "failed" vote (:meth:`Membership.vote_failed`): every survivor then has made as many agreements;
* :meth:`Membership.shrink` builds the world of the survivors (``MPI_Comm_shrink``) and says which of the
  previous ranks are gone. What a world gets on the way (its agreement communicator, an ``MPI_Comm_dup`` of it,
  and the processes' identities, an allgather over it) is validated by an agreement over the new world before
  anything uses it: a rank lost meanwhile makes every survivor shrink again, none keeps a half-built world.

A rank's identity across shrinks is its rank in ``MPI_COMM_WORLD`` (:attr:`Membership.origin`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import socket
import sys
import threading
import time

from mpi4py import MPI

from .guard import process_guard
from .world import World, abort_world, raw_comm, replace_world, world

__all__ = ["DETECTION_S", "ENABLE_HINT", "Membership", "RankLost", "available", "free_tracked", "is_rank_loss", "join",
           "leave", "track", "tracked"]

ENABLE_HINT = ("to keep training on the survivors instead, set up the fault-tolerant stack once (scripts/setup_env.sh "
               "--ft) and launch with scripts/ft_run.sh -n N python ... --on-rank-loss continue")
"""What a job that cannot survive a lost rank tells its user."""

DETECTION_S = 5.0
"""Seconds an error waits for MPI to name a failed rank before it counts as an error of its own (Open MPI's
detector told the ranks of one node within milliseconds)."""

LEAVE_S = 5.0
"""Seconds a rank of a job that grew gives ``MPI_Finalize`` before it exits without it (:func:`leave`)."""

_LOSS_CLASSES = tuple(getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                      if hasattr(MPI, name))
_TRACKED: list = []  # every communicator mpicomm created over the current world: revoked together on a failure


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
    return isinstance(exc, RankLost) or _lost_on(raw_comm(world()), exc)


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


def tracked() -> list:
    """The communicators mpicomm created over the current world and has not freed, in creation order (a copy)."""
    return list(_TRACKED)


def free_tracked(comms: list) -> None:
    """Collective over each of ``comms`` (from :func:`tracked`, in the same order on every rank): free them and
    forget them. MPI frees no communicator on its own, and MPICH holds at most 2048 per process: a process that
    builds Communicators again and again (a test session) frees those it is done with."""
    done = {id(raw) for raw in comms}
    _TRACKED[:] = [raw for raw in _TRACKED if id(raw) not in done]
    for raw in comms:
        try:
            raw.Free()
        except MPI.Exception:
            pass  # freed already, or revoked after a failure


def _revoke(raw) -> None:
    """Revoke ``raw``, ignoring that it already was (or is a predefined one that cannot be, or was freed)."""
    if raw == MPI.COMM_NULL:
        return
    try:
        raw.Revoke()
    except MPI.Exception:
        pass


def _lost_on(raw, exc: BaseException) -> bool:
    """Whether ``exc``, met in a call on ``raw``, comes from a lost rank: MPI says so, or (an object that failed to
    unpickle, an error of another class) MPI knows of a failed rank of ``raw`` within :data:`DETECTION_S`."""
    if not isinstance(exc, Exception) or not available():
        return False
    if isinstance(exc, MPI.Exception) and exc.Get_error_class() in _LOSS_CLASSES:
        return True
    deadline = time.monotonic() + DETECTION_S
    while not _known_failure(raw):  # the error may come before MPI has heard of the failure
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Membership:
    """Who is in the job, and the agreements that keep the survivors of a failure in step.

    ``world``: the :class:`~mpicomm.comm.World` the job runs on now. Build it on every rank, collectively.
    """

    def __init__(self, world: World):
        self.changed = False  # the job lost a rank or grew since it started (see :func:`leave`)
        self._agreement = None
        self.origin: list[str] = []
        """``origin[r]``: the process that is rank ``r`` now (host and pid)."""
        if not self._adopt(world):
            raise RankLost("a rank was lost while the job set up its recovery")

    def _adopt(self, world: World, replacing: bool = False) -> bool:
        """Collective over ``world``: make it the process's world, with an agreement communicator of its own; False
        (on every rank of ``world``, and nothing adopted) if a rank was lost meanwhile.

        The agreement communicator (a ``Dup`` of ``world``) and the processes' identities (an allgather over
        ``world``) are made, then validated by ``MPI_Comm_agree`` over ``world`` before either is used: the agreement
        is uniform, so either every rank has both and keeps them, or every rank drops what it got (a rank that met
        the loss revokes ``world`` first, so that none stays blocked in the call it left). ``replacing``: ``world``
        succeeds the current one (a shrink, a grow), whose communicators, all revoked, are forgotten once it is
        adopted; the first world keeps the communicators tracked before it (those of the run set up before recovery
        was)."""
        raw = raw_comm(world)
        guard = process_guard(abort_world)
        agreement, origin, ok = None, None, True
        try:
            with guard.waiting("setting up the survivors' agreements", checked=False):
                agreement = raw.Dup()  # only agreements, the shrink and the spawn run on it: never revoked
                agreement.Set_errhandler(MPI.ERRORS_RETURN)
                origin = raw.allgather(f"{socket.gethostname()}:{os.getpid()}")
        except Exception as exc:
            if not _lost_on(raw, exc):
                raise
            ok = False
            _revoke(raw)  # no rank stays blocked in what this one left
        try:
            with guard.waiting("validating the survivors' agreements", checked=False):
                ok = bool(raw.Agree(1 if ok else 0) & 1)
        except MPI.Exception as exc:
            if not _lost_on(raw, exc):
                raise
            ok = False
        if not ok:
            if agreement is not None:
                _revoke(agreement)
            return False
        if replacing:
            _TRACKED.clear()  # the previous world's communicators: revoked, never used again
        self.world = replace_world(world)
        self._agreement, self.origin = agreement, origin
        self._guard = guard
        self._guard.after_wait, self._guard.leave_when_stalled = self.check, True
        return True

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
            with self._guard.waiting("the step's commit", checked=False):
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
            with self._guard.waiting("the vote after a lost rank", checked=False):
                self._agreement.Agree(0)
        except MPI.Exception as exc:
            if not is_rank_loss(exc):
                raise

    def shrink(self) -> tuple[World, list[int]]:
        """Collective over the survivors: the world of the ranks still alive (which becomes the process's world,
        :func:`~mpicomm.comm.world`) and the ranks, in the world before, of those that are gone. A rank lost while
        the new world is set up: every survivor shrinks again (:meth:`_adopt` fails on all of them alike)."""
        before, comm = self.origin, self._agreement
        while True:
            with self._guard.waiting("the shrink to the survivors", checked=False):
                survivors = comm.Shrink()
            survivors.Set_errhandler(MPI.ERRORS_RETURN)
            if self._adopt(World(survivors), replacing=True):
                break
            comm = survivors
        self.changed = True
        return self.world, [rank for rank, process in enumerate(before) if process not in self.origin]

    def grow(self, count: int, command: list[str]) -> World:
        """Collective over the survivors: start ``count`` replacement processes running ``command`` (``MPI_Comm_spawn``;
        each calls :func:`join`) and make the world of survivors and replacements, the replacements last."""
        with self._guard.waiting("starting the replacements", checked=False):
            spawned = self._agreement.Spawn(command[0], args=command[1:], maxprocs=count, root=0)
            merged = spawned.Merge(high=False)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        if not self._adopt(World(merged), replacing=True):  # the survivors recover again (the replacements end)
            raise RankLost("a rank was lost while the replacements joined")
        return self.world


def join() -> Membership | None:
    """In a process that survivors started to replace a lost rank (:meth:`Membership.grow`): join their world and
    return its Membership (collective with their ``grow``); None in a process the launcher started."""
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        return None
    merged = parent.Merge(high=True)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    membership = Membership(World(merged))
    membership.changed = True
    return membership


def leave(membership: Membership | None, code: int) -> None:
    """Finalize MPI in a job that lost a rank (:meth:`Membership.shrink`) or grew (:meth:`Membership.grow`); return at
    once in one that did neither.

    Open MPI 5.0's ``MPI_Finalize`` (collective over every process a job connected to) hung in about 1 of 5 jobs
    where survivors had spawned and merged a replacement (``MPI_Comm_disconnect`` before it always did), and in
    one job that had only shrunk: every rank meets in a barrier and finalizes at once, and a rank whose finalize
    has not returned :data:`LEAVE_S` later exits with ``code`` without it."""
    if membership is None or not membership.changed:
        return
    try:
        raw_comm(membership.world).Barrier()
    except MPI.Exception:
        pass  # a rank lost at the very end: nothing left to wait for
    sys.stdout.flush()
    sys.stderr.flush()
    watchdog = threading.Timer(LEAVE_S, os._exit, (code,))
    watchdog.daemon = True
    watchdog.start()
    finalize_releasing_gil()
    watchdog.cancel()


def finalize_releasing_gil() -> None:
    """``MPI_Finalize`` called through ctypes, which releases the GIL: mpi4py's ``Finalize`` holds it, and a hung
    one then kept the watchdog thread of :func:`leave` from ever running. mpi4py sees MPI finalized afterwards."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "/libmpi.so" in line), None)
    except OSError:
        path = None
    if path is None:
        MPI.Finalize()
    else:
        ctypes.CDLL(path).MPI_Finalize()

"""Collectives: how a Communicator runs, books and prices one MPI call, and its collectives over all its ranks.

:class:`Collectives` is the base class of :class:`~mpicomm.comm.Communicator`, which sets the attributes it
reads (the mpi4py ``comm``, ``rank``, ``size``, ``ledger``, ``router``, ``clock``, ``guard``, ``link``) and adds
the neighbour collectives over its graph. Here: the template every call follows (route the buffers, book the
bytes, price and time the call, watch the wait), the centralized collectives (allreduce, allgather, alltoall,
alltoallv, reduce-scatter, allgatherv, broadcast, barrier) and the control plane (small pickled objects).

The fast path: a blocking allreduce, allgather, reduce-scatter, neighbour allgather or neighbour alltoallv of CPU
tensors that MPI reads in place (not staged) runs from a :class:`_Plan` made by the first call of its shape
(operation, graph step, shape, dtype, device, counts) and cached: the Ledger entry, the priced cost, the MPI
datatype, the cached receive buffer and its spec are fixed, so a call only books, takes the send buffer's
address and makes the MPI call, under the same guard and clock as the general path. Every other call (staged
or non-blocking, or the first call's errors) takes the general path. Measured: docs/results/transport.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager
from functools import partial

import torch
from mpi4py import MPI

from ..ledger import ANY, Ledger
from ..net import CostModel, NetClock, NetLinks, NetSpec
from .buffers import MPI_TYPES, BufferRouter, as_bytes, mpi_typed
from .guard import WaitGuard
from .handle import Handle, byte_specs, displacements

__all__ = ["Collectives"]

_REDUCE_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "bor": MPI.BOR}
_BYTE, _IN_PLACE = MPI.BYTE, MPI.IN_PLACE
_address = MPI.buffer.fromaddress
"""``_address(tensor.data_ptr(), nbytes)``: a CPU tensor's bytes as an MPI buffer, without a numpy view (a fifth of
its cost); it holds no reference, so only blocking calls, whose caller holds the tensor throughout, use it."""
_MISSING = object()


class _Plan:
    """The fixed part of a blocking collective on one (shape, dtype, device) of CPU tensors MPI takes directly,
    made by its first call and reused by the next: the Ledger entry to book, the priced cost, the MPI datatype
    and operation, the receive buffer with its MPI spec (cached buffers), and the bound MPI call (graphs).

    With it, a call computes only the send buffer's address: no routing, specs, closures or booking arithmetic.
    """

    __slots__ = ("op", "nbytes", "book", "priced", "mpi_type", "mpi_op", "shape", "rbytes", "out", "rspec", "call",
                 "counts", "views")

    def __init__(self, op: str, nbytes: int, book, priced, *, mpi_type=_BYTE, mpi_op=None, shape=None, rbytes=0,
                 call=None, counts=None):
        self.op, self.nbytes, self.book, self.priced = op, nbytes, book, priced
        self.mpi_type, self.mpi_op, self.call, self.counts = mpi_type, mpi_op, call, counts
        self.shape, self.rbytes = shape, rbytes  # of the receive buffer
        self.out = self.rspec = None  # the cached receive buffer and its spec, made by the first call without out=
        self.views = None  # neighbour alltoallv: the received parts (views of ``out``)


class Collectives:
    """The calls over all of a Communicator's ranks, and the machinery every call of it runs through."""

    comm: MPI.Intracomm
    rank: int
    size: int
    ledger: Ledger
    router: BufferRouter
    net: NetSpec | NetLinks | None
    clock: NetClock
    guard: WaitGuard
    link: str
    _peer_ranks: tuple[int, ...] | None
    _recv: dict[tuple, torch.Tensor]

    # ------------------------------------------------------------------ how one call runs
    def _peer(self, p: int) -> int:
        """Rank ``p`` of this Communicator as the rank the Ledger books (its root Communicator's)."""
        return p if self._peer_ranks is None or p == ANY else self._peer_ranks[p]

    def _book(self, op: str, nbytes: int, sends: dict[int, int], recvs: dict[int, int]) -> None:
        """Book one call in the Ledger on this Communicator's link class, peers as the root's ranks."""
        if self._peer_ranks is not None:
            sends = {self._peer(p): n for p, n in sends.items()}
            recvs = {self._peer(p): n for p, n in recvs.items()}
        self.ledger.record(op, nbytes, sends, recvs, link=self.link)

    def _priced(self, cost):
        """``cost`` on this Communicator's link class (the clock hands it the model of every class)."""
        link = self.link
        return lambda model: cost(model.on(link))

    @contextmanager
    def unmetered(self):
        """Calls inside are neither booked in the Ledger nor charged by the network model (monitoring)."""
        with self.ledger.paused(), self.clock.paused():
            yield

    def _recv_buffer(self, op: str, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        key = (op, shape, like.dtype, like.device)
        buf = self._recv.get(key)
        if buf is None:
            buf = torch.empty(shape, dtype=like.dtype, device=like.device)
            self._recv[key] = buf
        return buf

    @staticmethod
    def _check_out(out: torch.Tensor, shape: tuple, like: torch.Tensor, op: str) -> None:
        if tuple(out.shape) != shape or out.dtype != like.dtype or out.device != like.device:
            raise ValueError(
                f"{op}: out must have shape {shape}, dtype {like.dtype} on {like.device}; "
                f"got shape {tuple(out.shape)}, dtype {out.dtype} on {out.device}"
            )

    def _collective(self, op: str, send, out, blocking: bool, cost, specs, call, icall):
        """The template of a collective from ``send`` into ``out``: route both through host buffers where MPI
        cannot take them, run ``call(*specs(sbuf, rbuf))`` (or start ``icall``, returning a :class:`Handle`),
        land the result in ``out`` and return it."""
        sbuf = self.router.outbound(op, send, hold=not blocking)
        rbuf, land = self.router.inbound(op, out, hold=not blocking)
        args = specs(sbuf, rbuf)

        def finish():
            land()
            self.router.release(sbuf)
            return out

        if blocking:
            self._run(op, cost, lambda: call(*args))
            return finish()
        return self._handle(icall(*args), finish, cost, "i" + op)

    def _handle(self, request, finish, cost, op: str) -> Handle:
        """A :class:`Handle` whose modelled transfer is queued on the link now."""
        return Handle(request, finish, self.clock, self.clock.post(self._priced(cost)), self.guard, op)

    def _run(self, op: str, cost, call):
        """A blocking MPI call: timed and charged by the clock, watched by the hang guard."""
        with self.guard.waiting(op):
            return self.clock.run(self._priced(cost), call)

    # ------------------------------------------------------------------ the fast path: a cached plan per call shape
    def _direct(self, t: torch.Tensor) -> bool:
        """Whether a blocking call on ``t`` may take the fast path: a CPU tensor that MPI reads in place."""
        return t.device.type == "cpu" and not self.router.stages(t)

    def _plan_for(self, key: tuple, make, *args) -> _Plan | None:
        """The plan cached under ``key``, ``make(*args)`` the first time (None, also cached: this call shape takes
        the general path)."""
        plan = self._plans.get(key, _MISSING)
        if plan is _MISSING:
            plan = self._plans[key] = make(*args)
        return plan

    def _new_plan(self, op: str, nbytes: int, sends: dict[int, int], recvs: dict[int, int], cost, **kw) -> _Plan:
        """A plan that books ``sends``/``recvs`` (this Communicator's ranks) as :meth:`_book` does."""
        if self._peer_ranks is not None:
            sends = {self._peer(p): n for p, n in sends.items()}
            recvs = {self._peer(p): n for p, n in recvs.items()}
        link = self.link
        return _Plan(op, nbytes, lambda ledger: ledger.record(op, nbytes, sends, recvs, link), self._priced(cost),
                     **kw)

    def _fast(self, plan: _Plan, call, *args) -> None:
        """Book ``plan``'s call and run ``call(*args)`` as :meth:`_run` does: timed and (with a network model)
        charged by the clock, watched by the hang guard."""
        plan.book(self.ledger)
        with self.guard.waiting(plan.op):
            self.clock.run(plan.priced, partial(call, *args))

    # ------------------------------------------------------------------ centralized collectives
    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place allreduce of ``t`` (``op`` in sum/max/min, or bor: the bitwise or of integers); returns ``t``."""
        plan = self._plan_for(("allreduce", t.shape, t.dtype, t.device, op), self._allreduce_plan, t, op)
        if plan is None or not t.is_contiguous():
            return self._allreduce(t, op, blocking=True)
        self._fast(plan, self.comm.Allreduce, _IN_PLACE, [_address(t.data_ptr(), plan.nbytes), plan.mpi_type],
                   plan.mpi_op)
        return t

    def _allreduce_plan(self, t: torch.Tensor, op: str) -> _Plan | None:
        if op not in _REDUCE_OPS or t.dtype not in MPI_TYPES or not self._direct(t):
            return None
        nbytes, size = t.numel() * t.element_size(), self.size
        volume = 2 * (size - 1) * nbytes // size
        peers = {ANY: volume} if size > 1 else {}
        return self._new_plan("allreduce", nbytes, peers, peers, lambda model: model.allreduce(nbytes, size),
                              mpi_type=MPI_TYPES[t.dtype], mpi_op=_REDUCE_OPS[op])

    def iallreduce(self, t: torch.Tensor, op: str = "sum") -> Handle:
        """Non-blocking in-place allreduce; ``wait()`` returns ``t``."""
        return self._allreduce(t, op, blocking=False)

    def _allreduce(self, t, op, blocking):
        if op not in _REDUCE_OPS:
            raise ValueError(f"allreduce: op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
        buf, land = self.router.inbound("allreduce", t, hold=not blocking)
        if buf is not t:
            buf.copy_(t)
        nbytes = t.numel() * t.element_size()
        volume = 2 * (self.size - 1) * nbytes // self.size
        peers = {ANY: volume} if self.size > 1 else {}
        self._book("allreduce", nbytes, peers, peers)

        def cost(model: CostModel) -> float:
            return model.allreduce(nbytes, self.size)

        def finish():
            land()
            return t

        if blocking:
            self._run("allreduce", cost, lambda: self.comm.Allreduce(MPI.IN_PLACE, mpi_typed(buf), _REDUCE_OPS[op]))
            return finish()
        return self._handle(self.comm.Iallreduce(MPI.IN_PLACE, mpi_typed(buf), _REDUCE_OPS[op]), finish, cost,
                            "iallreduce")

    def allgather(self, send: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Gather ``send`` from every rank; returns ``(size, *send.shape)`` in rank order."""
        plan = self._plan_for(("allgather", send.shape, send.dtype, send.device), self._allgather_plan, send)
        if plan is None or not send.is_contiguous():
            return self._allgather(send, out, blocking=True)
        rspec = plan.rspec if out is None and plan.rspec is not None else self._receive_spec(plan, out, send)
        if rspec is None:
            return self._allgather(send, out, blocking=True)
        self._fast(plan, self.comm.Allgather, [_address(send.data_ptr(), plan.nbytes), _BYTE], rspec)
        return plan.out if out is None else out

    def _allgather_plan(self, send: torch.Tensor) -> _Plan | None:
        if not self._direct(send):
            return None
        nbytes, size = send.numel() * send.element_size(), self.size
        others = {p: nbytes for p in range(size) if p != self.rank}
        return self._new_plan("allgather", nbytes, others, others, lambda model: model.allgather(nbytes, size),
                              shape=(size, *send.shape), rbytes=size * nbytes)

    def _receive_spec(self, plan: _Plan, out: torch.Tensor | None, like: torch.Tensor):
        """The MPI spec of the buffer ``plan``'s call writes into: the caller's ``out`` (checked as the general path
        checks it, raising the same error; None if it is not contiguous, which the general path refuses), or else
        the cached receive buffer, allocated by the first call without ``out=`` (never for callers that own theirs)."""
        if out is None:
            if plan.out is None:
                plan.out = self._recv_buffer(plan.op, plan.shape, like)
                plan.rspec = [as_bytes(plan.out)[0], plan.mpi_type]
            return plan.rspec
        if out is not plan.out:
            self._check_out(out, plan.shape, like, plan.op)
            if not out.is_contiguous():
                return None
        return [_address(out.data_ptr(), plan.rbytes), plan.mpi_type]

    def iallgather(self, send: torch.Tensor, out: torch.Tensor | None = None) -> Handle:
        """Non-blocking :meth:`allgather`."""
        return self._allgather(send, out, blocking=False)

    def _allgather(self, send, out, blocking):
        shape = (self.size, *send.shape)
        if out is None:
            out = self._recv_buffer("allgather", shape, send)
        self._check_out(out, shape, send, "allgather")
        nbytes = send.numel() * send.element_size()
        others = {p: nbytes for p in range(self.size) if p != self.rank}
        self._book("allgather", nbytes, others, others)

        def cost(model: CostModel) -> float:
            return model.allgather(nbytes, self.size)

        return self._collective("allgather", send, out, blocking, cost, byte_specs, self.comm.Allgather,
                                self.comm.Iallgather)

    def alltoall(self, send: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Send chunk k of ``send`` (split evenly along dim 0) to rank k; returns the chunks received, in rank order."""
        return self._alltoall(send, out, blocking=True)

    def ialltoall(self, send: torch.Tensor, out: torch.Tensor | None = None) -> Handle:
        """Non-blocking :meth:`alltoall`."""
        return self._alltoall(send, out, blocking=False)

    def _alltoall(self, send, out, blocking):
        if send.dim() == 0 or send.shape[0] % self.size:
            raise ValueError(
                f"alltoall: dim 0 of send (shape {tuple(send.shape)}) must be a multiple of the "
                f"{self.size} ranks; pad it first"
            )
        shape = tuple(send.shape)
        if out is None:
            out = self._recv_buffer("alltoall", shape, send)
        self._check_out(out, shape, send, "alltoall")
        chunk = send.numel() * send.element_size() // self.size
        others = {p: chunk for p in range(self.size) if p != self.rank}
        total = send.numel() * send.element_size()
        self._book("alltoall", total, others, others)

        def cost(model: CostModel) -> float:
            return model.alltoall(total, self.size)

        return self._collective("alltoall", send, out, blocking, cost, byte_specs, self.comm.Alltoall,
                                self.comm.Ialltoall)

    def ialltoallv(self, send: torch.Tensor, send_counts: Sequence[int], send_displs: Sequence[int],
                   out: torch.Tensor, recv_counts: Sequence[int]) -> Handle:
        """Non-blocking all-to-all of unequal parts of 1-D tensors: ``send_counts[k]`` elements from offset
        ``send_displs[k]`` of ``send`` go to rank k (parts may overlap: one part sent to every rank), and
        ``recv_counts[j]`` elements from rank j land in ``out``, packed in rank order. ``wait()`` returns ``out``.

        The Ledger books ``send``'s bytes as contributed once and each non-empty part to or from another rank;
        the network model prices one message per peer with traffic (:meth:`~mpicomm.net.CostModel.alltoallv`).
        """
        n = self.size
        if not (len(send_counts) == len(send_displs) == len(recv_counts) == n):
            raise ValueError(f"ialltoallv: need {n} send counts, send displacements and receive counts, got "
                             f"{len(send_counts)}, {len(send_displs)} and {len(recv_counts)}")
        if out.numel() != sum(recv_counts) or send.dim() != 1 or out.dim() != 1 or out.dtype != send.dtype:
            raise ValueError(f"ialltoallv: send and out must be 1-D of one dtype and out must hold the "
                             f"{sum(recv_counts)} elements received, got {tuple(send.shape)} {send.dtype} and "
                             f"{tuple(out.shape)} {out.dtype}")
        size = send.element_size()
        sends = {p: int(c) * size for p, c in enumerate(send_counts) if c and p != self.rank}
        recvs = {p: int(c) * size for p, c in enumerate(recv_counts) if c and p != self.rank}
        self._book("alltoallv", send.numel() * size, sends, recvs)
        out_bytes, in_bytes, peers = sum(sends.values()), sum(recvs.values()), max(len(sends), len(recvs))

        def cost(model: CostModel) -> float:
            return model.alltoallv(out_bytes, in_bytes, peers)

        def specs(sbuf, rbuf):
            return ([as_bytes(sbuf)[0], [int(c) * size for c in send_counts], [int(d) * size for d in send_displs],
                     MPI.BYTE],
                    [as_bytes(rbuf)[0], [int(c) * size for c in recv_counts],
                     [d * size for d in displacements(recv_counts)], MPI.BYTE])

        return self._collective("alltoallv", send, out, False, cost, specs, None, self.comm.Ialltoallv)

    def reduce_scatter(self, send: torch.Tensor, counts: Sequence[int], out: torch.Tensor | None = None):
        """Sum ``send`` (1-D) over all ranks and keep part ``rank`` of it: ``counts[r]`` elements for rank r, in
        rank order (``sum(counts) == send.numel()``); returns the ``(counts[rank],)`` part (in ``out`` if given).

        Booked as the pairwise exchange does it: each other rank's part is sent to it once.
        """
        counts = tuple(map(int, counts))
        plan = self._plan_for(("reduce_scatter", send.shape, send.dtype, send.device, counts),
                              self._reduce_scatter_plan, send, counts)
        if plan is None or not send.is_contiguous():
            return self._reduce_scatter(send, counts, out)
        rspec = plan.rspec if out is None and plan.rspec is not None else self._receive_spec(plan, out, send)
        if rspec is None:
            return self._reduce_scatter(send, counts, out)
        self._fast(plan, self.comm.Reduce_scatter, [_address(send.data_ptr(), plan.nbytes), plan.mpi_type], rspec,
                   plan.counts, MPI.SUM)
        return plan.out if out is None else out

    def _reduce_scatter_plan(self, send: torch.Tensor, counts: tuple[int, ...]) -> _Plan | None:
        if (send.dim() != 1 or len(counts) != self.size or sum(counts) != send.numel() or send.dtype not in MPI_TYPES
                or not self._direct(send)):
            return None  # the general path raises, or stages
        size, n = send.element_size(), self.size
        nbytes = send.numel() * size
        return self._new_plan("reduce_scatter", nbytes,
                              {p: counts[p] * size for p in range(n) if p != self.rank},
                              {p: counts[self.rank] * size for p in range(n) if p != self.rank},
                              lambda model: model.reduce_scatter(nbytes, n), mpi_type=MPI_TYPES[send.dtype],
                              shape=(counts[self.rank],), rbytes=counts[self.rank] * size, counts=list(counts))

    def _reduce_scatter(self, send: torch.Tensor, counts: Sequence[int], out: torch.Tensor | None):
        """:meth:`reduce_scatter`'s general path (staged buffers, errors)."""
        counts = [int(c) for c in counts]
        if send.dim() != 1 or len(counts) != self.size or sum(counts) != send.numel():
            raise ValueError(f"reduce_scatter: send must be 1-D with sum(counts) elements and counts one per rank; "
                             f"got shape {tuple(send.shape)} and {len(counts)} counts summing to {sum(counts)}")
        shape = (counts[self.rank],)
        if out is None:
            out = self._recv_buffer("reduce_scatter", shape, send)
        self._check_out(out, shape, send, "reduce_scatter")
        size = send.element_size()
        self._book("reduce_scatter", send.numel() * size,
                   {p: counts[p] * size for p in range(self.size) if p != self.rank},
                   {p: counts[self.rank] * size for p in range(self.size) if p != self.rank})
        sbuf = self.router.outbound("reduce_scatter", send)
        rbuf, land = self.router.inbound("reduce_scatter", out)
        self._run("reduce_scatter", lambda model: model.reduce_scatter(send.numel() * size, self.size),
                  lambda: self.comm.Reduce_scatter(mpi_typed(sbuf), mpi_typed(rbuf), counts, MPI.SUM))
        land()
        self.router.release(sbuf)
        return out

    def allgatherv_(self, t: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """In place: every rank's part of the 1-D ``t`` (``counts[r]`` elements for rank r, in rank order) to
        every rank; this rank's part must already be in place. Returns ``t``."""
        counts = [int(c) for c in counts]
        if t.dim() != 1 or len(counts) != self.size or sum(counts) != t.numel():
            raise ValueError(f"allgatherv_: t must be 1-D with sum(counts) elements and counts one per rank; "
                             f"got shape {tuple(t.shape)} and {len(counts)} counts summing to {sum(counts)}")
        buf, land = self.router.inbound("allgatherv", t)
        if buf is not t:
            buf.copy_(t)
        size = t.element_size()
        mine = counts[self.rank] * size
        self._book("allgatherv", mine, {p: mine for p in range(self.size) if p != self.rank},
                   {p: counts[p] * size for p in range(self.size) if p != self.rank})
        spec = mpi_typed(buf)
        self._run("allgatherv", lambda model: model.allgatherv(max(counts) * size, self.size),
                  lambda: self.comm.Allgatherv(MPI.IN_PLACE, [spec[0], counts, displacements(counts), spec[1]]))
        land()
        return t

    def allgather_(self, t: torch.Tensor) -> torch.Tensor:
        """In place: rank r's part of the 1-D ``t`` (``t.numel() / size`` elements from ``r * that``, already in
        place) to every rank; returns ``t``. ``MPI_Allgather`` of equal parts: where the parts are equal but for
        padding, it avoids ``MPI_Allgatherv``, whose default algorithm in MPICH stalled for seconds on large
        vectors when ranks outnumbered free cores."""
        if t.dim() != 1 or t.numel() % self.size:
            raise ValueError(f"allgather_: t must be 1-D with a multiple of the {self.size} ranks' elements, got "
                             f"shape {tuple(t.shape)}")
        buf, land = self.router.inbound("allgather", t)
        if buf is not t:
            buf.copy_(t)
        part = t.numel() // self.size * t.element_size()
        others = {p: part for p in range(self.size) if p != self.rank}
        self._book("allgather", part, others, others)
        spec = mpi_typed(buf)
        self._run("allgather", lambda model: model.allgather(part, self.size),
                  lambda: self.comm.Allgather(MPI.IN_PLACE, [spec[0], t.numel() // self.size, spec[1]]))
        land()
        return t

    def bcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        """In-place broadcast of ``t`` from ``root``; returns ``t``."""
        buf, land = self.router.inbound("bcast", t)
        if buf is not t and self.rank == root:
            buf.copy_(t)
        nbytes = t.numel() * t.element_size()
        if self.rank == root:
            self._book("bcast", nbytes, {p: nbytes for p in range(self.size) if p != root}, {})
        else:
            self._book("bcast", 0, {}, {root: nbytes})
        self._run("bcast", lambda model: model.bcast(nbytes, self.size),
                  lambda: self.comm.Bcast(as_bytes(buf), root=root))
        land()
        return t

    def barrier(self) -> None:
        """Block until every rank arrives."""
        self._run("barrier", lambda model: model.barrier(self.size), self.comm.Barrier)

    # ------------------------------------------------------------------ the control plane
    # Small Python objects the ranks agree on (stop, divergence, errors, log lines): not booked in the
    # Ledger nor charged by the network model (they are not the algorithm's traffic), but watched.
    def allgather_object(self, obj, what: str = "allgather"):
        """Collective: ``obj`` from every rank, in rank order (pickled; for small control messages)."""
        with self.guard.waiting(what):
            return self.comm.allgather(obj)

    def bcast_object(self, obj, root: int = 0, what: str = "bcast"):
        """Collective: ``root``'s ``obj`` on every rank (pickled; for small control messages)."""
        with self.guard.waiting(what):
            return self.comm.bcast(obj, root=root)

    def sleeping_barrier(self, poll_s: float = 0.05) -> None:
        """Collective: block until every rank arrives, sleeping ``poll_s`` between tests of a non-blocking
        barrier instead of spinning, so that waiting ranks leave their cores to one that works meanwhile.

        Not booked nor charged (it is not the algorithm's traffic), and not under the hang guard: the rank
        waited on may legitimately work for minutes (rank 0 compiling the codec kernels).
        """
        request = self.comm.Ibarrier()
        while not request.Test():
            time.sleep(poll_s)


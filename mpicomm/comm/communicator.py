"""Communicator: neighbour collectives over a graph topology, plus the centralized collectives.

Built once from an mpi4py intracommunicator and a :class:`~mpicomm.topology.Topology` (or a
time-varying :class:`~mpicomm.topology.Schedule`). For every distinct topology of the schedule it
creates one distributed-graph communicator (``Create_dist_graph_adjacent``, no reordering) at
construction, so a time-varying schedule costs nothing per step. Receive buffers are cached per
(operation, shape, dtype, device) and reused: a returned receive tensor stays valid until the next
call of the same operation with the same shape, unless the caller passes ``out=``.

Every call books its bytes in the :class:`~mpicomm.ledger.Ledger` and goes through a
:class:`~mpicomm.net.NetClock`, which times it and, given a network setting (``net="1gbit,100us"``),
adds the alpha-beta model's cost of the operation on top of the real transfer (see
:mod:`mpicomm.net.model` for each collective's formula).

:meth:`Communicator.node_layout` (built once, on first use) splits the ranks by node for the two-level
collectives: a Communicator of this rank's node, priced and booked on the ``intra`` link class, and one
of the ranks holding the same local rank on every node, on ``inter`` (:mod:`mpicomm.comm.nodes`). Every
call of the Communicator itself is priced and booked on ``inter``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager

import torch
from mpi4py import MPI

from ..ledger import ANY, Ledger
from ..net import CostModel, NetClock, NetLinks, NetSpec, parse_net
from .buffers import BufferRouter, as_bytes, mpi_typed, query_cuda_aware
from .guard import WaitGuard, process_guard
from .nodes import NodeLayout, ranks_per_node_setting, shared_memory_spans_nodes

__all__ = ["Communicator", "Handle"]

_REDUCE_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def _abort_world(code: int) -> None:
    MPI.COMM_WORLD.Abort(code)


class Handle:
    """A pending non-blocking operation; ``wait()`` completes it and returns its result."""

    def __init__(self, request, finish, clock: NetClock, deadline: float, guard: WaitGuard, op: str):
        self._request = request
        self._finish = finish
        self._clock = clock
        self._deadline = deadline
        self._guard, self._op = guard, op
        self._result = None
        self._done = False

    def test(self) -> bool:
        """True when the operation (and its modelled transfer, if any) has completed, without blocking."""
        return self._done or (bool(self._request.Test()) and self._clock.passed(self._deadline))

    def wait(self):
        """Block until complete; return the received tensor (idempotent)."""
        if not self._done:
            with self._guard.waiting(f"the wait for {self._op}"):
                self._clock.complete(self._deadline, self._request.Wait)
            self._result = self._finish()
            self._done = True
        return self._result


class Communicator:
    """The one object through which mpicomm talks MPI.

    Parameters
    ----------
    comm: an mpi4py intracommunicator (e.g. ``MPI.COMM_WORLD``); passed in, never fetched globally.
    topology: a ``Topology`` or ``Schedule`` whose size equals ``comm``'s size.
    ledger: where traffic is booked (a fresh one per communicator by default).
    cuda_aware: whether MPI takes device pointers; ``None`` probes the library (see ``query_cuda_aware``).
    stage: ``"auto"``, ``"always"`` or ``"never"``; see :class:`~mpicomm.comm.buffers.BufferRouter`.
    net: a network setting to model on top of the real transfers: a ``--net`` string such as
        ``"1gbit,100us"`` or ``"intra=nvlink,inter=10gbit,5us"``, a :class:`~mpicomm.net.NetSpec` or
        :class:`~mpicomm.net.NetLinks`, or None (no model; calls are still timed).
    ranks_per_node: emulate nodes of this many consecutive ranks (default: ``$MPICOMM_RANKS_PER_NODE``,
        else the real nodes, ranks that share memory); see :meth:`node_layout`.

    Every blocking call runs under the process's :class:`~mpicomm.comm.guard.WaitGuard` (``guard``): a
    wait that outlasts its hang timeout ends the job with one line instead of hanging it.
    """

    def __init__(self, comm, topology, *, ledger: Ledger | None = None, cuda_aware: bool | None = None,
                 stage: str = "auto", net: str | NetSpec | NetLinks | None = None,
                 ranks_per_node: int | None = None):
        if topology.size != comm.Get_size():
            # Topology and world size are the same on every rank, so every rank raises this together.
            raise ValueError(
                f"topology {topology.name!r} has {topology.size} ranks but the MPI communicator has "
                f"{comm.Get_size()}; build the topology with n = comm.Get_size()"
            )
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.schedule = topology
        self.ledger = ledger if ledger is not None else Ledger(self.rank)
        self.router = BufferRouter(query_cuda_aware() if cuda_aware is None else cuda_aware, stage)
        self.net = net if isinstance(net, (NetSpec, NetLinks)) else parse_net(net)
        self.clock = NetClock(CostModel(self.net) if self.net is not None else None)
        self.guard = process_guard(_abort_world)
        self.guard.rank = MPI.COMM_WORLD.Get_rank()
        self.link = "inter"  # the link class this Communicator's calls are priced and booked on
        self._peer_ranks: tuple[int, ...] | None = None  # a child's ranks as its parent's (None: itself)
        self.ranks_per_node = ranks_per_node_setting(ranks_per_node)
        self._layout: NodeLayout | None = None
        self._spans: bool | None = None  # spans_nodes(), once known
        self._recv: dict[tuple, torch.Tensor] = {}
        self._recv_specs: dict[tuple, list] = {}  # the MPI buffer spec of each cached receive buffer, made once
        self._adopt(topology)

    def _adopt(self, topology) -> None:
        """Collective: one distributed-graph communicator per distinct topology of ``topology``'s schedule."""
        self.schedule = topology
        self._graphs: list = []
        self._neighbors: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self._booked_neighbors: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # as the Ledger's ranks
        by_topology: dict = {}
        for step in range(topology.period):
            topo = topology.at(step)
            sources, dests = topo.in_neighbors(self.rank), topo.out_neighbors(self.rank)
            if topo not in by_topology:
                by_topology[topo] = self.comm.Create_dist_graph_adjacent(list(sources), list(dests), reorder=False)
            self._graphs.append((topo, by_topology[topo]))
            self._neighbors.append((sources, dests))
            self._booked_neighbors.append((tuple(map(self._peer, sources)), tuple(map(self._peer, dests))))

    def _child(self, raw, link: str, peer_ranks: tuple[int, ...]) -> Communicator:
        """A Communicator over ``raw`` (a sub-communicator of this one's ranks ``peer_ranks``, in ``raw``'s rank
        order) for the centralized collectives, priced and booked on ``link`` in this one's Ledger and clock."""
        child = Communicator.__new__(Communicator)
        child.comm, child.rank, child.size = raw, raw.Get_rank(), raw.Get_size()
        child.schedule = None
        child.ledger, child.router, child.net, child.clock, child.guard = (self.ledger, self.router, self.net,
                                                                          self.clock, self.guard)
        child.link = link
        child._peer_ranks = tuple(self._peer(p) for p in peer_ranks)
        child.ranks_per_node, child._layout, child._spans = None, None, None
        child._recv, child._recv_specs, child._graphs, child._neighbors = {}, {}, [], []
        return child

    def on_graph(self, topology) -> Communicator:
        """Collective: a Communicator over the same ranks and link class whose neighbour collectives follow
        ``topology`` (one vertex per rank of this Communicator), booked as this one's ranks in its Ledger.

        The two-level gossip runs on a graph of nodes this way: ``nodes.cross.on_graph(ring(n_nodes))``.
        """
        if topology.size != self.size:
            raise ValueError(f"topology {topology.name!r} has {topology.size} vertices but this communicator has "
                             f"{self.size} ranks")
        child = self._child(self.comm, self.link, tuple(range(self.size)))
        child._adopt(topology)
        return child

    def node_layout(self, *, require_equal: bool = True) -> NodeLayout:
        """Collective the first time: the :class:`~mpicomm.comm.nodes.NodeLayout` of this Communicator's ranks
        (nodes of ``ranks_per_node`` consecutive ranks when set, else ranks sharing memory), built once.

        With nodes of different sizes it raises the layout's one-line ``ValueError`` (the same on every rank)
        when ``require_equal``, or when the nodes are emulated; otherwise returns the layout, whose
        ``refusal`` says why it has no two-level Communicators.
        """
        if self._layout is None:
            self._layout = NodeLayout(self, self.ranks_per_node)
        if self._layout.refusal is not None and (require_equal or self._layout.emulated):
            raise ValueError(self._layout.refusal)
        return self._layout

    def spans_nodes(self) -> bool:
        """Collective the first time: whether the two-level collectives differ from flat here (equal nodes, more
        than one, of more than one rank each), found without keeping a communicator (an algorithm with
        ``hierarchical`` auto asks this on every construction). Emulated nodes that do not divide the ranks
        raise the layout's one-line ``ValueError``."""
        if self._layout is not None:
            return self._layout.two_level
        if self._spans is None:
            k = self.ranks_per_node
            if k is None:
                self._spans = shared_memory_spans_nodes(self)
            elif self.size % k:
                return self.nodes.two_level  # raises the layout's refusal
            else:
                self._spans = k > 1 and self.size // k > 1
        return self._spans

    @property
    def nodes(self) -> NodeLayout:
        """:meth:`node_layout` (collective the first time; ``ValueError`` if the nodes differ in size)."""
        return self.node_layout()

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

    # ------------------------------------------------------------------ topology helpers
    def topology(self, step: int = 0):
        """The (static) topology in force at ``step``."""
        return self._graphs[step % len(self._graphs)][0]

    def in_neighbors(self, step: int = 0) -> tuple[int, ...]:
        """Ranks this rank receives from at ``step``, in the row order of neighbour receive buffers."""
        return self._neighbors[step % len(self._neighbors)][0]

    def out_neighbors(self, step: int = 0) -> tuple[int, ...]:
        """Ranks this rank sends to at ``step``."""
        return self._neighbors[step % len(self._neighbors)][1]

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

    # ------------------------------------------------------------------ neighbour collectives
    def neighbor_allgather(self, send: torch.Tensor, out: torch.Tensor | None = None, step: int = 0):
        """Send ``send`` to every out-neighbour; return ``(len(in_neighbors), *send.shape)`` received rows."""
        return self._neighbor_allgather(send, out, step, blocking=True)

    def ineighbor_allgather(self, send: torch.Tensor, out: torch.Tensor | None = None, step: int = 0) -> Handle:
        """Non-blocking :meth:`neighbor_allgather`; ``send`` must not change until ``wait()``."""
        return self._neighbor_allgather(send, out, step, blocking=False)

    def _neighbor_allgather(self, send, out, step, blocking):
        index = step % len(self._graphs)
        graph = self._graphs[index][1]
        sources, dests = self._neighbors[index]
        booked_sources, booked_dests = self._booked_neighbors[index]
        shape = (len(sources), *send.shape)
        key = None
        if out is None:
            key = ("neighbor_allgather", shape, send.dtype, send.device)
            out = self._recv_buffer(*key[:2], send)
        else:
            self._check_out(out, shape, send, "neighbor_allgather")
        nbytes = send.numel() * send.element_size()
        self.ledger.record_uniform("neighbor_allgather", nbytes, booked_dests, booked_sources, link=self.link)

        def specs(sbuf, rbuf):
            return as_bytes(sbuf), self._recv_spec(key, out, rbuf)

        def cost(model: CostModel) -> float:
            return model.neighbor(nbytes * len(dests), nbytes * len(sources))

        return self._collective("neighbor_allgather", send, out, blocking, cost, specs,
                                graph.Neighbor_allgather, graph.Ineighbor_allgather)

    def _recv_spec(self, key, out: torch.Tensor, rbuf: torch.Tensor):
        """The MPI buffer spec of ``rbuf``; made once for a cached CPU receive buffer MPI writes directly."""
        rspec = self._recv_specs.get(key) if key is not None and rbuf is out else None
        if rspec is None:
            rspec = as_bytes(rbuf)
            if key is not None and rbuf is out and out.device.type == "cpu":
                self._recv_specs[key] = rspec  # its spec never changes
        return rspec

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

    def neighbor_alltoallv(self, sends: Sequence[torch.Tensor], recv_numels: Sequence[int],
                           step: int = 0) -> list[torch.Tensor]:
        """Send ``sends[k]`` to the k-th out-neighbour; return the tensors received from each in-neighbour.

        ``recv_numels[k]`` is the element count expected from the k-th in-neighbour (payload sizes are
        known from the codec, so no count exchange is needed). All tensors share one dtype and device.
        """
        return self._neighbor_alltoallv(sends, recv_numels, step, blocking=True)

    def ineighbor_alltoallv(self, sends: Sequence[torch.Tensor], recv_numels: Sequence[int], step: int = 0) -> Handle:
        """Non-blocking :meth:`neighbor_alltoallv` (``sends`` are copied at the call); ``wait()`` returns the list of
        received tensors (fresh buffers, valid after later calls)."""
        return self._neighbor_alltoallv(sends, recv_numels, step, blocking=False)

    def _neighbor_alltoallv(self, sends, recv_numels, step, blocking):
        topo, graph = self._graphs[step % len(self._graphs)]
        sources, dests = topo.in_neighbors(self.rank), topo.out_neighbors(self.rank)
        op = "neighbor_alltoallv" if blocking else "ineighbor_alltoallv"
        if len(sends) != len(dests) or len(recv_numels) != len(sources):
            raise ValueError(
                f"{op}: rank {self.rank} has {len(dests)} out-neighbours and {len(sources)} "
                f"in-neighbours at step {step}; got {len(sends)} send tensors and {len(recv_numels)} counts"
            )
        like = sends[0] if sends else torch.empty(0)
        send_counts = [int(t.numel()) for t in sends]
        if blocking:  # cached buffers: the next call may reuse them
            packed_send = self._recv_buffer("neighbor_alltoallv:send", (sum(send_counts),), like)
            packed_recv = self._recv_buffer("neighbor_alltoallv", (sum(recv_numels),), like)
        else:  # its own buffers, alive until the handle is waited for and after
            packed_send = like.new_empty(sum(send_counts))
            packed_recv = like.new_empty(sum(recv_numels))
        if sends:
            torch.cat([t.reshape(-1) for t in sends], out=packed_send)
        sbuf = self.router.outbound("neighbor_alltoallv", packed_send, hold=not blocking)
        rbuf, land = self.router.inbound("neighbor_alltoallv", packed_recv, hold=not blocking)
        size = like.element_size()
        sdispl, rdispl = _displacements(send_counts), _displacements(recv_numels)
        args = ([as_bytes(sbuf)[0], [c * size for c in send_counts], [d * size for d in sdispl], MPI.BYTE],
                [as_bytes(rbuf)[0], [c * size for c in recv_numels], [d * size for d in rdispl], MPI.BYTE])

        def cost(model: CostModel) -> float:
            return model.neighbor(sum(send_counts) * size, sum(recv_numels) * size)

        def finish():
            land()
            self.router.release(sbuf)
            return [packed_recv[d:d + c] for d, c in zip(rdispl, recv_numels)]

        self._book("neighbor_alltoallv", sum(send_counts) * size, {d: c * size for d, c in zip(dests, send_counts)},
                   {s: c * size for s, c in zip(sources, recv_numels)})
        if blocking:
            self._run(op, cost, lambda: graph.Neighbor_alltoallv(*args))
            return finish()
        return self._handle(graph.Ineighbor_alltoallv(*args), finish, cost, op)

    # ------------------------------------------------------------------ centralized collectives
    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place allreduce of ``t`` (``op`` in sum/max/min); returns ``t``."""
        return self._allreduce(t, op, blocking=True)

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
        return self._allgather(send, out, blocking=True)

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

        return self._collective("allgather", send, out, blocking, cost, _byte_specs, self.comm.Allgather,
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

        return self._collective("alltoall", send, out, blocking, cost, _byte_specs, self.comm.Alltoall,
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
                     [d * size for d in _displacements(recv_counts)], MPI.BYTE])

        return self._collective("alltoallv", send, out, False, cost, specs, None, self.comm.Ialltoallv)

    def reduce_scatter(self, send: torch.Tensor, counts: Sequence[int], out: torch.Tensor | None = None):
        """Sum ``send`` (1-D) over all ranks and keep part ``rank`` of it: ``counts[r]`` elements for rank r, in
        rank order (``sum(counts) == send.numel()``); returns the ``(counts[rank],)`` part (in ``out`` if given).

        Booked as the pairwise exchange does it: each other rank's part is sent to it once.
        """
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
                  lambda: self.comm.Allgatherv(MPI.IN_PLACE, [spec[0], counts, _displacements(counts), spec[1]]))
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


def _byte_specs(sbuf: torch.Tensor, rbuf: torch.Tensor) -> tuple:
    """MPI buffer specs of a send and a receive buffer, as raw bytes."""
    return as_bytes(sbuf), as_bytes(rbuf)


def _displacements(counts: Sequence[int]) -> list[int]:
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += int(c)
    return out

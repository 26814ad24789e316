"""Communicator: the one object through which mpicomm talks MPI, and its neighbour collectives over a graph.

Built once from the world (a :class:`~mpicomm.comm.World`, or an mpi4py intracommunicator) and a
:class:`~mpicomm.topology.Topology` (or a time-varying :class:`~mpicomm.topology.Schedule`). For every distinct
topology of the schedule it creates one distributed-graph communicator (``Create_dist_graph_adjacent``, no
reordering) at construction, so a time-varying schedule costs nothing per step. Receive buffers are cached per
(operation, shape, dtype, device) and reused: a returned receive tensor stays valid until the next call of the
same operation with the same shape, unless the caller passes ``out=``.

The collectives over all ranks, and how every call is booked in the :class:`~mpicomm.ledger.Ledger`, timed and
priced by the :class:`~mpicomm.net.NetClock` (given a network setting such as ``net="1gbit,100us"``, the
alpha-beta model's cost is added on top of the real transfer; :mod:`mpicomm.net.model`), live in its base
class, :class:`~mpicomm.comm.collectives.Collectives`.

:meth:`Communicator.node_layout` (built once, on first use) splits the ranks by node for the two-level
collectives: a Communicator of this rank's node, priced and booked on the ``intra`` link class, and one
of the ranks holding the same local rank on every node, on ``inter`` (:mod:`mpicomm.comm.nodes`). Every
call of the Communicator itself is priced and booked on ``inter``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from mpi4py import MPI

from ..ledger import Ledger
from ..net import CostModel, NetClock, NetLinks, NetSpec, parse_net
from .buffers import BufferRouter, as_bytes, query_cuda_aware
from .collectives import _BYTE, Collectives, _address, _Plan
from .faults import track
from .guard import process_guard
from .handle import Handle, displacements
from .nodes import NodeLayout, ranks_per_node_setting, shared_memory_spans_nodes
from .progress import progress_mode
from .world import abort_world, raw_comm

__all__ = ["Communicator", "Handle"]

_BOTTOM = MPI.BOTTOM


class Communicator(Collectives):
    """The one object through which mpicomm talks MPI.

    Parameters
    ----------
    comm: the ranks to talk over: a :class:`~mpicomm.comm.World` (``mpicomm.comm.world()``) or an mpi4py
        intracommunicator (e.g. ``MPI.COMM_WORLD``); passed in, never fetched globally.
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
        comm = raw_comm(comm)
        size = comm.Get_size()
        if topology.size != size:
            # Topology and world size are the same on every rank, so every rank raises this together.
            raise ValueError(
                f"topology {topology.name!r} has {topology.size} ranks but the MPI communicator has "
                f"{size}; build the topology for {size} ranks"
            )
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = size
        self.schedule = topology
        self.ledger = ledger if ledger is not None else Ledger(self.rank)
        self.router = BufferRouter(query_cuda_aware() if cuda_aware is None else cuda_aware, stage)
        self.net = net if isinstance(net, (NetSpec, NetLinks)) else parse_net(net)
        self.clock = NetClock(CostModel(self.net) if self.net is not None else None)
        self.guard = process_guard(abort_world)
        self.guard.rank = MPI.COMM_WORLD.Get_rank()
        progress_mode()  # a bad MPICOMM_PROGRESS is refused here, as a bad hang timeout is
        self.link = "inter"  # the link class this Communicator's calls are priced and booked on
        self._peer_ranks: tuple[int, ...] | None = None  # a child's ranks as its parent's (None: itself)
        self.ranks_per_node = ranks_per_node_setting(ranks_per_node)
        self._layout: NodeLayout | None = None
        self._spans: bool | None = None  # spans_nodes(), once known
        self._recv: dict[tuple, torch.Tensor] = {}
        self._recv_specs: dict[tuple, list] = {}  # the MPI buffer spec of each cached receive buffer, made once
        self._plans: dict[tuple, _Plan | None] = {}  # the fast path's plan per call shape (Collectives)
        self._adopt(topology)

    def _adopt(self, topology) -> None:
        """Collective: one distributed-graph communicator per distinct topology of ``topology``'s schedule."""
        self.schedule = topology
        self._plans = {}  # a plan holds its graph's bound call
        self._graphs: list = []
        self._neighbors: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self._booked_neighbors: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # as the Ledger's ranks
        by_topology: dict = {}
        for step in range(topology.period):
            topo = topology.at(step)
            sources, dests = topo.in_neighbors(self.rank), topo.out_neighbors(self.rank)
            if topo not in by_topology:
                by_topology[topo] = self.comm.Create_dist_graph_adjacent(list(sources), list(dests), reorder=False)
                track(by_topology[topo])
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
        child._plans = {}
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

    # ------------------------------------------------------------------ neighbour collectives
    def neighbor_allgather(self, send: torch.Tensor, out: torch.Tensor | None = None, step: int = 0):
        """Send ``send`` to every out-neighbour; return ``(len(in_neighbors), *send.shape)`` received rows."""
        index = step % len(self._graphs)
        plan = self._plan_for(("neighbor_allgather", index, send.shape, send.dtype, send.device),
                              self._neighbor_allgather_plan, send, index)
        if plan is None or not send.is_contiguous():
            return self._neighbor_allgather(send, out, step, blocking=True)
        rspec = plan.rspec if out is None and plan.rspec is not None else self._receive_spec(plan, out, send)
        if rspec is None:
            return self._neighbor_allgather(send, out, step, blocking=True)
        self._fast(plan, plan.call, [_address(send.data_ptr(), plan.nbytes), _BYTE], rspec)
        return plan.out if out is None else out

    def _neighbor_allgather_plan(self, send: torch.Tensor, index: int) -> _Plan | None:
        if not self._direct(send):
            return None
        sources, dests = self._neighbors[index]
        booked_sources, booked_dests = self._booked_neighbors[index]
        nbytes, link = send.numel() * send.element_size(), self.link
        sent, received = nbytes * len(dests), nbytes * len(sources)
        return _Plan("neighbor_allgather", nbytes,
                     lambda ledger: ledger.record_uniform("neighbor_allgather", nbytes, booked_dests, booked_sources,
                                                          link),
                     self._priced(lambda model: model.neighbor(sent, received)), shape=(len(sources), *send.shape),
                     rbytes=received, call=self._graphs[index][1].Neighbor_allgather)

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
    def neighbor_alltoallv(self, sends: Sequence[torch.Tensor], recv_numels: Sequence[int],
                           step: int = 0) -> list[torch.Tensor]:
        """Send ``sends[k]`` to the k-th out-neighbour; return the tensors received from each in-neighbour.

        ``recv_numels[k]`` is the element count expected from the k-th in-neighbour (payload sizes are
        known from the codec, so no count exchange is needed). All tensors share one dtype and device.
        """
        index = step % len(self._graphs)
        if not sends:
            return self._neighbor_alltoallv(sends, recv_numels, step, blocking=True)
        like = sends[0]
        dtype, device = like.dtype, like.device
        key = ("neighbor_alltoallv", index, tuple(t.numel() for t in sends), tuple(map(int, recv_numels)), dtype,
               device)
        plan = self._plan_for(key, self._neighbor_alltoallv_plan, like, index, *key[2:4])
        if plan is None:
            return self._neighbor_alltoallv(sends, recv_numels, step, blocking=True)
        addresses = []
        for t in sends:
            if t.dtype != dtype or t.device != device or not t.is_contiguous():
                return self._neighbor_alltoallv(sends, recv_numels, step, blocking=True)
            addresses.append(t.data_ptr())
        self._fast(plan, plan.call, [_BOTTOM, plan.counts, addresses, plan.mpi_type], plan.rspec)
        return list(plan.views)

    def _neighbor_alltoallv_plan(self, like: torch.Tensor, index: int, send_counts: tuple[int, ...],
                                 recv_numels: tuple[int, ...]) -> _Plan | None:
        """The plan of a blocking neighbour alltoallv of CPU tensors: ``MPI_Neighbor_alltoallw`` reads each part
        where it is (its absolute address, from ``MPI_BOTTOM``) instead of a packed copy of them all."""
        sources, dests = self._neighbors[index]
        if len(send_counts) != len(dests) or len(recv_numels) != len(sources) or not self._direct(like):
            return None  # the general path raises, or stages
        size = like.element_size()
        packed_recv = self._recv_buffer("neighbor_alltoallv", (sum(recv_numels),), like)
        rdispl = displacements(recv_numels)
        sent, received = sum(send_counts) * size, sum(recv_numels) * size
        plan = self._new_plan("neighbor_alltoallv", sent, {d: c * size for d, c in zip(dests, send_counts)},
                              {s: c * size for s, c in zip(sources, recv_numels)},
                              lambda model: model.neighbor(sent, received),
                              call=self._graphs[index][1].Neighbor_alltoallw, counts=[c * size for c in send_counts],
                              mpi_type=[MPI.BYTE] * len(dests))
        plan.out = packed_recv
        plan.rspec = [as_bytes(packed_recv)[0], [c * size for c in recv_numels], [d * size for d in rdispl],
                      [MPI.BYTE] * len(sources)]
        plan.views = tuple(packed_recv[d:d + c] for d, c in zip(rdispl, recv_numels))
        return plan

    def ineighbor_alltoallv(self, sends: Sequence[torch.Tensor], recv_numels: Sequence[int], step: int = 0) -> Handle:
        """Non-blocking :meth:`neighbor_alltoallv` (``sends`` are copied at the call); ``wait()`` returns the list of
        received tensors (fresh buffers, valid after later calls)."""
        return self._neighbor_alltoallv(sends, recv_numels, step, blocking=False)

    def _neighbor_alltoallv(self, sends, recv_numels, step, blocking):
        index = step % len(self._graphs)
        graph = self._graphs[index][1]
        sources, dests = self._neighbors[index]  # the topology's, found once (asking it costs a numpy scan)
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
        sdispl, rdispl = displacements(send_counts), displacements(recv_numels)
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


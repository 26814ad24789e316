"""The node layout: which ranks share a node, and the two communicators of the two-level collectives.

A GPU cluster is two networks: the ranks of one node reach each other over NVLink, PCIe or shared memory,
nodes reach each other over InfiniBand or Ethernet. :class:`NodeLayout` splits a Communicator's ranks so:

* ``node``: the ranks of this rank's node (``Split_type(COMM_TYPE_SHARED)``), a Communicator on the
  ``intra`` link class;
* ``cross``: the ranks holding the same local rank on every node, one per node, ordered by node, a
  Communicator on the ``inter`` link class. Every local rank has its own, so a two-level collective runs
  ``local_size`` cross-node exchanges side by side (one per GPU and NIC), not one through a leader.

Both share the parent's Ledger (peers booked as the parent's ranks), NetClock and hang guard. The layout is
built once, on first use, collectively over the parent (:meth:`~mpicomm.comm.Communicator.node_layout`).

**Emulated nodes**: ``MPICOMM_RANKS_PER_NODE=k`` in the environment (or ``Communicator(...,
ranks_per_node=k)``) splits consecutive ranks into nodes of ``k`` instead of asking MPI which ranks share
memory: the way to test and benchmark the two-level collectives on one host (with ``--net intra=...,
inter=...`` to give the two classes their speeds). The two-level collectives need every node to hold
the same number of ranks; :attr:`NodeLayout.refusal` says why not when they differ, and the same
one-line ``ValueError`` is raised on every rank when they are asked for.
"""

from __future__ import annotations

import os

from mpi4py import MPI

from .faults import free_tracked, track

__all__ = ["RANKS_PER_NODE_ENV", "NodeLayout", "ranks_per_node_setting", "shared_memory_spans_nodes"]

RANKS_PER_NODE_ENV = "MPICOMM_RANKS_PER_NODE"


def ranks_per_node_setting(value: int | None = None) -> int | None:
    """The emulated node size: ``value`` if given, else ``$MPICOMM_RANKS_PER_NODE``; None: the real nodes."""
    source = "ranks_per_node"
    if value is None:
        text = os.environ.get(RANKS_PER_NODE_ENV, "").strip()
        if not text:
            return None
        source = RANKS_PER_NODE_ENV
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{RANKS_PER_NODE_ENV}={text!r}: expected a whole number of ranks >= 1") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source} must be a whole number of ranks >= 1, got {value!r}")
    return value


def _node_sizes(parent, node) -> tuple[tuple[int, ...], dict[int, int]]:
    """Collective over ``parent``: the members of this rank's ``node`` (as ``parent``'s ranks) and every node's
    size by its lowest member."""
    with parent.guard.waiting("the node layout"):
        members = tuple(node.allgather(parent.rank))
    return members, dict(parent.allgather_object((members[0], node.Get_size()), what="the node layout"))


def shared_memory_spans_nodes(parent) -> bool:
    """Collective over ``parent``: whether the ranks that share memory form more than one node, every node of
    the same number of ranks and more than one; the node communicator is freed again."""
    node = parent.comm.Split_type(MPI.COMM_TYPE_SHARED, key=parent.rank)
    track(node)  # a rank lost while it is in use: revoked with the others (so it stays tracked until freed here)
    _, size_of = _node_sizes(parent, node)
    free_tracked([node])
    sizes = set(size_of.values())
    return len(size_of) > 1 and len(sizes) == 1 and sizes.pop() > 1


class NodeLayout:
    """This rank's place among the nodes of ``parent`` (a Communicator); collective to build.

    Attributes: ``local_rank``, ``local_size`` (ranks on this rank's node), ``node_index`` (nodes ordered by
    their lowest rank), ``n_nodes``, ``sizes`` (ranks on each node), ``members`` (the parent's ranks on this
    node), ``emulated`` (split by ``ranks_per_node`` rather than by shared memory), ``refusal`` (None when
    every node holds the same number of ranks, else the one-line reason the two-level collectives cannot
    run), and ``node`` / ``cross`` (the two Communicators, None when ``refusal`` is set).
    """

    def __init__(self, parent, ranks_per_node: int | None = None):
        raw, rank = parent.comm, parent.rank
        self.emulated = ranks_per_node is not None
        if self.emulated:
            node = raw.Split(rank // ranks_per_node, key=rank)
        else:
            node = raw.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        track(node)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        self.members, size_of = _node_sizes(parent, node)
        firsts = sorted(size_of)
        self.sizes = tuple(size_of[first] for first in firsts)
        self.n_nodes = len(firsts)
        self.node_index = firsts.index(self.members[0])
        self.refusal = None
        if len(set(self.sizes)) > 1:
            how = (f"{RANKS_PER_NODE_ENV}={ranks_per_node} over {parent.size} ranks" if self.emulated
                   else "ranks sharing memory")
            self.refusal = (f"the two-level collectives need the same number of ranks on every node; got nodes "
                            f"of {', '.join(map(str, self.sizes))} ranks ({how}): launch as many ranks on every "
                            f"node, or set hierarchical off")
            free_tracked([node])
            self.node = self.cross = None
            return
        cross = raw.Split(self.local_rank, key=self.node_index)
        track(cross)
        with parent.guard.waiting("the node layout"):
            cross_members = tuple(cross.allgather(rank))
        self.node = parent._child(node, "intra", self.members)
        self.cross = parent._child(cross, "inter", cross_members)

    @property
    def two_level(self) -> bool:
        """Whether a two-level collective differs from the flat one: equal nodes, more than one, of more than
        one rank each."""
        return self.refusal is None and self.n_nodes > 1 and self.local_size > 1

    def counts(self, numel: int) -> list[int]:
        """Elements of each local rank's shard of a ``numel`` vector: as equal as can be, the first ones larger."""
        base, extra = divmod(numel, self.local_size)
        return [base + (j < extra) for j in range(self.local_size)]

    def shard(self, numel: int) -> tuple[int, int]:
        """``[lo, hi)``: this rank's shard of a ``numel`` vector (the part it exchanges between nodes)."""
        counts = self.counts(numel)
        lo = sum(counts[:self.local_rank])
        return lo, lo + counts[self.local_rank]

    def __repr__(self) -> str:
        kind = "emulated" if self.emulated else "shared-memory"
        return (f"NodeLayout({self.n_nodes} {kind} nodes of {'/'.join(map(str, sorted(set(self.sizes))))} ranks; "
                f"node {self.node_index}, local rank {self.local_rank})")

"""PowerGossip: decentralized SGD whose gossip sends rank-r power-step approximations of model differences.

Vogels, Karimireddy, Jaggi. "PowerGossip: Practical Low-Rank Communication Compression in
Decentralized Deep Learning", NeurIPS 2020 (Algorithm 1).

Step t on rank i: a local torch SGD step (:mod:`~mpicomm.algorithms.shared.periodic`), then one gossip
round over the symmetric topology T = ``comm.topology(t)``. Both ends of every edge e = {lo, hi} keep the
same Q_e and approximate the difference D_e = X_lo - X_hi of every matrix by one warm-started power step::

    Q_e <- orthogonalize(Q_e);   P = X_lo Q_e - X_hi Q_e;   P̂ = orthogonalize(P)
    Q_e <- X_lo^T P̂ - X_hi^T P̂;   D̂_e = P̂ Q_e^T
    X_i <- X_i - gamma sum_{e = {i, j}} W_ij s_i D̂_e,     s_i = +1 if i = lo, -1 if i = hi

Every edge moves its two ends by opposite amounts, so the average is preserved. A column of P̂ that finds
no direction (D_e Q_e = 0 there, e.g. identical replicas, as in the first "cta" round) is set to 0, and the
same column of Q_e, then 0, is redrawn once the round is done, alike at both ends
(:meth:`PowerGossip._redraw_lost`): the next round looks for the difference again. Slices not worth
compressing are mixed in full precision. Traffic per round: two ``neighbor_alltoallv``. Details:
``docs/algorithms/lowrank.md``.

``overlap=True`` (with ``order="cta"``, the round on x(t)): ``begin_step()`` computes the first messages
X_i Q_e from x(t) and posts their exchange before the forward pass; ``step()`` waits for it and runs the
second exchange (Q, which needs the neighbours' P) blocking -- bit for bit the blocking round. With
``order="atc"`` the round mixes the model after this step's gradient, so ``overlap`` is refused.

``hierarchical`` (auto: on over several nodes of several ranks; :mod:`~mpicomm.algorithms.shared.hierarchy`):
the node's exact average first, then the round above between nodes on the graph of nodes (``node_topology``,
symmetric), the L local ranks of a node each carrying a group of whole tensors (its Q per neighbouring node),
then every group back inside the node. The round mixes the N node averages: PowerGossip over N nodes
(Vogels et al. 2020 analyse the exact-difference limit as gossip with the graph's W; here that of the nodes),
preceded by the exact average inside the node, a doubly stochastic step.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ...checkpoint.resize_rules import rebuilt_for_new_graph
from ..base import check_int, check_range
from ..shared.hierarchy import GossipTwoLevelConfig, ShardOfFlat, group_layers, node_gossip_for
from ..shared.periodic import OrderConfig, PeriodicGossip
from .layout import LowRankLayout, orthogonalize, zero_lost_columns

__all__ = ["PowerGossip", "PowerGossipConfig"]


@dataclass(frozen=True)
class PowerGossipConfig(GossipTwoLevelConfig, OrderConfig):
    """rank: r of every compressed matrix; gamma: consensus step in (0, 1]; min_compression_rate: as
    PowerSGD's; epsilon: added to column norms when orthogonalizing (a column within epsilon of 0 counts as
    no direction: see the module docstring).
    overlap: with order="cta", post the round's first exchange in begin_step(). hierarchical, node_topology:
    see the module docstring."""

    rank: int = 1
    gamma: float = 1.0
    min_compression_rate: float = 2.0
    epsilon: float = 1e-8

    def __post_init__(self):
        super().__post_init__()
        check_int("rank", self.rank, 1)
        check_int("seed", self.seed, 0)
        check_range("gamma", self.gamma, lo=0.0, hi=1.0, lo_open=True)
        check_range("min_compression_rate", self.min_compression_rate, lo=0.0)
        check_range("epsilon", self.epsilon, lo=0.0)
        if self.overlap and self.order != "cta":
            raise ValueError("overlap=True needs order='cta': with 'atc' the round mixes the model after this "
                             "step's gradient, so it cannot start before the backward pass")


def _check_symmetric(schedule, option: str) -> None:
    for k in range(schedule.period):
        if not schedule.at(k).is_symmetric():
            raise ValueError(f"powergossip needs a symmetric {option} (every edge used both ways); "
                             f"{schedule.at(k)!r} at step {k} is not")


class PowerGossip(PeriodicGossip):
    """Local SGD steps and, every step, a low-rank gossip of the model differences along each edge."""

    name = "powergossip"
    config_class = PowerGossipConfig
    resize_family = "decentralized"

    @classmethod
    def check_communicator(cls, config, comm) -> None:
        """The edges' shared Q need a symmetric topology at every step (every edge used both ways)."""
        _check_symmetric(comm.schedule, "topology")

    def __init__(self, model, comm, config=None):
        self.check_communicator(config, comm)
        super().__init__(model, comm, config)
        self.node_gossip = ng = node_gossip_for(self.config, comm, self.flat.numel, self.flat.data,
                                                layers=self.flat.layers)
        if ng is None:  # the graph the round runs on, this rank's vertex in it, and the part of x it carries
            self.graph, self.vertex, part = comm, comm.rank, self.flat
        else:
            _check_symmetric(ng.graph.schedule, "node_topology")
            lo, hi = ng.levels.lo, ng.levels.hi
            self.graph, self.vertex = ng.graph, ng.node
            part = ShardOfFlat(ng.levels.shard, group_layers(self.flat.layers, lo, hi))
        n, schedule, me = self.graph.size, self.graph.schedule, self.vertex
        self.layout = LowRankLayout(part, self.config.rank, self.config.min_compression_rate)
        neighbours = sorted({j for k in range(schedule.period) for j in schedule.at(k).in_neighbors(me)})
        self.q: dict[int, torch.Tensor] = {}  # neighbour -> Q of the edge, shared with that neighbour
        for j in neighbours:
            lo, hi = min(me, j), max(me, j)
            q = torch.zeros(self.layout.q_numel, dtype=self.flat.data.dtype, device=self.flat.data.device)
            self.layout.draw_q(q, torch.Generator().manual_seed((self.config.seed * n + lo) * n + hi))
            self.q[j] = q

    def _gossip(self, round_index: int) -> None:
        if self.node_gossip is None:
            self._low_rank_round(self.flat.data, round_index)
        else:
            self.node_gossip.mix_with(self.flat.data, round_index, self._low_rank_round)

    def _first_messages(self, x: torch.Tensor, nbrs) -> list[torch.Tensor]:
        """The round's first messages, one per neighbour j: [X Q_e for every matrix | the plain slices]."""
        lay, first = self.layout, []
        for j in nbrs:
            send = x.new_empty(lay.p_numel + lay.plain_numel)
            for mat in lay.matrices:
                torch.matmul(mat.view(x), orthogonalize(mat.q(self.q[j]), self.config.epsilon), out=mat.p(send))
            lay.gather_plain(x, send[lay.p_numel:])
            first.append(send)
        return first

    def _begin_exchange(self):
        """With overlap (order cta, flat): post the round's first exchange of x(t), before the forward pass."""
        if not self.config.overlap or self.node_gossip is not None:
            return None
        round_index = self._round_at(self.step_count)  # every step is a round (period 1)
        nbrs = self.graph.topology(round_index).in_neighbors(self.vertex)
        if not nbrs:
            return None
        first = self._first_messages(self.flat.data, nbrs)
        size = self.layout.p_numel + self.layout.plain_numel
        return first, self.graph.ineighbor_alltoallv(first, [size] * len(nbrs), step=round_index)

    def _low_rank_round(self, x: torch.Tensor, round_index: int) -> None:
        """One round of the module docstring on ``x`` (this rank's model, or its node's average of its group)
        over ``self.graph``, in place; its first exchange is the one :meth:`begin_step` posted, if any."""
        cfg, lay, rank = self.config, self.layout, self.vertex
        topo = self.graph.topology(round_index)
        nbrs, weights = topo.in_neighbors(rank), topo.neighbor_weights(rank)
        pending = self._take_pending()
        if not nbrs:
            return
        if pending is None:
            first = self._first_messages(x, nbrs)
            got = self.graph.neighbor_alltoallv(first, [lay.p_numel + lay.plain_numel] * len(nbrs), step=round_index)
        else:
            first, handle = pending
            got = handle.wait()
        plain = lay.gather_plain(x, x.new_empty(lay.plain_numel))
        mixed = torch.zeros_like(plain)                                  # sum_j W_ij (x_j - x_i), plain slices
        p_hats, second = [], []
        for j, w, mine, theirs in zip(nbrs, weights, first, got):
            mixed.add_(theirs[lay.p_numel:] - plain, alpha=w)
            if rank < j:                                                 # P = X_lo Q - X_hi Q
                p_hat = mine[:lay.p_numel].sub_(theirs[:lay.p_numel])
            else:
                p_hat = theirs[:lay.p_numel].sub(mine[:lay.p_numel])
            send = x.new_empty(lay.q_numel)
            for mat in lay.matrices:
                p = zero_lost_columns(orthogonalize(mat.p(p_hat), cfg.epsilon))
                torch.matmul(mat.view(x).t(), p, out=mat.q(send))
            p_hats.append(p_hat)
            second.append(send)
        got_q = self.graph.neighbor_alltoallv(second, [lay.q_numel] * len(nbrs), step=round_index)
        for j, w, p_hat, mine, theirs in zip(nbrs, weights, p_hats, second, got_q):
            q = self.q[j]                                                # Q_e <- X_lo^T P̂ - X_hi^T P̂
            torch.sub(*((mine, theirs) if rank < j else (theirs, mine)), out=q)
            sign = -1.0 if rank < j else 1.0
            for mat in lay.matrices:
                mat.view(x).addmm_(mat.p(p_hat), mat.q(q).t(), alpha=sign * cfg.gamma * w)
            self._redraw_lost(j, round_index)
        lay.scatter_plain(plain.add_(mixed, alpha=cfg.gamma), x)

    def _redraw_lost(self, j: int, round_index: int) -> None:
        """Redraw the columns of the edge's Q_e that came out zero this round (P̂ found no direction there).

        Q_e is bit-identical at both ends, so both find the same columns, and both draw them from a generator
        seeded by the seed, the edge and the round: the same numbers, with no state to keep or checkpoint."""
        lost = self.layout.lost_columns(self.q[j])
        if lost is None:
            return
        n, lo, hi = self.graph.size, min(self.vertex, j), max(self.vertex, j)
        key = hashlib.blake2b(f"{self.config.seed} {n} {lo} {hi} {round_index}".encode(), digest_size=8).digest()
        self.layout.redraw_columns(self.q[j], lost, torch.Generator().manual_seed(int.from_bytes(key, "little")))

    def _extra_state(self):
        return {**super()._extra_state(), "q": {j: q.clone() for j, q in self.q.items()}}

    def _resize_rules(self):
        """On a resize the per-edge Q of the power iteration is re-derived for the new graph's edges (as at
        construction)."""
        return {**super()._resize_rules(), "extra.q": rebuilt_for_new_graph}

    def _load_extra_state(self, extra):
        if sorted(extra["q"]) != sorted(self.q) or any(extra["q"][j].shape != q.shape for j, q in self.q.items()):
            raise ValueError("state's per-edge Q do not fit this rank's neighbours and layout: "
                             "it was saved with another topology, model, rank or min_compression_rate")
        super()._load_extra_state(extra)
        for j, q in self.q.items():
            q.copy_(extra["q"][j])

"""Compressed gossip that keeps the own public copy and the weighted sum of the copies, not one per neighbour.

CHOCO-SGD's memory-efficient form (Koloskova, Stich, Jaggi, ICML 2019), shared by CHOCO, CPD-SGDM and
DCD. Rank i keeps a public copy x̂_i and sends ``q_i = C(target - x̂_i)``; only the mix
s_i = sum_{j in N(i) ∪ {i}} W_ij x̂_j is ever used, so that is what is stored::

    q_i = C(target_i - x̂_i);   x̂_i <- x̂_i + q_i;   s_i <- s_i + W_ii q_i + sum_{j in N(i)} W_ij q_j

Each payload is decoded into one d-element scratch vector, so nothing per neighbour is model-sized.
(x̂_i, s_i) is kept per distinct topology of the schedule (a ``(2, d)`` tensor each). Initial states,
time-varying topologies and the checkpoint format: ``docs/algorithms/decentralized.md``.
"""

from __future__ import annotations

from typing import Any

import torch

from ...codecs import Codec
from .gossip import gossip_average

__all__ = ["SumGossip"]

INITS = ("model", "zeros", "exchange")


class SumGossip:
    """A rank's own public copy x̂_i and mix s_i = sum_j W_ij x̂_j per distinct topology (see the module docstring).

    ``slots`` lists the schedule's distinct topologies in order of first use (``first_steps`` the step of
    that use); :meth:`models` is the lossless codecs' path, which keeps no public state.
    """

    def __init__(self, comm, codec: Codec, x: torch.Tensor, init: str = "model"):
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {init!r}")
        self.comm, self.codec, self.numel = comm, codec, x.numel()
        self.scratch = torch.empty_like(x)
        self._models: dict[int, torch.Tensor] = {}
        self.slots: list = []
        self.first_steps: list[int] = []
        for step in range(comm.schedule.period):
            topo = comm.topology(step)
            if topo not in self.slots:
                self.slots.append(topo)
                self.first_steps.append(step)
        self.pairs: list[torch.Tensor] = []
        if codec.lossless:
            return
        for topo, step in zip(self.slots, self.first_steps):
            pair = torch.empty((2, self.numel), dtype=x.dtype, device=x.device)
            if init == "zeros":
                pair.zero_()
            else:
                pair.copy_(x.detach().expand_as(pair))
            if init == "exchange":
                received = comm.neighbor_allgather(x.detach(), step=step)
                gossip_average(pair[1], received, topo.self_weight(comm.rank), topo.neighbor_weights(comm.rank))
            self.pairs.append(pair)

    @property
    def lossless(self) -> bool:
        """True when the codec is lossless and no public state is kept."""
        return self.codec.lossless

    def slot(self, step: int) -> int:
        """Index in ``slots`` of the topology in force at ``step``."""
        return self.slots.index(self.comm.topology(step))

    def models(self, x: torch.Tensor, step: int, handle=None) -> torch.Tensor:
        """Lossless codecs only: send ``encode(x)``; return the decoded in-neighbour models ``(in_degree, d)``.

        ``handle``: what :meth:`post_models` returned for this ``x`` and step (then nothing is sent here).
        """
        if handle is None:
            received = self.comm.neighbor_allgather(self.codec.encode(x), step=step)
        else:
            received = handle.wait()
        out = self._models.get(len(received))
        if out is None:
            out = self._models[len(received)] = torch.empty((len(received), self.numel), dtype=x.dtype,
                                                            device=x.device)
        for row, message in zip(out, received):
            self.codec.decode(message, self.numel, out=row)
        return out

    def post_models(self, x: torch.Tensor, step: int):
        """:meth:`models`' exchange, posted non-blocking: the handle to pass it (``x`` must not change meanwhile)."""
        return self.comm.ineighbor_allgather(self.codec.encode(x), step=step)

    def pair_at(self, step: int) -> torch.Tensor:
        """The ``(2, d)`` state for the topology in force at ``step``: row 0 x̂_i, row 1 s_i."""
        return self.pairs[self.slot(step)]

    def advance(self, target: torch.Tensor, step: int) -> None:
        """Send ``q_i = C(target - x̂_i)`` over the topology at ``step``; add q_i to x̂_i and every W_ij q_j to s_i."""
        self.finish_advance(self._advance(target, step, blocking=True), step)

    def post_advance(self, target: torch.Tensor, step: int):
        """:meth:`advance` up to its exchange, which is posted non-blocking; :meth:`finish_advance` completes it.

        x̂_i and s_i already hold the own q_i afterwards; s_i gains the neighbours' in :meth:`finish_advance`.
        """
        return self._advance(target, step, blocking=False)

    def _advance(self, target: torch.Tensor, step: int, blocking: bool):
        own, total = self.pair_at(step)
        payload = self.codec.encode(torch.sub(target, own, out=self.scratch))
        mine = self.codec.decode(payload, self.numel, out=self.scratch)
        own.add_(mine)
        total.add_(mine, alpha=self.comm.topology(step).self_weight(self.comm.rank))
        if blocking:
            return self.comm.neighbor_allgather(payload, step=step)
        return self.comm.ineighbor_allgather(payload, step=step)

    def finish_advance(self, received, step: int) -> None:
        """Add every W_ij q_j to s_i; ``received``: the rows, or the handle :meth:`post_advance` returned."""
        if not torch.is_tensor(received):
            received = received.wait()
        total = self.pair_at(step)[1]
        topo, rank = self.comm.topology(step), self.comm.rank
        for weight, message in zip(topo.neighbor_weights(rank), received):
            total.add_(self.codec.decode(message, self.numel, out=self.scratch), alpha=weight)

    def state_dict(self) -> dict[str, Any]:
        """Codec generator state and a copy of every ``(2, d)`` tensor (in slot order)."""
        return {"codec": self.codec.state_dict(), "own_and_sum": [p.clone() for p in self.pairs]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, or convert a per-neighbour ``"copies"`` state."""
        pairs = state["own_and_sum"] if "own_and_sum" in state else self._from_copies(state["copies"])
        shapes = [tuple(p.shape) for p in self.pairs]
        if [tuple(p.shape) for p in pairs] != shapes:
            raise ValueError(f"public-copy state has shapes {[tuple(p.shape) for p in pairs]}, expected {shapes}")
        for mine, saved in zip(self.pairs, pairs):
            mine.copy_(saved)
        self.codec.load_state_dict(state["codec"])

    def _from_copies(self, copies: list) -> list[torch.Tensor]:
        """(x̂_i, sum_j W_ij x̂_j) per slot from the per-neighbour copies of an older checkpoint."""
        rank = self.comm.rank
        expected = [(1 + len(topo.in_neighbors(rank)), self.numel) for topo in self.slots]
        if [tuple(c.shape) for c in copies] != expected:
            raise ValueError(f"per-neighbour replica state has shapes {[tuple(c.shape) for c in copies]}, "
                             f"expected {expected} for this topology schedule")
        pairs = []
        for topo, rows in zip(self.slots, copies):
            mixed = gossip_average(rows[0].clone(), rows[1:], topo.self_weight(rank), topo.neighbor_weights(rank))
            pairs.append(torch.stack((rows[0], mixed)))
        return pairs

"""The Ledger: what one rank put on the wire, per operation and per link.

Two views are kept, because collectives do not all have a meaningful per-link picture:

* ``contributed``: bytes of the buffer this rank handed to MPI, once per call. This is the number
  papers quote as "bits per parameter per step" (a compressed allgather contributes its payload once).
* ``links``: bytes this rank sent to (and received from) each peer. Exact for the neighbour
  collectives and for allgather/alltoall/bcast, whose traffic is defined point to point. For
  ``allreduce`` the routing is chosen by MPI, so it is booked against peer ``ANY`` (-1) at the
  bandwidth-optimal volume ``2 (n - 1) / n * nbytes`` (what ring and Rabenseifner allreduce send).

No MPI import: the Communicator reports into a Ledger; algorithms and benchmarks read it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .pausable import Pausable

__all__ = ["ANY", "Count", "Ledger"]

ANY = -1
"""Peer id used for traffic whose routing MPI chooses (allreduce)."""


@dataclass
class Count:
    """Messages and bytes accumulated under one key."""

    messages: int = 0
    bytes: int = 0

    def add(self, nbytes: int) -> None:
        """Book one message of ``nbytes`` bytes."""
        self.messages += 1
        self.bytes += int(nbytes)


class Ledger(Pausable):
    """Counts every byte one rank contributes, sends and receives, keyed by operation and peer.

    Inside ``with ledger.paused():`` nothing is booked (monitoring traffic such as evaluation's averages).
    """

    def __init__(self, rank: int):
        self.rank = rank
        self.contributed: dict[str, Count] = defaultdict(Count)
        self.sent: dict[tuple[str, int], Count] = defaultdict(Count)
        self.received: dict[tuple[str, int], Count] = defaultdict(Count)

    def record(self, op: str, nbytes: int, sends: dict[int, int], recvs: dict[int, int]) -> None:
        """Book one call of ``op`` that handed ``nbytes`` to MPI, sent ``sends[peer]`` and received ``recvs[peer]``."""
        if self.is_paused:
            return
        self.contributed[op].add(nbytes)
        for peer, n in sends.items():
            self.sent[(op, peer)].add(n)
        for peer, n in recvs.items():
            self.received[(op, peer)].add(n)

    def record_uniform(self, op: str, nbytes: int, dests, sources) -> None:
        """Book one call that sent ``nbytes`` to each of ``dests`` and received as much from each of ``sources``."""
        if self.is_paused:
            return
        self.contributed[op].add(nbytes)
        for peer in dests:
            self.sent[(op, peer)].add(nbytes)
        for peer in sources:
            self.received[(op, peer)].add(nbytes)

    def bytes_contributed(self, op: str | None = None) -> int:
        """Total bytes handed to MPI (all operations, or only ``op``)."""
        return sum(c.bytes for k, c in self.contributed.items() if op is None or k == op)

    def bytes_sent(self, op: str | None = None, peer: int | None = None) -> int:
        """Total bytes sent, optionally restricted to one operation and/or one destination."""
        return sum(
            c.bytes
            for (o, p), c in self.sent.items()
            if (op is None or o == op) and (peer is None or p == peer)
        )

    def bytes_received(self, op: str | None = None, peer: int | None = None) -> int:
        """Total bytes received, optionally restricted to one operation and/or one source."""
        return sum(
            c.bytes
            for (o, p), c in self.received.items()
            if (op is None or o == op) and (peer is None or p == peer)
        )

    def messages_sent(self, op: str | None = None) -> int:
        """Number of messages sent (one per peer per call)."""
        return sum(c.messages for (o, _), c in self.sent.items() if op is None or o == op)

    def links(self) -> dict[tuple[int, int], int]:
        """Bytes per directed link ``(src, dst)`` over all operations (src is this rank)."""
        out: dict[tuple[int, int], int] = defaultdict(int)
        for (_, peer), c in self.sent.items():
            out[(self.rank, peer)] += c.bytes
        return dict(out)

    def totals(self) -> dict[str, int]:
        """The three headline totals, as a plain dict (for metrics files and stats())."""
        return {
            "bytes_contributed": self.bytes_contributed(),
            "bytes_sent": self.bytes_sent(),
            "bytes_received": self.bytes_received(),
        }

    def state_dict(self) -> dict:
        """Every count as plain data (``{op: [messages, bytes]}``, peers as ``op@peer``), for checkpoints."""
        return {"contributed": {op: [c.messages, c.bytes] for op, c in self.contributed.items()},
                "sent": {f"{op}@{peer}": [c.messages, c.bytes] for (op, peer), c in self.sent.items()},
                "received": {f"{op}@{peer}": [c.messages, c.bytes] for (op, peer), c in self.received.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Replace every count by those of :meth:`state_dict` (a resumed run's totals go on from there)."""
        self.reset()
        for op, (messages, nbytes) in state["contributed"].items():
            self.contributed[op] = Count(int(messages), int(nbytes))
        for table, saved in ((self.sent, state["sent"]), (self.received, state["received"])):
            for key, (messages, nbytes) in saved.items():
                op, _, peer = key.rpartition("@")
                table[(op, int(peer))] = Count(int(messages), int(nbytes))

    def reset(self) -> None:
        """Forget everything booked so far."""
        self.contributed.clear()
        self.sent.clear()
        self.received.clear()

"""The Ledger: what one rank put on the wire, per operation and per link.

Two views are kept, because collectives do not all have a meaningful per-link picture:

* ``contributed``: bytes of the buffer this rank handed to MPI, once per call. This is the number
  papers quote as "bits per parameter per step" (a compressed allgather contributes its payload once).
* ``links``: bytes this rank sent to (and received from) each peer. Exact for the neighbour
  collectives and for allgather/alltoall/bcast, whose traffic is defined point to point. For
  ``allreduce`` the routing is chosen by MPI, so it is booked against peer ``ANY`` (-1) at the
  bandwidth-optimal volume ``2 (n - 1) / n * nbytes`` (what ring and Rabenseifner allreduce send).

Every booking also names the link class it crossed: ``"intra"`` (between ranks of one node: the
node Communicator of the two-level collectives) or ``"inter"`` (between nodes; everything a flat
Communicator moves, so a flat run books all its traffic there). ``bytes_sent_intra`` and
``bytes_sent_inter`` in :meth:`Ledger.totals` split ``bytes_sent`` so.

No MPI import: the Communicator reports into a Ledger; algorithms and benchmarks read it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .pausable import Pausable

__all__ = ["ANY", "Count", "LINKS", "Ledger"]

LINKS = ("intra", "inter")
"""Link classes: between ranks of one node, between nodes (as :data:`mpicomm.net.LINKS`)."""

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
        self.sent_by_link: dict[str, Count] = defaultdict(Count)
        self.received_by_link: dict[str, Count] = defaultdict(Count)

    def record(self, op: str, nbytes: int, sends: dict[int, int], recvs: dict[int, int],
               link: str = "inter") -> None:
        """Book one call of ``op`` that handed ``nbytes`` to MPI, sent ``sends[peer]`` and received ``recvs[peer]``
        over link class ``link``."""
        if self.is_paused:
            return
        if link not in LINKS:
            raise ValueError(f"link must be one of {LINKS}, got {link!r}")
        self.contributed[op].add(nbytes)
        for peer, n in sends.items():
            self.sent[(op, peer)].add(n)
            self.sent_by_link[link].add(n)
        for peer, n in recvs.items():
            self.received[(op, peer)].add(n)
            self.received_by_link[link].add(n)

    def record_uniform(self, op: str, nbytes: int, dests, sources, link: str = "inter") -> None:
        """Book one call that sent ``nbytes`` to each of ``dests`` and received as much from each of ``sources``
        (a peer listed twice, as both neighbours of a 2-ring, is booked twice)."""
        if self.is_paused:
            return
        if link not in LINKS:
            raise ValueError(f"link must be one of {LINKS}, got {link!r}")
        self.contributed[op].add(nbytes)
        for peer in dests:
            self.sent[(op, peer)].add(nbytes)
            self.sent_by_link[link].add(nbytes)
        for peer in sources:
            self.received[(op, peer)].add(nbytes)
            self.received_by_link[link].add(nbytes)

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

    def bytes_sent_on(self, link: str) -> int:
        """Total bytes sent over link class ``link`` (``"intra"`` or ``"inter"``)."""
        return self.sent_by_link[link].bytes if link in self.sent_by_link else 0

    def bytes_received_on(self, link: str) -> int:
        """Total bytes received over link class ``link``."""
        return self.received_by_link[link].bytes if link in self.received_by_link else 0

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
        """The headline totals, as a plain dict (for metrics files and stats()): contributed, sent, received,
        and sent split by link class."""
        return {
            "bytes_contributed": self.bytes_contributed(),
            "bytes_sent": self.bytes_sent(),
            "bytes_received": self.bytes_received(),
            "bytes_sent_intra": self.bytes_sent_on("intra"),
            "bytes_sent_inter": self.bytes_sent_on("inter"),
        }

    def state_dict(self) -> dict:
        """Every count as plain data (``{op: [messages, bytes]}``, peers as ``op@peer``), for checkpoints."""
        return {"contributed": {op: [c.messages, c.bytes] for op, c in self.contributed.items()},
                "sent": {f"{op}@{peer}": [c.messages, c.bytes] for (op, peer), c in self.sent.items()},
                "received": {f"{op}@{peer}": [c.messages, c.bytes] for (op, peer), c in self.received.items()},
                "links": {"sent": {k: [c.messages, c.bytes] for k, c in self.sent_by_link.items()},
                          "received": {k: [c.messages, c.bytes] for k, c in self.received_by_link.items()}}}

    def load_state_dict(self, state: dict) -> None:
        """Replace every count by those of :meth:`state_dict` (a resumed run's totals go on from there)."""
        self.reset()
        for op, (messages, nbytes) in state["contributed"].items():
            self.contributed[op] = Count(int(messages), int(nbytes))
        for table, saved in ((self.sent, state["sent"]), (self.received, state["received"])):
            for key, (messages, nbytes) in saved.items():
                op, _, peer = key.rpartition("@")
                table[(op, int(peer))] = Count(int(messages), int(nbytes))
        links = state.get("links")
        if links is None:  # saved before link classes were booked: all of it went between nodes
            links = {"sent": {"inter": [self.messages_sent(), self.bytes_sent()]},
                     "received": {"inter": [sum(c.messages for c in self.received.values()), self.bytes_received()]}}
        for table, saved in ((self.sent_by_link, links["sent"]), (self.received_by_link, links["received"])):
            for link, (messages, nbytes) in saved.items():
                table[link] = Count(int(messages), int(nbytes))

    def reset(self) -> None:
        """Forget everything booked so far."""
        self.contributed.clear()
        self.sent.clear()
        self.received.clear()
        self.sent_by_link.clear()
        self.received_by_link.clear()

"""Cost of each collective on a modelled network: the alpha-beta (latency-bandwidth) model.

Every rank has one full-duplex link of bandwidth ``beta`` (bytes/s) each way and one-way latency
``alpha`` (the picture of a switched cluster, and of the veth-and-bridge network that
``scripts/netshape.sh`` builds). A message of ``m`` bytes costs ``alpha + m / beta``. The collectives
use the algorithms MPICH picks (Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication
Operations in MPICH", IJHPCA 2005), for ``n`` ranks and ``s = ceil(log2 n)`` steps:

=====================  ======================================  =====================================
operation              algorithm                               time
=====================  ======================================  =====================================
neighbour collectives  all neighbours at once over one link    ``alpha + max(out, in) / beta``
allreduce, m <= 2 KiB  recursive doubling                      ``s (alpha + m / beta)``
allreduce, m > 2 KiB   Rabenseifner (recursive halving         ``2 s alpha + 2(n-1)/n * m / beta``
                       reduce-scatter + recursive doubling
                       allgather)
allgather              ring (``m`` = one rank's contribution)   ``(n-1) (alpha + m / beta)``
alltoall               pairwise exchange (``m`` = send buffer)  ``(n-1) alpha + (n-1)/n * m / beta``
alltoallv              one message per peer with traffic        ``k alpha + max(out, in) / beta``
bcast                  binomial tree                           ``ceil(log2 n) (alpha + m / beta)``
barrier                dissemination                           ``ceil(log2 n) alpha``
=====================  ======================================  =====================================

The allreduce switches algorithm at :data:`SHORT_ALLREDUCE_BYTES` (MPICH's
``MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE``), and one formula, :func:`allreduce_seconds`, prices it everywhere (the
measured model scales its tables with it too). For a rank count that is not a power of two MPICH folds the
extra ranks in with one more exchange of the whole buffer before and after; the model instead rounds the steps
up and keeps the bandwidth-optimal volume ``2(n-1)/n m``, the volume the Ledger books.

``out``/``in`` are the bytes this rank sends to / receives from all its neighbours (alltoallv: all its
peers, ``k`` of them at most either way) together (they share its link). With one rank nothing crosses the
network and every cost is zero.

The two-level collectives add a reduce-scatter (ring, ``(n-1) alpha + (n-1)/n * m / beta`` for an
``m``-byte input) and an allgather of unequal parts (ring, each of its ``n-1`` rounds as long as the
largest part). With two link classes (:class:`~mpicomm.net.spec.NetLinks`) :meth:`CostModel.on` gives
the model of one class: the Communicator of a node prices its calls on ``intra``, every other
Communicator on ``inter``.

**A flat allreduce over nodes** (:func:`allreduce_across_nodes`; the planner's price, not what the Communicator
charges): ``N`` nodes of ``L`` consecutive ranks, each node behind one network card. Both algorithms pair
rank ``r`` with ``r XOR 2^k`` at step ``k``, nearest first, so the first ``log2 L`` steps stay inside the node
(on ``intra``) and the last ``log2 N`` cross the card, all ``L`` ranks of the node at once. Rabenseifner
halves the data at every step of its reduce-scatter: the crossing steps carry ``m (1/L - 1/n)`` per rank,
``m (1 - 1/N)`` through the card, the volume of an ``N``-rank allreduce, so the flat allreduce costs an
``L``-rank one on ``intra`` plus an ``N``-rank one on ``inter``. Recursive doubling sends the whole buffer at
every step: each crossing step carries ``L m`` through the card.
"""

from __future__ import annotations

import math

from .spec import LINKS, NetLinks, NetSpec

__all__ = ["SHORT_ALLREDUCE_BYTES", "CostModel", "allreduce_across_nodes", "allreduce_seconds", "card_shared_extra"]

SHORT_ALLREDUCE_BYTES = 2048
"""The largest allreduce buffer (bytes) priced as recursive doubling; larger ones are Rabenseifner's (MPICH's
default ``MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE``)."""


def _steps(n: int) -> int:
    """Steps of a recursive doubling or halving over ``n`` ranks: ``ceil(log2 n)``."""
    return max(0, (n - 1).bit_length())


def allreduce_seconds(alpha: float, seconds_per_byte: float, nbytes: float, n: int) -> float:
    """Allreduce of an ``nbytes`` buffer over ``n`` ranks with latency ``alpha`` and ``seconds_per_byte`` (1 /
    beta): recursive doubling ``s (alpha + m / beta)`` up to :data:`SHORT_ALLREDUCE_BYTES`, Rabenseifner
    ``2 s alpha + 2 (n-1)/n m / beta`` above, ``s = ceil(log2 n)``; 0 for one rank."""
    if n <= 1:
        return 0.0
    steps = _steps(n)
    if nbytes <= SHORT_ALLREDUCE_BYTES:
        return steps * (alpha + nbytes * seconds_per_byte)
    return 2 * steps * alpha + 2 * (n - 1) / n * nbytes * seconds_per_byte


def allreduce_across_nodes(intra, inter, nbytes: float, nodes: int, per_node: int) -> float:
    """A flat allreduce of ``nbytes`` over ``nodes`` nodes of ``per_node`` consecutive ranks whose card is shared
    (see the module docstring): the steps inside the node on ``intra``, the crossing steps on ``inter`` as an
    allreduce over ``nodes`` ranks, plus, for recursive doubling, the other ``per_node - 1`` ranks' buffers
    through the card at each crossing step. ``intra``/``inter``: models with ``allreduce`` and ``beta``."""
    inside = intra.allreduce(nbytes, per_node)
    return inside + inter.allreduce(nbytes, nodes) + card_shared_extra(inter, nbytes, nodes, per_node)


def card_shared_extra(inter, nbytes: float, nodes: int, per_node: int) -> float:
    """What a flat allreduce's crossing steps cost beyond an ``nodes``-rank allreduce of the same buffer: under
    recursive doubling (``nbytes <= SHORT_ALLREDUCE_BYTES``) ``ceil(log2 nodes) (per_node - 1) nbytes / beta``;
    nothing under Rabenseifner, whose crossing steps carry an ``nodes``-rank allreduce's volume."""
    if nodes <= 1 or per_node <= 1 or nbytes > SHORT_ALLREDUCE_BYTES:
        return 0.0
    return _steps(nodes) * (per_node - 1) * nbytes / inter.beta


class CostModel:
    """Seconds each operation takes on the network ``spec`` (pure arithmetic, no MPI)."""

    def __init__(self, spec: NetSpec | NetLinks):
        self.spec = spec
        inter = spec.link("inter")
        self.alpha = inter.latency_s
        self.beta = inter.bytes_per_s
        self._links = {name: self if spec.link(name) == inter else CostModel(spec.link(name)) for name in LINKS}

    def on(self, link: str) -> CostModel:
        """The model of link class ``link`` (``"intra"`` or ``"inter"``); itself with one setting for both."""
        if link not in self._links:
            raise ValueError(f"link class must be one of {', '.join(LINKS)}, got {link!r}")
        return self._links[link]

    def message(self, nbytes: int) -> float:
        """One point-to-point message: ``alpha + m / beta``."""
        return self.alpha + nbytes / self.beta

    def neighbor(self, out_bytes: int, in_bytes: int) -> float:
        """A neighbour collective that sends ``out_bytes`` and receives ``in_bytes`` in total."""
        if out_bytes == 0 and in_bytes == 0:
            return 0.0
        return self.alpha + max(out_bytes, in_bytes) / self.beta

    def allreduce(self, nbytes: int, n: int) -> float:
        """Allreduce of an ``nbytes`` buffer over ``n`` ranks: recursive doubling up to
        :data:`SHORT_ALLREDUCE_BYTES`, Rabenseifner above (:func:`allreduce_seconds`)."""
        return allreduce_seconds(self.alpha, 1 / self.beta, nbytes, n)

    def reduce_scatter(self, nbytes: int, n: int) -> float:
        """Ring reduce-scatter of an ``nbytes`` input (each rank keeps about ``nbytes / n`` of the sum)."""
        if n <= 1:
            return 0.0
        return (n - 1) * self.alpha + (n - 1) / n * nbytes / self.beta

    def allgatherv(self, largest: int, n: int) -> float:
        """Ring allgather of unequal parts: ``n - 1`` rounds, each as long as the ``largest`` part."""
        return self.allgather(largest, n)

    def allgather(self, nbytes: int, n: int) -> float:
        """Ring allgather where every rank contributes ``nbytes``."""
        if n <= 1:
            return 0.0
        return (n - 1) * (self.alpha + nbytes / self.beta)

    def alltoall(self, nbytes: int, n: int) -> float:
        """Pairwise-exchange all-to-all of an ``nbytes`` send buffer (``nbytes / n`` to each rank)."""
        if n <= 1:
            return 0.0
        return (n - 1) * self.alpha + (n - 1) / n * nbytes / self.beta

    def alltoallv(self, out_bytes: int, in_bytes: int, peers: int) -> float:
        """An all-to-all of unequal parts that sends ``out_bytes`` to and receives ``in_bytes`` from other ranks,
        one message each to or from at most ``peers`` of them."""
        if peers == 0:
            return 0.0
        return peers * self.alpha + max(out_bytes, in_bytes) / self.beta

    def bcast(self, nbytes: int, n: int) -> float:
        """Binomial-tree broadcast of ``nbytes``."""
        if n <= 1:
            return 0.0
        return math.ceil(math.log2(n)) * (self.alpha + nbytes / self.beta)

    def barrier(self, n: int) -> float:
        """Dissemination barrier."""
        if n <= 1:
            return 0.0
        return math.ceil(math.log2(n)) * self.alpha

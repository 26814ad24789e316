"""Cost of each collective on a modelled network: the alpha-beta (latency-bandwidth) model.

Every rank has one full-duplex link of bandwidth ``beta`` (bytes/s) each way and one-way latency
``alpha`` (the picture of a switched cluster, and of the veth-and-bridge network that
``scripts/netshape.sh`` builds). A message of ``m`` bytes costs ``alpha + m / beta``. The collectives
use the textbook algorithms MPI libraries pick for large messages (Thakur, Rabenseifner & Gropp,
"Optimization of Collective Communication Operations in MPICH", IJHPCA 2005), for ``n`` ranks:

=====================  ======================================  =====================================
operation              algorithm                               time
=====================  ======================================  =====================================
neighbour collectives  all neighbours at once over one link    ``alpha + max(out, in) / beta``
allreduce              ring (reduce-scatter + allgather)        ``2(n-1) alpha + 2(n-1)/n * m / beta``
allgather              ring (``m`` = one rank's contribution)   ``(n-1) (alpha + m / beta)``
alltoall               pairwise exchange (``m`` = send buffer)  ``(n-1) alpha + (n-1)/n * m / beta``
alltoallv              one message per peer with traffic        ``k alpha + max(out, in) / beta``
bcast                  binomial tree                           ``ceil(log2 n) (alpha + m / beta)``
barrier                dissemination                           ``ceil(log2 n) alpha``
=====================  ======================================  =====================================

``out``/``in`` are the bytes this rank sends to / receives from all its neighbours (alltoallv: all its
peers, ``k`` of them at most either way) together (they share its link). With one rank nothing crosses the
network and every cost is zero.

The two-level collectives add a reduce-scatter (ring, ``(n-1) alpha + (n-1)/n * m / beta`` for an
``m``-byte input) and an allgather of unequal parts (ring, each of its ``n-1`` rounds as long as the
largest part). With two link classes (:class:`~mpicomm.net.spec.NetLinks`) :meth:`CostModel.on` gives
the model of one class: the Communicator of a node prices its calls on ``intra``, every other
Communicator on ``inter`` (a flat collective over several nodes is as slow as its slowest link).
"""

from __future__ import annotations

import math

from .spec import LINKS, NetLinks, NetSpec

__all__ = ["CostModel"]


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
        """Ring allreduce of an ``nbytes`` buffer over ``n`` ranks."""
        if n <= 1:
            return 0.0
        return 2 * (n - 1) * self.alpha + 2 * (n - 1) / n * nbytes / self.beta

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

"""Mixing topologies for decentralized training: pure data (numpy only, no MPI).

A :class:`Topology` holds an ``n x n`` mixing matrix ``W`` (float64, read-only). Gossip reads

    x_i  <-  sum_j W[i, j] x_j

so rank ``i`` *receives* from its in-neighbours ``{j != i : W[i, j] > 0}`` and *sends* to its
out-neighbours ``{k != i : W[k, i] > 0}``. A :class:`Schedule` is a cyclic sequence of topologies (a
time-varying graph); a ``Topology`` is a schedule of period 1.

Two modules, re-exported here (``topology.ring(8)``, ``from mpicomm.topology import Topology``):

* :mod:`.mixing`: the :class:`Topology` and :class:`Schedule` types, :func:`from_matrix` for a user's
  doubly stochastic ``W``, and the checks on a matrix (stochasticity, connectivity, spectral gap).
* :mod:`.graphs`: the graph families (:func:`ring`, :func:`torus`, :func:`exponential`, ..., and the one-peer
  schedules such as :func:`alternating_ring`), their weight rules, and :func:`build` from a name in
  :data:`TOPOLOGIES`.
"""

from __future__ import annotations

from .graphs import (
    TOPOLOGIES,
    WEIGHT_RULES,
    alternating_ring,
    build,
    complete,
    default_degree,
    exponential,
    from_edges,
    hypercube,
    one_peer_exponential,
    one_peer_hypercube,
    random_regular,
    ring,
    ring_degree,
    star,
    torus,
)
from .mixing import Schedule, Topology, from_matrix

__all__ = [
    "TOPOLOGIES",
    "WEIGHT_RULES",
    "Schedule",
    "Topology",
    "alternating_ring",
    "build",
    "complete",
    "default_degree",
    "exponential",
    "from_edges",
    "from_matrix",
    "hypercube",
    "one_peer_exponential",
    "one_peer_hypercube",
    "random_regular",
    "ring",
    "ring_degree",
    "star",
    "torus",
]

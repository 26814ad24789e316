"""The graph families: builders of doubly stochastic mixing matrices, and the registry that names them.

Every builder returns a :class:`~mpicomm.topology.mixing.Topology` (or, for the one-peer graphs, a
:class:`~mpicomm.topology.mixing.Schedule`) whose ``W`` is doubly stochastic (rows and columns
sum to 1), so gossip preserves the average. :func:`build` makes one from its name in :data:`TOPOLOGIES`.

Weights for an undirected graph (d_i = degree of i, D = max_i d_i), with W_ii = 1 - sum_{j != i} W_ij:

    uniform:     W_ij = 1 / (D + 1)                for every edge (max-degree weights)
    metropolis:  W_ij = 1 / (1 + max(d_i, d_j))    (Metropolis-Hastings weights)

Both are symmetric and doubly stochastic for any undirected graph (L. Xiao and S. Boyd, "Fast linear
iterations for distributed averaging", Systems & Control Letters 53, 2004).

Exponential graphs and the one-peer schedule follow B. Ying, K. Yuan, Y. Chen, H. Hu, P. Pan, W. Yin,
"Exponential Graph is Provably Efficient for Decentralized Deep Training", NeurIPS 2021: for n a power of
two the product of the one-peer matrices over one period is exactly ``11^T/n``.

The pairwise one-peer schedules (:func:`alternating_ring`, :func:`one_peer_hypercube`) pair the ranks up at
every step: each rank exchanges with exactly one partner and keeps ``W_ii = W_ij = 1/2``, so each step's W
is symmetric and doubly stochastic and a rank sends one model per step (half a static ring's bytes, n > 2).
"""

from __future__ import annotations

import functools
import math
from numbers import Integral
from typing import Callable, Union

import numpy as np

from .mixing import Schedule, Topology, _check_int, _strongly_connected, from_matrix

__all__ = [
    "TOPOLOGIES",
    "WEIGHT_RULES",
    "alternating_ring",
    "build",
    "complete",
    "default_degree",
    "exponential",
    "from_edges",
    "hypercube",
    "one_peer_exponential",
    "one_peer_hypercube",
    "random_regular",
    "ring",
    "ring_degree",
    "star",
    "torus",
]

WEIGHT_RULES = ("uniform", "metropolis")
_RANDOM_REGULAR_ATTEMPTS = 1000


def _check_size(n) -> int:
    """Validate the number of ranks."""
    return _check_int("n", n, 1)


def _check_rule(weights) -> str:
    """Return ``weights`` if it names a weight rule, else raise ValueError listing the valid ones."""
    if weights not in WEIGHT_RULES:
        raise ValueError(f"weights must be one of {', '.join(map(repr, WEIGHT_RULES))}, got {weights!r}")
    return weights


def _is_power_of_two(n: int) -> bool:
    """True for n = 1, 2, 4, 8, ..."""
    return n & (n - 1) == 0


def _label(kind: str, *parts, weights: str = "uniform", default: str = "uniform") -> str:
    """Name such as ``ring(8)`` or ``ring(8, metropolis)`` (the rule is shown only when not the default)."""
    shown = [str(p) for p in parts] + ([weights] if weights != default else [])
    return f"{kind}({', '.join(shown)})"


def _weighted(adj: np.ndarray, rule: str, name: str) -> Topology:
    """Apply a weight rule to a symmetric boolean adjacency matrix with an empty diagonal."""
    degree = adj.sum(axis=1)
    if rule == "uniform":
        W = adj / (degree.max() + 1.0)
    else:
        W = adj / (1.0 + np.maximum.outer(degree, degree))
    np.fill_diagonal(W, 1.0 - W.sum(axis=1))
    return from_matrix(W, name)


def from_edges(n: int, edges, weights: str = "uniform", name: str = "custom") -> Topology:
    """A symmetric Topology on ``n`` ranks from undirected ``edges`` (pairs; repeats collapse)."""
    n = _check_size(n)
    rule = _check_rule(weights)
    adj = np.zeros((n, n), dtype=bool)
    for edge in edges:
        try:
            a, b = edge
        except (TypeError, ValueError):
            raise ValueError(f"edges must hold pairs (a, b), got {edge!r}") from None
        a, b = _check_int("edges endpoint", a, 0, n), _check_int("edges endpoint", b, 0, n)
        if a == b:
            raise ValueError(f"edges must not contain self-loops, got {edge!r}")
        adj[a, b] = adj[b, a] = True
    return _weighted(adj, rule, name)


def _circulant(n: int, offsets) -> np.ndarray:
    """Boolean adjacency with ``i ~ (i + o) mod n`` for every offset; repeats and self-loops dropped."""
    adj = np.zeros((n, n), dtype=bool)
    rows = np.arange(n)
    for o in offsets:
        adj[rows, (rows + o) % n] = True
    np.fill_diagonal(adj, False)
    return adj


def _hops(n: int) -> list[int]:
    """Distances 2^k for k = 0..floor(log2(n - 1)) (empty for n = 1)."""
    return [1 << k for k in range((n - 1).bit_length())]


def ring(n: int, weights: str = "uniform") -> Topology:
    """Cycle: each rank talks to ``i - 1`` and ``i + 1`` (one neighbour for n = 2)."""
    n, rule = _check_size(n), _check_rule(weights)
    return _weighted(_circulant(n, (1, -1)), rule, _label("ring", n, weights=rule))


@functools.lru_cache(maxsize=64)
def ring_degree(n: int) -> int:
    """Out-degree of :func:`ring` on ``n`` ranks (0 for one rank)."""
    return len(ring(n).out_neighbors(0)) if n > 1 else 0


def _torus_rows(n: int, rows) -> int:
    """Validate or choose the number of grid rows of a torus on ``n`` ranks."""
    if n <= 3:
        valid = sorted({1, n})
    else:
        valid = [r for r in range(2, n // 2 + 1) if n % r == 0]
        if not valid:
            raise ValueError(
                f"n={n} is prime, so it has no r x c grid with r, c >= 2; torus needs n in "
                "{1, 2, 3} or a composite n (4, 6, 8, 9, ...); use ring(n) instead"
            )
    if rows is None:
        return max(r for r in valid if r * r <= n)
    if isinstance(rows, bool) or not isinstance(rows, Integral) or rows not in valid:
        raise ValueError(f"rows must divide n={n} and be one of {valid}, got {rows!r}")
    return int(rows)


def torus(n: int, rows: int | None = None, weights: str = "uniform") -> Topology:
    """2-D wrap-around grid of ``rows x (n // rows)`` ranks; ``rows=None`` picks the squarest grid."""
    n, rule = _check_size(n), _check_rule(weights)
    r = _torus_rows(n, rows)
    grid = np.arange(n).reshape(r, n // r)
    adj = np.zeros((n, n), dtype=bool)
    for axis in (0, 1):
        for shift in (1, -1):
            adj[grid.ravel(), np.roll(grid, shift, axis=axis).ravel()] = True
    np.fill_diagonal(adj, False)
    return _weighted(adj, rule, _label("torus", n, f"{r}x{n // r}", weights=rule))


def exponential(n: int, symmetric: bool = True, weights: str = "uniform") -> Topology:
    """Exponential graph: neighbours at distance 2^k, k = 0..floor(log2(n - 1)).

    ``symmetric=True`` links ``i`` with ``i +- 2^k`` under a weight rule. ``symmetric=False`` is the
    directed graph of Ying et al. (2021): ``i`` receives from ``i - 2^k`` and sends to ``i + 2^k``, every
    weight (self included) ``1 / (#hops + 1)``; only ``weights="uniform"`` applies to it.
    """
    n, rule = _check_size(n), _check_rule(weights)
    if not isinstance(symmetric, bool):
        raise ValueError(f"symmetric must be a bool, got {symmetric!r}")
    hops = _hops(n)
    if symmetric:
        adj = _circulant(n, hops + [-h for h in hops])
        return _weighted(adj, rule, _label("exponential", n, weights=rule))
    if rule != "uniform":
        raise ValueError(f"weights must be 'uniform' for the directed exponential graph, got {rule!r}")
    W = np.eye(n) / (len(hops) + 1)
    rows = np.arange(n)
    for h in hops:
        W[rows, (rows - h) % n] = 1.0 / (len(hops) + 1)
    return from_matrix(W, _label("exponential", n, "directed"))


def hypercube(n: int) -> Topology:
    """Hypercube on n = 2^d ranks: ``i`` talks to ``i XOR 2^k``; every weight ``1 / (d + 1)``."""
    n = _check_size(n)
    if not _is_power_of_two(n):
        raise ValueError(f"n must be a power of two (1, 2, 4, 8, ...) for a hypercube, got {n}")
    adj = np.zeros((n, n), dtype=bool)
    rows = np.arange(n)
    for k in range(n.bit_length() - 1):
        adj[rows, rows ^ (1 << k)] = True
    return _weighted(adj, "uniform", _label("hypercube", n))


def complete(n: int) -> Topology:
    """Every rank talks to every other: ``W = 11^T / n`` (exact averaging, spectral gap 1)."""
    n = _check_size(n)
    return from_matrix(np.full((n, n), 1.0 / n), _label("complete", n))


def star(n: int, weights: str = "metropolis") -> Topology:
    """Rank 0 is the hub linked to every other rank; leaves talk only to the hub."""
    n, rule = _check_size(n), _check_rule(weights)
    adj = np.zeros((n, n), dtype=bool)
    adj[0, 1:] = adj[1:, 0] = True
    return _weighted(adj, rule, _label("star", n, weights=rule, default="metropolis"))


def _pair_stubs(n: int, degree: int, rng: np.random.Generator) -> np.ndarray | None:
    """One try at a simple ``degree``-regular graph: pair random stubs, re-pairing the ones that clash.

    Returns the boolean adjacency, or None when the leftover stubs cannot form any new edge.
    """
    adj = np.zeros((n, n), dtype=bool)
    stubs = np.repeat(np.arange(n), degree)
    for _ in range(n * degree + 1):
        left = []
        for a, b in rng.permutation(stubs).reshape(-1, 2).tolist():
            if a != b and not adj[a, b]:
                adj[a, b] = adj[b, a] = True
            else:
                left += [a, b]
        if not left:
            return adj
        stubs = np.array(left, dtype=np.int64)
        nodes = np.unique(stubs)
        free = ~adj[np.ix_(nodes, nodes)]
        np.fill_diagonal(free, False)
        if not free.any():
            return None
    return None


def default_degree(n: int) -> int:
    """The degree ``random_regular`` takes when none is given: about log2(n), at least 2, below n, n*degree even."""
    if n <= 2:
        return n - 1
    degree = min(n - 1, max(2, round(math.log2(n))))
    return degree + 1 if (n * degree) % 2 and degree + 1 < n else degree


def random_regular(n: int, degree: int | None = None, seed: int = 0) -> Topology:
    """A connected random ``degree``-regular graph, reproducible from ``seed`` (uniform weights).

    ``degree`` None: :func:`default_degree` (about log2 n, like the exponential graph). Stubs are paired at
    random and clashing pairs re-drawn (Steger & Wormald, 1999; near-uniform for small degree);
    disconnected draws are rejected. Raises RuntimeError if no connected graph is found within a bounded
    number of attempts.
    """
    n = _check_size(n)
    degree = _check_int("degree", default_degree(n) if degree is None else degree, 0, n)
    seed = _check_int("seed", seed, 0)
    if (n * degree) % 2:
        raise ValueError(f"n * degree must be even (a regular graph has n*degree/2 edges), got n={n}, "
                         f"degree={degree}")
    if (n > 1 and degree == 0) or (n > 2 and degree == 1):
        raise ValueError(f"degree must be >= {1 if n == 2 else 2} for a connected graph on n={n} ranks, "
                         f"got {degree}")
    rng = np.random.default_rng(seed)
    for _ in range(_RANDOM_REGULAR_ATTEMPTS):
        adj = _pair_stubs(n, degree, rng)
        if adj is not None and _strongly_connected(adj):
            return _weighted(adj, "uniform", _label("random_regular", n, degree, f"seed={seed}"))
    raise RuntimeError(f"no connected {degree}-regular graph on {n} ranks found in "
                       f"{_RANDOM_REGULAR_ATTEMPTS} attempts (seed={seed})")


def one_peer_exponential(n: int) -> Schedule:
    """One-peer exponential schedule: at step t, ``i`` receives from ``i - 2^k``, k = t mod log2(n).

    Each step ``W = (I + P^(2^k)) / 2`` (half self, half the one peer; ``i`` sends to ``i + 2^k``). For n
    a power of two the product over one period of log2(n) steps is exactly ``11^T / n``.
    """
    n = _check_size(n)
    if not _is_power_of_two(n):
        raise ValueError(f"n must be a power of two (1, 2, 4, 8, ...) for one_peer_exponential, got {n}")
    name = _label("one_peer_exponential", n)
    if n == 1:
        return Schedule((from_matrix(np.ones((1, 1)), f"{name}[0]"),), name)
    rows = np.arange(n)
    steps = []
    for k, h in enumerate(_hops(n)):
        W = np.eye(n) / 2
        W[rows, (rows - h) % n] += 0.5
        steps.append(from_matrix(W, f"{name}[{k}]"))
    return Schedule(tuple(steps), name)


def _pairing(n: int, pairs, name: str) -> Topology:
    """One step of a pairwise schedule: ``W_ii = W_ij = 1/2`` for each pair (i, j), ``W_kk = 1`` for a rank
    in no pair. The pairs must be disjoint."""
    W = np.eye(n)
    for a, b in pairs:
        W[a, a] = W[b, b] = W[a, b] = W[b, a] = 0.5
    return from_matrix(W, name)


def alternating_ring(n: int) -> Schedule:
    """One-peer ring: the ring's edges split into two pairings that alternate, one partner per rank per step.

    Step ``2t`` uses the *even* pairing (0, 1), (2, 3), (4, 5), ...; step ``2t + 1`` the *odd* pairing (1, 2),
    (3, 4), ..., (n - 1, 0). Partners average, ``W_ii = W_ij = 1/2``, so every step's W is symmetric and
    doubly stochastic and a rank sends its model to one peer per step, where :func:`ring` sends it to two.
    These are the two pairings of decent-dp 0.2.3's ``ring`` topology (``RingTopology`` in
    ``src/decent_dp/topo.py`` of github.com/WangZesen/Decent-DP: pairs (i, i + 1), then (i, i - 1), for even
    i, weight 0.5), up to which pairing a run starts with. The steps are named ``alternating_ring(n)[even]``
    and ``alternating_ring(n)[odd]``.

    Odd n (decent-dp refuses it): the pairings cannot cover every rank, so one rank sits out each step and
    keeps its model (``W_ii = 1``): rank n - 1 in the even pairing, rank 0 in the odd one (which pairs (1, 2),
    ..., (n - 2, n - 1)). The edge (n - 1, 0) is then never used; the union of the two pairings is the path
    0 - 1 - ... - n - 1, connected, so the product over a period still has a positive spectral gap (smaller
    than the ring's). n = 2: both pairings are the single edge (0, 1). n = 1: one step, ``W = [1]``.
    """
    n = _check_size(n)
    name = _label("alternating_ring", n)
    if n == 1:
        return Schedule((from_matrix(np.ones((1, 1)), f"{name}[even]"),), name)
    even = [(i, i + 1) for i in range(0, n - 1, 2)]
    odd = [(i, (i + 1) % n) for i in range(1, n if n % 2 == 0 else n - 1, 2)]
    return Schedule((_pairing(n, even, f"{name}[even]"), _pairing(n, odd, f"{name}[odd]")), name)


def one_peer_hypercube(n: int) -> Schedule:
    """Pairwise one-peer exponential graph on n = 2^k ranks: at step t, ``i`` pairs with ``i XOR 2^(t mod k)``.

    Each step is a perfect matching along one dimension of the hypercube, ``W_ii = W_ij = 1/2`` (symmetric,
    doubly stochastic, one partner per rank). The product over one period of k steps is exactly ``11^T / n``
    (each step averages the pairs along one dimension), as for :func:`one_peer_exponential`, but every
    exchange is a swap between two ranks rather than a shift around the ring. Steps are named
    ``one_peer_hypercube(n)[d]``, d the dimension.
    """
    n = _check_size(n)
    if not _is_power_of_two(n):
        raise ValueError(f"n must be a power of two (1, 2, 4, 8, ...) for one_peer_hypercube, got {n}")
    name = _label("one_peer_hypercube", n)
    if n == 1:
        return Schedule((from_matrix(np.ones((1, 1)), f"{name}[0]"),), name)
    steps = []
    for d in range(n.bit_length() - 1):
        pairs = [(i, i ^ (1 << d)) for i in range(n) if not i & (1 << d)]
        steps.append(_pairing(n, pairs, f"{name}[{d}]"))
    return Schedule(tuple(steps), name)


TOPOLOGIES: dict[str, Callable[..., Union[Topology, Schedule]]] = {
    "ring": ring,
    "torus": torus,
    "exponential": exponential,
    "hypercube": hypercube,
    "complete": complete,
    "star": star,
    "random_regular": random_regular,
    "one_peer_exponential": one_peer_exponential,
    "alternating_ring": alternating_ring,
    "one_peer_hypercube": one_peer_hypercube,
}


def build(name: str, n: int, **kwargs) -> Union[Topology, Schedule]:
    """Build the topology registered as ``name`` in :data:`TOPOLOGIES` on ``n`` ranks."""
    if not isinstance(name, str) or name not in TOPOLOGIES:
        raise ValueError(f"unknown topology {name!r}; valid names: {', '.join(sorted(TOPOLOGIES))}")
    return TOPOLOGIES[name](n, **kwargs)

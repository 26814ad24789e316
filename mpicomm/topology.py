"""Mixing topologies for decentralized training: pure data (numpy only, no MPI).

A :class:`Topology` holds an ``n x n`` mixing matrix ``W`` (float64, read-only). Gossip reads

    x_i  <-  sum_j W[i, j] x_j

so rank ``i`` *receives* from its in-neighbours ``{j != i : W[i, j] > 0}`` and *sends* to its
out-neighbours ``{k != i : W[k, i] > 0}``. Every builder returns a doubly stochastic ``W`` (rows and
columns sum to 1), so gossip preserves the average. A :class:`Schedule` is a cyclic sequence of
topologies (a time-varying graph); a ``Topology`` is a schedule of period 1, so callers can use
``at(step)``, ``period``, ``size`` and ``union_in_neighbors``/``union_out_neighbors`` on either.

Weights for an undirected graph (d_i = degree of i, D = max_i d_i), with W_ii = 1 - sum_{j != i} W_ij:

    uniform:     W_ij = 1 / (D + 1)                for every edge (max-degree weights)
    metropolis:  W_ij = 1 / (1 + max(d_i, d_j))    (Metropolis-Hastings weights)

Both are symmetric and doubly stochastic for any undirected graph (L. Xiao and S. Boyd, "Fast linear
iterations for distributed averaging", Systems & Control Letters 53, 2004).

Spectral gap: ``1 - rho`` with ``rho = ||W - 11^T/n||_2``, the second largest *singular value* of a
doubly stochastic W. For symmetric (or any normal, e.g. circulant) W this equals the second largest
``|eigenvalue|``; for non-normal W it is >= that modulus and is the one-step contraction factor
``||W x - mean(x) 1|| <= rho ||x - mean(x) 1||`` that consensus bounds use.

Exponential graphs and the one-peer schedule follow B. Ying, K. Yuan, Y. Chen, H. Hu, P. Pan, W. Yin,
"Exponential Graph is Provably Efficient for Decentralized Deep Training", NeurIPS 2021: for n a power of
two the product of the one-peer matrices over one period is exactly ``11^T/n``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Callable, Union

import numpy as np

__all__ = [
    "TOPOLOGIES",
    "WEIGHT_RULES",
    "Schedule",
    "Topology",
    "build",
    "complete",
    "exponential",
    "from_edges",
    "from_matrix",
    "hypercube",
    "one_peer_exponential",
    "random_regular",
    "ring",
    "star",
    "torus",
]

WEIGHT_RULES = ("uniform", "metropolis")
_GAP_FLOOR = 1e-12  # a spectral gap at or below this is numerically zero: mixing_time() is inf
_RANDOM_REGULAR_ATTEMPTS = 1000


def _check_int(name: str, value, low: int, high: int | None = None) -> int:
    """Return ``value`` as an int, or raise ValueError naming ``name`` unless ``low <= value < high``."""
    want = f"an int >= {low}" if high is None else f"an int in [{low}, {high})"
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be {want}, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value >= high):
        raise ValueError(f"{name} must be {want}, got {value}")
    return int(value)


def _check_size(n) -> int:
    """Validate the number of ranks."""
    return _check_int("n", n, 1)


def _check_rule(weights) -> str:
    """Return ``weights`` if it names a weight rule, else raise ValueError listing the valid ones."""
    if weights not in WEIGHT_RULES:
        raise ValueError(f"weights must be one of {', '.join(map(repr, WEIGHT_RULES))}, got {weights!r}")
    return weights


def _check_tol(tol) -> float:
    """Return ``tol`` as a float, or raise ValueError unless it is a finite number >= 0."""
    if isinstance(tol, bool) or not isinstance(tol, Real) or not math.isfinite(tol) or tol < 0:
        raise ValueError(f"tol must be a finite number >= 0, got {tol!r}")
    return float(tol)


def _is_power_of_two(n: int) -> bool:
    """True for n = 1, 2, 4, 8, ..."""
    return n & (n - 1) == 0


def _label(kind: str, *parts, weights: str = "uniform", default: str = "uniform") -> str:
    """Name such as ``ring(8)`` or ``ring(8, metropolis)`` (the rule is shown only when not the default)."""
    shown = [str(p) for p in parts] + ([weights] if weights != default else [])
    return f"{kind}({', '.join(shown)})"


def _as_weight_matrix(W) -> np.ndarray:
    """Validate shape, dtype, finiteness and sign; return a read-only float64 copy of ``W``."""
    try:
        arr = np.asarray(W)
    except ValueError as err:  # ragged nested sequences
        raise ValueError(f"W must be a square 2-D array of numbers: {err}") from None
    if arr.dtype.kind not in "iuf":
        raise TypeError(f"W must hold real numbers, got dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[0] != arr.shape[1] or arr.shape[0] == 0:
        raise ValueError(f"W must be a non-empty square 2-D array, got shape {arr.shape}")
    out = arr.astype(np.float64) + 0.0  # + 0.0 turns -0.0 into 0.0: equal matrices get equal bytes
    bad = np.argwhere(~np.isfinite(out))
    if bad.size:
        i, j = bad[0]
        raise ValueError(f"W[{i}, {j}] = {out[i, j]} is not finite")
    neg = np.argwhere(out < 0)
    if neg.size:
        i, j = neg[0]
        raise ValueError(f"W[{i}, {j}] = {out[i, j]:.12g} is negative; weights must be >= 0")
    out.setflags(write=False)
    return out


def _stochasticity_error(W: np.ndarray, tol: float) -> str | None:
    """Describe the worst row or column of ``W`` whose sum is off 1 by more than ``tol``; None if none."""
    for axis, what in ((1, "row"), (0, "column")):
        sums = W.sum(axis=axis)
        k = int(np.argmax(np.abs(sums - 1.0)))
        if abs(sums[k] - 1.0) > tol:
            return f"{what} {k} sums to {sums[k]:.12g}, expected 1 (tol {tol:g})"
    return None


def _reaches_all(adj: np.ndarray) -> bool:
    """True if node 0 reaches every node following ``adj[u, v]`` (an edge u -> v)."""
    seen = np.zeros(adj.shape[0], dtype=bool)
    seen[0] = True
    frontier = seen.copy()
    while frontier.any():
        frontier = adj[frontier].any(axis=0) & ~seen
        seen |= frontier
    return bool(seen.all())


def _strongly_connected(adj: np.ndarray) -> bool:
    """True if the directed graph with edges ``adj[u, v]`` is strongly connected."""
    return _reaches_all(adj) and _reaches_all(adj.T)


@dataclass(frozen=True, eq=False, repr=False)
class Topology:
    """A mixing matrix ``W`` with its neighbour structure; also a time-varying schedule of period 1.

    The constructor checks only structure (square, finite, non-negative) and stores a read-only float64
    copy; use :func:`from_matrix` to also require ``W`` to be doubly stochastic (every builder does).
    Equality and hashing use ``name`` and the exact bytes of ``W``; a Topology pickles by value.
    """

    W: np.ndarray
    name: str = "custom"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name must be a non-empty str, got {self.name!r}")
        object.__setattr__(self, "W", _as_weight_matrix(self.W))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Topology):
            return NotImplemented
        return self.name == other.name and np.array_equal(self.W, other.W)

    def __hash__(self) -> int:
        return hash((self.name, self.W.shape, self.W.tobytes()))

    def __repr__(self) -> str:
        return f"Topology(name={self.name!r}, size={self.size})"

    def __reduce__(self):
        return (type(self), (np.array(self.W), self.name))

    def _rank(self, rank) -> int:
        """Validate a rank index."""
        return _check_int("rank", rank, 0, self.size)

    def _support(self) -> np.ndarray:
        """Boolean off-diagonal support: ``[i, j]`` is True when i receives from j."""
        support = self.W > 0
        np.fill_diagonal(support, False)
        return support

    @property
    def size(self) -> int:
        """Number of ranks n."""
        return self.W.shape[0]

    @property
    def period(self) -> int:
        """Always 1: a static topology is a schedule of period one."""
        return 1

    def at(self, step: int) -> Topology:
        """The topology used at ``step`` (this one, for every step >= 0)."""
        _check_int("step", step, 0)
        return self

    def in_neighbors(self, rank: int) -> tuple[int, ...]:
        """Ranks ``j != rank`` with ``W[rank, j] > 0`` (``rank`` receives from them), ascending."""
        r = self._rank(rank)
        return tuple(int(j) for j in np.flatnonzero(self.W[r] > 0) if j != r)

    def out_neighbors(self, rank: int) -> tuple[int, ...]:
        """Ranks ``k != rank`` with ``W[k, rank] > 0`` (``rank`` sends to them), ascending."""
        r = self._rank(rank)
        return tuple(int(k) for k in np.flatnonzero(self.W[:, r] > 0) if k != r)

    def union_in_neighbors(self, rank: int) -> tuple[int, ...]:
        """Same as :meth:`in_neighbors` (the union over a period of one)."""
        return self.in_neighbors(rank)

    def union_out_neighbors(self, rank: int) -> tuple[int, ...]:
        """Same as :meth:`out_neighbors` (the union over a period of one)."""
        return self.out_neighbors(rank)

    def self_weight(self, rank: int) -> float:
        """``W[rank, rank]``: the weight a rank keeps on its own model."""
        r = self._rank(rank)
        return float(self.W[r, r])

    def neighbor_weights(self, rank: int) -> tuple[float, ...]:
        """``W[rank, j]`` for ``j`` in ``in_neighbors(rank)``, in that order."""
        return tuple(float(self.W[rank, j]) for j in self.in_neighbors(rank))

    def edges(self) -> frozenset[tuple[int, int]]:
        """Directed edges ``(src, dst)`` with ``src != dst`` and ``W[dst, src] > 0``."""
        dst, src = np.nonzero(self._support())
        return frozenset(zip(src.tolist(), dst.tolist()))

    def union_edges(self) -> frozenset[tuple[int, int]]:
        """Same as :meth:`edges` (the union over a period of one)."""
        return self.edges()

    def max_degree(self) -> int:
        """Largest in-degree or out-degree over all ranks (0 for n = 1)."""
        support = self._support()
        return int(max(support.sum(axis=1).max(), support.sum(axis=0).max()))

    def is_doubly_stochastic(self, tol: float = 1e-12) -> bool:
        """True if every row and every column of ``W`` sums to 1 within ``tol``."""
        return _stochasticity_error(self.W, _check_tol(tol)) is None

    def is_symmetric(self, tol: float = 1e-12) -> bool:
        """True if ``|W - W^T| <= tol`` entrywise."""
        return bool(np.all(np.abs(self.W - self.W.T) <= _check_tol(tol)))

    def is_connected(self) -> bool:
        """True if the directed graph of W's off-diagonal support is strongly connected."""
        return _strongly_connected(self._support())

    def spectral_gap(self) -> float:
        """``1 - rho`` with ``rho = ||W - 11^T/n||_2`` (second largest singular value); 0 if disconnected.

        For symmetric or normal W, ``rho`` is the second largest ``|eigenvalue|``; for non-normal W it
        bounds that modulus from above and is the one-step contraction factor of gossip. Raises
        ValueError unless W is doubly stochastic (within 1e-9).
        """
        err = _stochasticity_error(self.W, 1e-9)
        if err is not None:
            raise ValueError(f"spectral_gap needs a doubly stochastic W ({self.name}): {err}")
        if self.size == 1:
            return 1.0
        if not self.is_connected():
            return 0.0
        M = self.W - 1.0 / self.size
        # for symmetric M the 2-norm is max |eigenvalue|; eigvalsh is several times faster than an SVD
        rho = np.max(np.abs(np.linalg.eigvalsh(M))) if self.is_symmetric(tol=0.0) else np.linalg.norm(M, 2)
        return float(max(0.0, 1.0 - rho))

    def mixing_time(self) -> float:
        """``log(n) / spectral_gap``: 0 for n = 1, inf if the gap is (numerically) zero."""
        gap = self.spectral_gap()
        return math.inf if gap <= _GAP_FLOOR else math.log(self.size) / gap


@dataclass(frozen=True)
class Schedule:
    """A time-varying topology: step ``t`` mixes with ``topologies[t mod period]``."""

    topologies: tuple[Topology, ...]
    name: str = "schedule"

    def __post_init__(self) -> None:
        if not isinstance(self.topologies, (tuple, list)) or not self.topologies:
            raise ValueError(f"topologies must be a non-empty tuple of Topology, got {self.topologies!r}")
        for k, t in enumerate(self.topologies):
            if not isinstance(t, Topology):
                raise TypeError(f"topologies[{k}] must be a Topology, got {type(t).__name__}")
        sizes = sorted({t.size for t in self.topologies})
        if len(sizes) > 1:
            raise ValueError(f"topologies must all have the same size, got sizes {sizes}")
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name must be a non-empty str, got {self.name!r}")
        object.__setattr__(self, "topologies", tuple(self.topologies))

    @property
    def size(self) -> int:
        """Number of ranks n."""
        return self.topologies[0].size

    @property
    def period(self) -> int:
        """Number of distinct steps before the schedule repeats."""
        return len(self.topologies)

    def at(self, step: int) -> Topology:
        """The topology used at ``step`` (cyclic)."""
        return self.topologies[_check_int("step", step, 0) % self.period]

    def union_in_neighbors(self, rank: int) -> tuple[int, ...]:
        """Every rank that ``rank`` receives from at some step, ascending."""
        return tuple(sorted(set().union(*(t.in_neighbors(rank) for t in self.topologies))))

    def union_out_neighbors(self, rank: int) -> tuple[int, ...]:
        """Every rank that ``rank`` sends to at some step, ascending."""
        return tuple(sorted(set().union(*(t.out_neighbors(rank) for t in self.topologies))))

    def union_edges(self) -> frozenset[tuple[int, int]]:
        """Directed edges ``(src, dst)`` used at some step of the period."""
        return frozenset().union(*(t.edges() for t in self.topologies))


def from_matrix(W, name: str = "custom", tol: float = 1e-9) -> Topology:
    """A Topology from ``W``, which must be square, finite, non-negative and doubly stochastic."""
    tol = _check_tol(tol)
    topology = Topology(W, name)
    err = _stochasticity_error(topology.W, tol)
    if err is not None:
        raise ValueError(f"W is not doubly stochastic: {err}")
    return topology


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


TOPOLOGIES: dict[str, Callable[..., Union[Topology, Schedule]]] = {
    "ring": ring,
    "torus": torus,
    "exponential": exponential,
    "hypercube": hypercube,
    "complete": complete,
    "star": star,
    "random_regular": random_regular,
    "one_peer_exponential": one_peer_exponential,
}


def build(name: str, n: int, **kwargs) -> Union[Topology, Schedule]:
    """Build the topology registered as ``name`` in :data:`TOPOLOGIES` on ``n`` ranks."""
    if not isinstance(name, str) or name not in TOPOLOGIES:
        raise ValueError(f"unknown topology {name!r}; valid names: {', '.join(sorted(TOPOLOGIES))}")
    return TOPOLOGIES[name](n, **kwargs)

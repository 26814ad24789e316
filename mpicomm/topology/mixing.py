"""Mixing matrices and time-varying schedules: the :class:`Topology` and :class:`Schedule` types.

A :class:`Topology` holds an ``n x n`` mixing matrix ``W`` (float64, read-only). Gossip reads

    x_i  <-  sum_j W[i, j] x_j

so rank ``i`` *receives* from its in-neighbours ``{j != i : W[i, j] > 0}`` and *sends* to its
out-neighbours ``{k != i : W[k, i] > 0}``. A :class:`Schedule` is a cyclic sequence of topologies (a
time-varying graph); a ``Topology`` is a schedule of period 1, so callers can use ``at(step)``,
``period``, ``size`` and ``union_in_neighbors``/``union_out_neighbors`` on either.
:func:`from_matrix` admits a user's ``W`` only if it is doubly stochastic (rows and columns sum to 1), so
gossip preserves the average.

Spectral gap: ``1 - rho`` with ``rho = ||W - 11^T/n||_2``, the second largest *singular value* of a
doubly stochastic W. For symmetric (or any normal, e.g. circulant) W this equals the second largest
``|eigenvalue|``; for non-normal W it is >= that modulus and is the one-step contraction factor
``||W x - mean(x) 1|| <= rho ||x - mean(x) 1||`` that consensus bounds use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

__all__ = ["Schedule", "Topology", "from_matrix"]

_GAP_FLOOR = 1e-12  # a spectral gap at or below this is numerically zero: mixing_time() is inf


def _check_int(name: str, value, low: int, high: int | None = None) -> int:
    """Return ``value`` as an int, or raise ValueError naming ``name`` unless ``low <= value < high``."""
    want = f"an int >= {low}" if high is None else f"an int in [{low}, {high})"
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be {want}, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value >= high):
        raise ValueError(f"{name} must be {want}, got {value}")
    return int(value)


def _check_tol(tol) -> float:
    """Return ``tol`` as a float, or raise ValueError unless it is a finite number >= 0."""
    if isinstance(tol, bool) or not isinstance(tol, Real) or not math.isfinite(tol) or tol < 0:
        raise ValueError(f"tol must be a finite number >= 0, got {tol!r}")
    return float(tol)


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


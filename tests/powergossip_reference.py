"""PowerGossip as published (Vogels, Karimireddy, Jaggi, NeurIPS 2020, and the authors' code), every rank in one
process, in numpy: the reference the consensus tests hold mpicomm's PowerGossip to.

Written from the paper's description and the authors' implementation, not from mpicomm's: per edge {lo, hi}
both ends keep the same P and Q of every weight matrix; one gossip iteration is one power-iteration *half*
step, alternating sides (odd iterations multiply by the orthogonalized Q, even ones by the orthogonalized P),
on the difference D = X_hi - X_lo, and each end moves by W_ij times the rank-r approximation, in opposite
directions. Iteration 0 sends nothing (no disagreement yet, in the authors' words). Vectors (biases) are
mixed exactly, x_i <- sum_j W_ij x_j. Orthogonalization: Gram-Schmidt, each column divided by its norm plus
1e-8. The model is the 6-8-3 MLP of ``tests/algo_common.py``; its gradient oracle supplies the local steps.
"""

import numpy as np
import torch

from .algo_common import grad_at

# (rows, cols) of each parameter of the 6-8-3 MLP in flat order, None for a vector (mixed exactly)
PARAMS = [(8, 6), None, (3, 8), None]
SIZES = [48, 8, 24, 3]


def ring_weights(n: int) -> np.ndarray:
    """The ring's mixing matrix written out: 1/2 to self and the one neighbour at n = 2, else 1/3 to self and
    each of the two neighbours (at n = 3 every rank)."""
    w = np.zeros((n, n))
    for i in range(n):
        for j in {i, (i + 1) % n, (i - 1) % n}:
            w[i, j] = 1.0
    return w / w.sum(axis=1, keepdims=True)


def orthogonalize(m: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """Gram-Schmidt on the columns, in place: each divided by (norm + eps), then removed from the later ones."""
    for i in range(m.shape[1]):
        m[:, i] /= np.sqrt(np.sum(m[:, i] ** 2)) + eps
        if i + 1 < m.shape[1]:
            m[:, i + 1:] -= np.outer(m[:, i], m[:, i] @ m[:, i + 1:])
    return m


def _split(x: np.ndarray) -> list[np.ndarray]:
    out, at = [], 0
    for shape, size in zip(PARAMS, SIZES):
        piece = x[at:at + size]
        out.append(piece.reshape(shape) if shape else piece)
        at += size
    return out


def run(start: np.ndarray, n: int, steps: int, rank: int, lr: float, order: str, seed: int = 0) -> np.ndarray:
    """``steps`` steps of plain SGD (step size ``lr``) and PowerGossip on the ring of ``n``, from the flat model
    ``start`` on every rank; ``order`` "cta": mix x(t) and subtract the gradient taken at x(t), "atc": the
    gradient step first. Returns the n final flat models (n x 83, float64)."""
    w = ring_weights(n)
    x = np.tile(start.astype(np.float64), (n, 1))
    edges = [(lo, hi) for lo in range(n) for hi in range(lo + 1, n) if w[lo, hi] > 0]
    pq = {}
    for lo, hi in edges:
        rng = np.random.RandomState(seed * 10_000 + lo * 100 + hi)
        pq[lo, hi] = [(rng.standard_normal((s[0], min(rank, *s))), rng.standard_normal((s[1], min(rank, *s))))
                      if s else None for s in PARAMS]
    for t in range(steps):
        grads = np.stack([grad_at(torch.tensor(x[i], dtype=torch.float32), i, t).double().numpy()
                          for i in range(n)])
        if order == "atc":
            x = x - lr * grads
        new = x.copy()
        views, new_views = [_split(row) for row in x], [_split(row) for row in new]
        for k, shape in enumerate(PARAMS):
            if shape is None:                                   # exact gossip of the vectors
                for i in range(n):
                    new_views[i][k][:] = sum(w[i, j] * views[j][k] for j in range(n))
                continue
            for lo, hi in edges:
                if t == 0:
                    break
                p, q = pq[lo, hi][k]
                diff = views[hi][k] - views[lo][k]
                if t % 2 == 1:                                  # P = D orth(Q);  D ~ P Q^T
                    q_hat = orthogonalize(q)
                    p[:] = diff @ q_hat
                    approx = p @ q_hat.T
                else:                                           # Q = D^T orth(P);  D ~ P Q^T
                    p_hat = orthogonalize(p)
                    q[:] = diff.T @ p_hat
                    approx = p_hat @ q.T
                new_views[lo][k] += w[lo, hi] * approx
                new_views[hi][k] -= w[lo, hi] * approx
        x = new
        if order == "cta":
            x = x - lr * grads
    return x


def consensus_distance(models: np.ndarray) -> float:
    """sqrt(mean_i ||x_i - mean_j x_j||^2) over the rows of ``models``."""
    return float(np.sqrt(np.mean(np.sum((models - models.mean(axis=0)) ** 2, axis=1))))

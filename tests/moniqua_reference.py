"""Pure-torch reference of Moniqua's mixing (every rank in one process), shared by the Moniqua and D² tests.

Written from the update equations, not from the algorithm's code: parts, theta per tensor, the lattice
quantizer with the shared dither (the dither's values come from ``mpicomm.codecs.lattice.dither``, whose
agreement across processes is tested on its own), and the mixing of the parts that did not wrap.
"""

import math

import numpy as np
import torch

from mpicomm.codecs.moniqua import dither, stream_key

from .algo_common import make_model

LAYER_SIZES = [p.numel() for p in make_model().parameters()]
FLOOR = 2.0**-12


def parts_at(step: int, parts: int, sizes=LAYER_SIZES) -> list[tuple[int, int]]:
    """Flat ``(start, stop)`` of tensor l's part (step + l) mod P, for tensors of ``sizes`` laid out in order."""
    out, offset = [], 0
    for tensor, n in enumerate(sizes):
        p = (step + tensor) % parts
        out.append((offset + p * n // parts, offset + (p + 1) * n // parts))
        offset += n
    return out


def spectral_t_mix(W: np.ndarray, gamma: float) -> float:
    """max(1, ln n) / (1 - rho) for a symmetric W damped by gamma (eigenvalues, not the algorithm's code)."""
    n = W.shape[0]
    if n == 1:
        return 1.0
    eig = np.linalg.eigvalsh((1 - gamma) * np.eye(n) + gamma * W - 1.0 / n)
    return max(1.0, math.log(n)) / (1.0 - np.abs(eig).max())


def tensor_max(v: torch.Tensor) -> torch.Tensor:
    """max |v| over each tensor's coordinates (float64)."""
    return torch.stack([c.abs().max() for c in torch.split(v, LAYER_SIZES)]).double()


class ReferenceTheta:
    """theta_l = 2 C M_l P t_mix (adaptive, M_l the decayed running max of the agreed statistic), fixed, or
    observed: 2 C (D_l + P M_l), D_l the decayed running max of the largest recovered distance (the floor's
    share then uses P instead of P t_mix)."""

    def __init__(self, theta=None, c=1.0, per="tensor", parts=1, t_mix=1.0, decay=0.99, observed=False):
        self.fixed, self.c, self.per, self.t, self.decay = theta, c, per, parts * t_mix, decay
        self.parts, self.observed = parts, observed
        self.bound = self.distance = None

    def observe(self, x: torch.Tensor, steps: torch.Tensor) -> None:
        """x, steps: (n, d) models and local steps of every rank."""
        t = self.parts if self.observed else self.t
        s = torch.stack([torch.maximum(tensor_max(steps[r]), tensor_max(x[r]) * FLOOR / (2 * self.c * t))
                         for r in range(x.shape[0])]).max(0).values.float().double()
        if self.per == "model":
            s = s.max().expand(len(LAYER_SIZES))
        self.bound = s if self.bound is None else torch.maximum(self.bound * self.decay, s)

    def observe_distance(self, d: torch.Tensor) -> None:
        """d: the largest recovered distance per tensor this step (float64, no part wrapped)."""
        if self.per == "model":
            d = d.max().expand(len(LAYER_SIZES))
        self.distance = d if self.distance is None else torch.maximum(self.distance * self.decay, d)

    def theta(self) -> torch.Tensor:
        if self.fixed is not None:
            return torch.full((len(LAYER_SIZES),), float(self.fixed), dtype=torch.float64)
        if self.distance is not None:
            return (self.distance + self.bound * self.parts) * 2 * self.c
        return self.bound * 2 * self.c * self.t


def reference_mix(x: torch.Tensor, W: torch.Tensor, step: int, theta: torch.Tensor, bits: int, parts: int,
                  gamma: float, rounding: str = "dither", seed: int = 0,
                  sizes=LAYER_SIZES) -> tuple[torch.Tensor, torch.Tensor]:
    """x_i[S_l] += gamma sum_j W_ij (x̂_j - x̂_i) on every tensor's part, for every rank (no wrap assumed);
    ``sizes``: the tensors' sizes in the vector (the test model's, or a shard's parts of them).

    Also returns, per tensor, the largest recovered distance max_i max_{j in N(i)} |x̂_j - x_i| on its part,
    computed in float32 as ``|L_j - (x_i s + u)| / s`` (float64; 0 for an empty part).
    """
    n = x.shape[0]
    new = x.clone()
    distance = torch.zeros(len(sizes), dtype=torch.float64)
    for tensor, (a, b) in enumerate(parts_at(step, parts, sizes)):
        if a == b:
            continue
        s = float((2**bits) * (1 - 2.0 ** -bits) / (2 * theta[tensor]))  # 2^b (1 - 2 delta) / (2 theta)
        values, points, bases = [], [], []
        for j in range(n):
            u = dither(stream_key(seed, step), torch.arange(a, b)) if rounding == "dither" else torch.zeros(b - a)
            bases.append(x[j, a:b] * s + u)
            points.append(torch.round(bases[-1]))
            values.append((points[-1] - u) * (1.0 / s))
        for i in range(n):
            edges = [j for j in range(n) if j != i and W[i, j] > 0]
            acc = sum((W[i, j] * (values[j] - values[i]) for j in edges), torch.zeros(b - a))
            new[i, a:b] = x[i, a:b] + gamma * acc
            for j in edges:
                far = (points[j] - bases[i]).abs().max() / torch.tensor(s, dtype=torch.float32)
                distance[tensor] = max(float(distance[tensor]), float(far))
    return new, distance

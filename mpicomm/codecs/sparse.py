"""Sparsifiers: top-k (largest magnitudes; Aji & Heafield 2017, Stich et al. 2018) and random-k.

k = ceil(ratio * n) clipped to [1, n] (k = 0 only for n = 0); the ceiling ignores an excess of up to
1e-6 so that float error cannot add an element (0.07 * 100 = 7.000000000000001 gives k = 7).
Payload: k int32 indices in ascending order, then their k float32 values (8k bytes); decode scatters
the values into zeros.

Top-k uses numpy on a CPU and ``torch.topk`` elsewhere; ties at the k-th magnitude are broken arbitrarily.
On a CPU the kept set is by definition ``np.argpartition(|x|, n - k)[n - k:]`` (introselect, ~4x faster
than ``torch.topk``; temporaries |x| as float32 and an n-element int64 index array). Large tensors take a
shortcut to the same set: the magnitudes at least q, with q a quantile of a strided 1/64 sample just
below the expected k-th largest, hold the top k whenever there are at least k of them; argpartition then
runs on those few candidates only. When fewer than k pass, or the k-th largest magnitude is tied across
the cut (the set is then not unique), the full argpartition decides, so the set never differs.

Random-k takes the first k distinct values of a sequence of uniform draws from range(n) -- a uniformly
random k-subset -- in O(k log k) time and memory (``randperm`` when k > n/2); with ``unbiased=True`` the
values are multiplied by n/k so that E[decode(encode(x))] = x.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import bitpack
from ._layout import check_numel, prepare_out, read_field, write_field
from ._rng import SeededGenerator
from .base import Codec, check_flat_float, check_payload

__all__ = ["RandomKCodec", "TopKCodec", "top_k_indices"]

_MAX_INDEX = 2**31 - 1
_SAMPLE_STRIDE = 64  # top-k's candidate shortcut samples every 64th magnitude


def top_k_indices(a: np.ndarray, k: int) -> np.ndarray:
    """Indices (unordered) of the set ``np.argpartition(a, n - k)[n - k:]`` of a 1-D float array, 0 < k <= n.

    NaN counts as the largest value, as in numpy's sort order.
    """
    n = a.shape[0]
    expected = k // _SAMPLE_STRIDE  # sample entries expected among the top k
    if n >= 1 << 16 and 4 * k <= n and expected >= 16:
        sample = a[::_SAMPLE_STRIDE]
        m = min(sample.shape[0], expected + 4 * math.isqrt(expected) + 16)  # ~4 sigma below the k-th largest
        q = np.partition(sample, sample.shape[0] - m)[sample.shape[0] - m]
        cand = np.flatnonzero(~(a < q))  # ~(a < q): NaN is a candidate too
        if cand.shape[0] >= k:
            values = a[cand]
            order = np.argpartition(values, cand.shape[0] - k)
            top = order[cand.shape[0] - k :]
            kth = values[order[cand.shape[0] - k]]
            # Every entry not below the k-th largest is a candidate (kth >= q); exactly k of them: a unique set.
            if np.count_nonzero(~(values < kth)) == k:
                return cand[top]
    return np.argpartition(a, n - k)[n - k :]


def _random_subset(n: int, k: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """A uniformly random k-subset of range(n): the first k distinct values among uniform draws."""
    if 2 * k > n:
        return torch.randperm(n, generator=gen, device=device)[:k]
    draws = torch.empty(0, dtype=torch.int64, device=device)
    extra = k + k * k // n + 16  # k draws repeat about k^2 / (2n) times
    while True:
        draws = torch.cat([draws, torch.randint(n, (extra,), generator=gen, device=device)])
        order = torch.argsort(draws, stable=True)  # equal values stay in draw order
        ordered = draws[order]
        first = torch.ones_like(draws, dtype=torch.bool)
        first[order[1:][ordered[1:] == ordered[:-1]]] = False
        distinct = draws[first]
        if distinct.numel() >= k:
            return distinct[:k]
        extra = 2 * (k - distinct.numel()) + 16


class _SparseCodec(Codec):
    """Shared payload logic: k int32 indices then k float32 values."""

    def __init__(self, ratio: float):
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio must be a number in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)

    def k(self, numel: int) -> int:
        """Number of kept elements for a tensor of ``numel`` elements."""
        numel = check_numel(numel, f"{type(self).__name__}.k")
        if numel == 0:
            return 0
        return min(numel, max(1, math.ceil(self.ratio * numel - 1e-6)))

    def payload_bytes(self, numel: int) -> int:
        """``8*k(numel)``: k int32 indices and k float32 values."""
        return 8 * self.k(numel)

    def _select(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Indices then values of the kept elements."""
        check_flat_float(x, f"{type(self).__name__}.encode")
        x, n = x.detach(), x.numel()
        if n > _MAX_INDEX:
            raise ValueError(f"{type(self).__name__}.encode: int32 indices limit tensors to {_MAX_INDEX} elements")
        k = self.k(n)
        payload = torch.empty(8 * k, dtype=torch.uint8, device=x.device)
        if k:
            idx, values = self._select(x, k)
            write_field(payload, 0, idx.to(torch.int32))
            write_field(payload, 4 * k, values.to(torch.float32))
        return payload

    def decode(self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Zeros with the sent values scattered at the sent indices."""
        who = f"{type(self).__name__}.decode"
        check_payload(payload, self.payload_bytes(numel), who)
        out = prepare_out(out, numel, payload.device, who)
        out.zero_()
        k = self.k(numel)
        if k:
            out[read_field(payload, 0, k, torch.int32)] = read_field(payload, 4 * k, k, torch.float32)
        return out


class TopKCodec(_SparseCodec):
    """Keep the k = ceil(ratio*n) entries of largest magnitude (biased; use with error feedback)."""

    name = "topk"

    def _select(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if bitpack.numpy_enabled(x.device) and x.dtype == torch.float32:
            idx = torch.from_numpy(top_k_indices(np.abs(x.numpy()), k))
        else:
            idx = torch.topk(x.abs(), k, sorted=False).indices
        idx = torch.sort(idx).values
        return idx, x[idx]

    def __repr__(self) -> str:
        return f"TopKCodec(ratio={self.ratio})"


class RandomKCodec(_SparseCodec):
    """Keep k = ceil(ratio*n) uniformly random distinct entries (times n/k when ``unbiased``)."""

    name = "randomk"

    def __init__(self, ratio: float, seed: int = 0, unbiased: bool = False):
        super().__init__(ratio)
        self.unbiased = bool(unbiased)
        self._rng = SeededGenerator(seed)

    def _select(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.numel()
        idx = torch.sort(_random_subset(n, k, self._rng.get(x.device), x.device)).values
        values = x[idx].to(torch.float32)
        if self.unbiased:
            values.mul_(n / k)
        return idx, values

    def __repr__(self) -> str:
        return f"RandomKCodec(ratio={self.ratio}, unbiased={self.unbiased})"

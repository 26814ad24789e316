"""HSQ's codebooks and the choice of one codeword per chunk: the vector-quantization maths of
:class:`~mpicomm.codecs.hsq.HSQCodec` (Dai et al., 2019), on a (rows, d) block of chunks g_m.

C is a (K, d) codebook of unit rows::

    greedy:    p = C g_m;  k* = argmax_k |p_k|;  send (k*, u = p_k*)        decode u * c_k*  (projection; biased)
    unbiased:  a = pinv(C^T) g_m  (so g_m = C^T a);  pick k w.p. |a_k| / ||a||_1 (inverse CDF)
               send (k, u = sign(a_k) ||a||_1)                            decode u * c_k   (E[decode] = g_m)

Codebooks (:data:`CODEBOOKS`) are built on the CPU in float64 from a seed and cast to float32, so every
rank that passes the same seed holds the same bytes; each is built once per process and cached.
:func:`check_hsq_options` validates the options every HSQ entry point takes.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from . import bitpack
from ._rng import check_seed

__all__ = [
    "CODEBOOKS",
    "KMEANS_ITERS",
    "KMEANS_SAMPLES_PER_CODEWORD",
    "MODES",
    "check_hsq_options",
    "codebook",
    "coefficient_map",
    "default_k",
    "greedy_select",
    "index_bits",
    "inverse_cdf_sample",
]

CODEBOOKS = ("gaussian", "kmeans", "orthonormal", "rotation", "identity")
"""Codebook kinds; ``"rotation"`` is another name for ``"orthonormal"`` (a seeded random rotation)."""
MODES = ("greedy", "unbiased")
KMEANS_SAMPLES_PER_CODEWORD = 32
"""Spherical k-means clusters 32*K normalised Gaussian samples ..."""
KMEANS_ITERS = 30
"""... for a fixed 30 Lloyd iterations (cost O(32 K^2 d * 30) float64 flops, once per process)."""
_SQUARE = ("orthonormal", "rotation", "identity")  # kinds with K = d

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)

def default_k(kind: str, d: int) -> int:
    """The codebook size used when K is None: d for orthonormal/rotation/identity, 256 otherwise."""
    return d if kind in _SQUARE else 256

def index_bits(k: int) -> int:
    """Bits of one codeword index: ceil(log2 K)."""
    return (k - 1).bit_length()

def check_hsq_options(d, k, kind, mode, n_bit, min_compress) -> int:
    """Validate the HSQ options (ValueError naming the argument); return the effective K."""
    if not _is_int(d) or d < 1:
        raise ValueError(f"d must be a positive int (chunk dimension), got {d!r}")
    if kind not in CODEBOOKS:
        raise ValueError(f"codebook must be one of {CODEBOOKS}, got {kind!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not _is_int(n_bit) or not 1 <= n_bit <= 8:
        raise ValueError(f"n_bit must be an int in 1..8 (bits per quantized norm), got {n_bit!r}")
    if not _is_int(min_compress) or min_compress < 0:
        raise ValueError(f"min_compress must be a non-negative int, got {min_compress!r}")
    k = default_k(kind, d) if k is None else k
    if not _is_int(k) or not 2 <= k <= 1 << 16:
        raise ValueError(f"K must be an int in 2..65536 (codebook size), got {k!r}")
    if kind in _SQUARE and k != d:
        raise ValueError(f"K must equal d = {d} for the {kind!r} codebook (or be None), got K={k}")
    if kind not in _SQUARE and k & (k - 1):
        raise ValueError(f"K must be a power of two for the {kind!r} codebook, got K={k}")
    if mode == "unbiased" and k < d:
        raise ValueError(f"K must be >= d for mode='unbiased' (C must span R^d), got K={k} < d={d}")
    return k

# ---- codebooks ----------------------------------------------------------------------------------------

def _unit_rows(c: torch.Tensor) -> torch.Tensor:
    return c / c.norm(dim=1, keepdim=True)

def _spherical_kmeans(d: int, k: int, gen: torch.Generator) -> torch.Tensor:
    x = _unit_rows(torch.randn(KMEANS_SAMPLES_PER_CODEWORD * k, d, dtype=torch.float64, generator=gen))
    cent = x[:k].clone()
    for _ in range(KMEANS_ITERS):
        assign = (x @ cent.T).argmax(dim=1)
        sums = torch.zeros_like(cent).index_add_(0, assign, x)
        norms = sums.norm(dim=1)
        keep = norms > 0  # an empty cluster keeps its previous centroid
        cent[keep] = sums[keep] / norms[keep, None]
    return cent

@functools.cache
def _codebook_cpu(kind: str, d: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "identity":
        c = torch.eye(d, dtype=torch.float64)
    elif kind in ("orthonormal", "rotation"):
        q, r = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=gen))
        c = (q * torch.sign(torch.diagonal(r))).T  # Haar-distributed rotation; its rows are orthonormal
    elif kind == "gaussian":
        c = torch.randn(k, d, dtype=torch.float64, generator=gen)
    else:
        c = _spherical_kmeans(d, k, gen)
    return _unit_rows(c).to(torch.float32)

def codebook(kind: str, d: int, k: int | None = None, seed: int = 0) -> torch.Tensor:
    """The (K, d) float32 codebook of unit rows that ``kind``, ``d``, ``K`` and ``seed`` define (a copy)."""
    k = check_hsq_options(d, k, kind, "greedy", 1, 0)
    return _codebook_cpu("orthonormal" if kind == "rotation" else kind, d, k, check_seed(seed)).clone()

def coefficient_map(cb: torch.Tensor) -> torch.Tensor:
    """P^T (d, K) for a (K, d) codebook: a = g P^T are the minimum-norm coefficients with g = C^T a.

    Computed in float64 as pinv(C^T)^T and cast to float32; raises ``ValueError`` unless rank(C) = d.
    """
    c = cb.double()
    d, rank = c.shape[1], int(torch.linalg.matrix_rank(c))
    if rank < d:
        raise ValueError(f"codebook of shape {tuple(c.shape)} has rank {rank} < d = {d}; mode='unbiased' "
                         "needs a codebook that spans R^d")
    return torch.linalg.pinv(c.T).T.contiguous().to(torch.float32)

@functools.cache
def _coefficient_map(kind: str, d: int, k: int, seed: int) -> torch.Tensor:
    return coefficient_map(_codebook_cpu(kind, d, k, seed))

# ---- the two encoders, on a (rows, d) block of chunks --------------------------------------------------

def _argmax_rows(a: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first maximum); numpy's SIMD argmax on a CPU is ~10x faster than torch's."""
    if bitpack.numpy_enabled(a.device):
        return torch.from_numpy(np.argmax(a.detach().numpy(), axis=1))
    return a.argmax(dim=1)

def greedy_select(chunks: torch.Tensor, cb: torch.Tensor,
                  scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy HSQ of each row of ``chunks``: (k* = argmax_k |<c_k, g>|, u = <c_k*, g>).

    ``scratch``: optional float32 buffer of at least 2 x rows x K elements for the products and their
    magnitudes. Reusing it avoids fresh megabyte-sized temporaries, which the C allocator maps anew
    on every call (page faults doubled the encode time on a CPU).
    """
    if scratch is not None and bitpack.kernels_enabled(chunks.device):  # the choice in one pass over p
        from .kernels import hsq as khsq

        n, k = chunks.shape[0], cb.shape[0]
        p = torch.mm(chunks, cb.T, out=scratch[:n * k].view(n, k))
        idx, u = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.float32)
        khsq.argmax_magnitude(p.numpy(), idx.numpy(), u.numpy())
        return idx, u
    if scratch is None:
        p = chunks @ cb.T
        magnitude = p.abs()
    else:
        n, k = chunks.shape[0], cb.shape[0]
        p = torch.mm(chunks, cb.T, out=scratch[:n * k].view(n, k))
        magnitude = torch.abs(p, out=scratch[n * k:2 * n * k].view(n, k))
    idx = _argmax_rows(magnitude)
    return idx, p.gather(1, idx[:, None]).squeeze(1)

def inverse_cdf_sample(weights: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Index k of each row drawn with probability weights[k]/sum(weights) given uniforms ``r`` in [0, 1).

    k is the number of cumulative sums <= r * total. Entries from the first one that reaches the row
    total onwards are set to +inf, so rounding can never select a zero-weight index; an all-zero row
    selects index 0.
    """
    cdf = torch.cumsum(weights, dim=1)
    total = cdf[:, -1:].clone()
    cdf.masked_fill_(cdf >= total, math.inf)
    return torch.searchsorted(cdf, r[:, None] * total, right=True).squeeze(1)


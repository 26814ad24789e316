"""Moniqua's shared dither (:func:`mpicomm.codecs.lattice.dither`) in one pass.

``u = (bits 40..63 of splitmix64's finaliser of coords * golden + key) * 2^-24 - 1/2`` in float32: uint64
arithmetic wraps like the numpy slices it replaces, and the float operations are exact (a 24-bit integer
times a power of two, minus 1/2), so the values are theirs bit for bit.
"""

from __future__ import annotations

import numpy as np

from ._jit import inline, kernel

__all__ = ["dither", "u_at"]

_GOLDEN, _C1, _C2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S40 = np.uint64(30), np.uint64(27), np.uint64(40)
_UNIT, _HALF = np.float32(2.0**-24), np.float32(0.5)


@inline
def u_at(key, c):
    """u at the flat coordinate ``c`` (for other kernels)."""
    z = np.uint64(c) * _GOLDEN + key
    z = (z ^ (z >> _S30)) * _C1
    z = (z ^ (z >> _S27)) * _C2
    return np.float32(np.int64(z >> _S40)) * _UNIT - _HALF


@kernel
def dither(key, coords, out):
    """Write u at the int64 flat coordinates ``coords`` of the uint64 stream ``key`` into the float32 ``out``."""
    for i in range(coords.size):
        out[i] = u_at(key, coords[i])

"""Moniqua's codec (:mod:`mpicomm.codecs.moniqua`) in one pass: the shared dither, and a frame's encode and
recovery with nothing stored per position in between.

A frame is a sequence of runs (a tensor's part, or a gap whose x is 0); run r covers ``lengths[r]``
positions of tensor ``tensors[r]``, reading the flat model from coordinate ``starts[r]`` (-1 for a gap),
and position p of the frame is keyed by flat coordinate ``c = lo + p + shifts[r]``. Per position, in
float32 as the frame's torch path computes it::

    u = dither(key, c) (0 without one),   H = coordinate hash of c
    t = x s + u                           (recomputed by the recovery from the reader's own x: same bits)
    encode:   L = rint(t)   (stochastic: floor(t + xi))
              code = int(L) mod 2^b         -> ``codes`` (one byte each, packed by ``bitpack``)
              F[tensor] += H (int(L) mod 2^20)          (int64: any order gives the same sum)
              out = ((L - u) / s) * factor              (factor = -sum_j W_ij: the increment's start)
    recover:  L' = rint((t - k) * 2^-b) * 2^b + k      (k the received code, unpacked by ``bitpack``)
              F[tensor] += H (int(L') mod 2^20);  D[tensor] = max(D, |L' - t|) (theta="observed")
              out = fma((L' - u) / s, w, out)          (torch's ``add_(v, alpha=w)`` rounds once)

The dither ``u = (bits 40..63 of splitmix64's finaliser of c * golden + key) * 2^-24 - 1/2``: uint64
arithmetic wraps like the numpy slices it replaces, and the float operations are exact.
"""

from __future__ import annotations

import numpy as np

from ._jit import fma32, inline, kernel

__all__ = ["coordinates", "dither", "encode", "recover"]

_GOLDEN, _C1, _C2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S40 = np.uint64(30), np.uint64(27), np.uint64(40)
_UNIT, _HALF = np.float32(2.0**-24), np.float32(0.5)
_LOW20, _LOW31 = np.int64((1 << 20) - 1), np.int64((1 << 31) - 1)
_LCG_A, _LCG_C = np.int64(1103515245), np.int64(12345)


@inline
def _u(key, c):
    """The dither u at the flat coordinate ``c`` of stream ``key``."""
    z = np.uint64(c) * _GOLDEN + key
    z = (z ^ (z >> _S30)) * _C1
    z = (z ^ (z >> _S27)) * _C2
    return np.float32(np.int64(z >> _S40)) * _UNIT - _HALF


@inline
def _hash(c):
    return np.int32(((((c & _LOW31) * _LCG_A + _LCG_C) & _LOW31) >> 11) | 1)


@inline
def _shifted(x, i, at, s, key, dithered, gap):
    """Position i of a run: its coordinate c, ``t = x s + u`` and the dither u (0 without one)."""
    c = np.int64(at + i)
    t = np.float32(0.0) * s if gap else x[i] * s
    u = _u(key, c) if dithered else np.float32(0.0)
    return c, (t + u if dithered else t), u


@kernel
def dither(key, coords, out):
    """Write u at the int64 flat coordinates ``coords`` of the uint64 stream ``key`` into the float32 ``out``."""
    for i in range(coords.size):
        out[i] = _u(key, coords[i])


@inline
def _encode_span(x, noise, at, s, inv, key, factor, mask, codes, out, dithered, stochastic, gap):
    """One run: ``x`` its model values (unused for a gap), ``noise``/``codes``/``out`` its positions'; returns
    the run's fingerprint."""
    fp = np.int64(0)
    for i in range(out.size):
        c, t, u = _shifted(x, i, at, s, key, dithered, gap)
        if stochastic:
            L = np.float32(np.floor(t + noise[i]))
        else:
            L = np.float32(np.rint(t))
        points = np.int64(L)
        codes[i] = np.uint8(points & mask)
        fp += (points & _LOW20) * np.int64(_hash(c))
        if dithered:
            L = L - u
        out[i] = (L * inv) * factor
    return fp


@inline
def _encode_runs(x, noise, starts, lengths, tensors, shifts, lo, key, scale, inverse, factor, mask, codes,
                 fingerprints, out, dithered, stochastic):
    p = 0
    for r in range(lengths.size):
        k, first, q = tensors[r], starts[r], p + lengths[r]
        xi, at = noise[p:q] if stochastic else noise, lo + p + shifts[r]
        if first >= 0:
            fingerprints[k] += _encode_span(x[first:first + q - p], xi, at, scale[k], inverse[k], key, factor,
                                            mask, codes[p:q], out[p:q], dithered, stochastic, False)
        else:
            fingerprints[k] += _encode_span(x, xi, at, scale[k], inverse[k], key, factor, mask, codes[p:q],
                                            out[p:q], dithered, stochastic, True)
        p = q


@kernel
def encode(x, noise, starts, lengths, tensors, shifts, lo, dithered, key, scale, inverse, factor, mask, codes,
           fingerprints, out):
    """Encode one frame (see the module docstring): ``key`` the dither's stream if ``dithered``, ``noise``
    stochastic rounding's xi at every position (empty when not used); ``codes`` receives one code per
    position (``L & mask``, mask = 2^b - 1), ``fingerprints`` (per tensor) the runs' sums, ``out`` the
    increment's start."""
    if dithered:
        _encode_runs(x, noise, starts, lengths, tensors, shifts, lo, key, scale, inverse, factor, mask, codes,
                     fingerprints, out, True, False)
    elif noise.size:
        _encode_runs(x, noise, starts, lengths, tensors, shifts, lo, key, scale, inverse, factor, mask, codes,
                     fingerprints, out, False, True)
    else:
        _encode_runs(x, noise, starts, lengths, tensors, shifts, lo, key, scale, inverse, factor, mask, codes,
                     fingerprints, out, False, False)


@inline
def _recover_span(codes, x, at, s, inv, key, weight, levels, out, dithered, observed, gap):
    """One run (as :func:`_encode_span`); returns its fingerprint and ``max |L' - t|``."""
    fp, far, step = np.int64(0), np.float32(0.0), np.float32(1.0) / levels
    for i in range(out.size):
        c, t, u = _shifted(x, i, at, s, key, dithered, gap)
        code = np.float32(codes[i])
        L = np.float32(np.rint((t - code) * step)) * levels + code
        fp += (np.int64(L) & _LOW20) * np.int64(_hash(c))
        if observed:
            far = max(far, abs(L - t))
        if dithered:
            L = L - u
        out[i] = fma32(L * inv, weight, out[i])
    return fp, far


@inline
def _recover_runs(codes, x, starts, lengths, tensors, shifts, lo, key, scale, inverse, weight, levels,
                  fingerprints, distance, out, dithered, observed):
    p = 0
    for r in range(lengths.size):
        k, first, q, at = tensors[r], starts[r], p + lengths[r], lo + p + shifts[r]
        if first >= 0:
            fp, far = _recover_span(codes[p:q], x[first:first + q - p], at, scale[k], inverse[k], key, weight,
                                    levels, out[p:q], dithered, observed, False)
        else:
            fp, far = _recover_span(codes[p:q], x, at, scale[k], inverse[k], key, weight, levels, out[p:q],
                                    dithered, observed, True)
        fingerprints[k] += fp
        if observed:
            distance[k] = max(distance[k], far)
        p = q


@kernel
def recover(codes, x, starts, lengths, tensors, shifts, lo, dithered, key, scale, inverse, weight, levels,
            fingerprints, distance, out):
    """Recover one neighbour's frame (see the module docstring) from its unpacked ``codes`` against this rank's
    model ``x`` (the one it encoded from); ``distance`` is empty unless theta is observed."""
    if dithered and distance.size:
        _recover_runs(codes, x, starts, lengths, tensors, shifts, lo, key, scale, inverse, weight, levels,
                      fingerprints, distance, out, True, True)
    elif dithered:
        _recover_runs(codes, x, starts, lengths, tensors, shifts, lo, key, scale, inverse, weight, levels,
                      fingerprints, distance, out, True, False)
    elif distance.size:
        _recover_runs(codes, x, starts, lengths, tensors, shifts, lo, key, scale, inverse, weight, levels,
                      fingerprints, distance, out, False, True)
    else:
        _recover_runs(codes, x, starts, lengths, tensors, shifts, lo, key, scale, inverse, weight, levels,
                      fingerprints, distance, out, False, False)


@kernel
def coordinates(lo, lengths, shifts, key, u, hashes):
    """The frame's per-position dither ``u`` (if ``u`` is not empty) and fingerprint weights ``hashes`` (int32,
    :func:`mpicomm.codecs.moniqua.coordinate_hashes`), for the frame's torch path."""
    p = 0
    for r in range(lengths.size):
        at = lo + shifts[r]
        for i in range(lengths[r]):
            c = np.int64(at + p + i)
            hashes[p + i] = _hash(c)
            if u.size:
                u[p + i] = _u(key, c)
        p += lengths[r]

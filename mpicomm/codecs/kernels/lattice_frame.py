"""One frame of a Moniqua message (:class:`mpicomm.algorithms.moniqua_frame.Frame`) encoded or recovered in
one pass over its positions, with nothing stored per position in between.

A frame is a sequence of runs (a tensor's part, or a gap whose x is 0); run r covers ``lengths[r]``
positions of tensor ``tensors[r]``, reading the flat model from coordinate ``starts[r]`` (-1 for a gap),
and position p of the frame is keyed by flat coordinate ``c = lo + p + shifts[r]``. Per position, in
float32 as the frame's torch path computes it::

    u = dither(key, c) (0 without one),   H = coordinate hash of c
    t = x s + u                           (recomputed by the recovery from the reader's own x: same bits)
    encode:   L = rint(t)   (stochastic: floor(t + xi))
              code = int(L) mod 2^b         -> ``codes`` (one byte each; :func:`pack_codes` packs them)
              F[tensor] += H (int(L) mod 2^20)          (int64: any order gives the same sum)
              out = ((L - u) / s) * factor              (factor = -sum_j W_ij: the increment's start)
    recover:  L' = rint((t - k) * 2^-b) * 2^b + k      (k the received code, unpacked by :func:`unpack_codes`)
              F[tensor] += H (int(L') mod 2^20);  D[tensor] = max(D, |L' - t|) (theta="observed")
              out = fma((L' - u) / s, w, out)          (torch's ``add_(v, alpha=w)`` rounds once)
"""


from __future__ import annotations

import numpy as np

from ._jit import fma32, inline, kernel
from .dither import u_at as _u

__all__ = ["coordinates", "encode", "pack_codes", "recover", "unpack_codes"]

_LOW20, _LOW31 = np.int64((1 << 20) - 1), np.int64((1 << 31) - 1)
_LCG_A, _LCG_C = np.int64(1103515245), np.int64(12345)


@inline
def _hash(c):
    return np.int32(((((c & _LOW31) * _LCG_A + _LCG_C) & _LOW31) >> 11) | 1)


@inline
def _encode_span(x, noise, at, s, inv, key, factor, codes, out, dithered, stochastic, gap):
    """One run: ``x`` its model values (unused for a gap), ``noise``/``codes``/``out`` its positions'; returns
    the run's fingerprint."""
    fp = np.int64(0)
    for i in range(out.size):
        c = np.int64(at + i)
        t = np.float32(0.0) * s if gap else x[i] * s
        if dithered:
            u = _u(key, c)
            t = t + u
        if stochastic:
            L = np.float32(np.floor(t + noise[i]))
        else:
            L = np.float32(np.rint(t))
        points = np.int64(L)
        codes[i] = np.uint8(points & 255)
        fp += (points & _LOW20) * np.int64(_hash(c))
        if dithered:
            L = L - u
        out[i] = (L * inv) * factor
    return fp


@inline
def _encode_runs(x, noise, starts, lengths, tensors, shifts, lo, key, scale, inverse, factor, codes, fingerprints,
                 out, dithered, stochastic):
    p = 0
    for r in range(lengths.size):
        k, first, q = tensors[r], starts[r], p + lengths[r]
        xi, at = noise[p:q] if stochastic else noise, lo + p + shifts[r]
        if first >= 0:
            fingerprints[k] += _encode_span(x[first:first + q - p], xi, at, scale[k], inverse[k], key, factor,
                                            codes[p:q], out[p:q], dithered, stochastic, False)
        else:
            fingerprints[k] += _encode_span(x, xi, at, scale[k], inverse[k], key, factor, codes[p:q], out[p:q],
                                            dithered, stochastic, True)
        p = q


@kernel
def encode(x, noise, starts, lengths, tensors, shifts, lo, dithered, key, scale, inverse, factor, codes,
           fingerprints, out):
    """Encode one frame (see the module docstring): ``key`` the dither's stream if ``dithered``, ``noise``
    stochastic rounding's xi at every position (empty when not used); ``codes`` receives one unpacked code
    byte per position (low bits: L mod 256), ``fingerprints`` (per tensor) the runs' sums, ``out`` the
    increment's start."""
    if dithered:
        _encode_runs(x, noise, starts, lengths, tensors, shifts, lo, key, scale, inverse, factor, codes,
                     fingerprints, out, True, False)
    elif noise.size:
        _encode_runs(x, noise, starts, lengths, tensors, shifts, lo, key, scale, inverse, factor, codes,
                     fingerprints, out, False, True)
    else:
        _encode_runs(x, noise, starts, lengths, tensors, shifts, lo, key, scale, inverse, factor, codes,
                     fingerprints, out, False, False)


@inline
def _recover_span(codes, x, at, s, inv, key, weight, levels, out, dithered, observed, gap):
    """One run (as :func:`_encode_span`); returns its fingerprint and ``max |L' - t|``."""
    fp, far, step = np.int64(0), np.float32(0.0), np.float32(1.0) / levels
    for i in range(out.size):
        c = np.int64(at + i)
        t = np.float32(0.0) * s if gap else x[i] * s
        if dithered:
            u = _u(key, c)
            t = t + u
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


@inline
def _pack(codes, out, bits):
    per, mask = 8 // bits, np.uint32((1 << bits) - 1)
    full = codes.size // per
    for b in range(full):
        acc = np.uint32(0)
        for j in range(per):
            acc |= (np.uint32(codes[b * per + j]) & mask) << np.uint32(j * bits)
        out[b] = np.uint8(acc)
    if full * per < codes.size:
        acc = np.uint32(0)
        for j in range(codes.size - full * per):
            acc |= (np.uint32(codes[full * per + j]) & mask) << np.uint32(j * bits)
        out[full] = np.uint8(acc)


@kernel
def pack_codes(codes, bits, out):
    """Pack the low ``bits`` bits of every byte of ``codes`` into ``out`` (``bitpack``'s layout)."""
    if bits == 1:
        _pack(codes, out, 1)
    elif bits == 2:
        _pack(codes, out, 2)
    elif bits == 4:
        _pack(codes, out, 4)
    else:
        _pack(codes, out, 8)


@inline
def _unpack(packed, out, bits):
    per, mask = 8 // bits, (1 << bits) - 1
    full = out.size // per
    for b in range(full):
        byte = np.int32(packed[b])
        for j in range(per):
            out[b * per + j] = np.uint8((byte >> (j * bits)) & mask)
    for j in range(out.size - full * per):
        out[full * per + j] = np.uint8((np.int32(packed[full]) >> (j * bits)) & mask)


@kernel
def unpack_codes(packed, bits, out):
    """Unpack ``out.size`` codes of ``bits`` bits from ``packed`` into one byte each."""
    if bits == 1:
        _unpack(packed, out, 1)
    elif bits == 2:
        _unpack(packed, out, 2)
    elif bits == 4:
        _unpack(packed, out, 4)
    else:
        _unpack(packed, out, 8)


@kernel
def coordinates(lo, lengths, shifts, key, u, hashes):
    """The frame's per-position dither ``u`` (if ``u`` is not empty) and fingerprint weights ``hashes`` (int32,
    :func:`mpicomm.codecs.lattice.coordinate_hashes`), for the frame's torch path."""
    p = 0
    for r in range(lengths.size):
        at = lo + shifts[r]
        for i in range(lengths[r]):
            c = np.int64(at + p + i)
            hashes[p + i] = _hash(c)
            if u.size:
                u[p + i] = _u(key, c)
        p += lengths[r]

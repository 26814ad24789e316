"""One frame of a Moniqua message (:class:`mpicomm.algorithms.moniqua_frame.Frame`) encoded or recovered in
one pass over its positions.

A frame is a sequence of runs (a tensor's part, or a gap whose x is 0); run r covers ``lengths[r]``
positions of tensor ``tensors[r]`` starting at flat model coordinate ``starts[r]`` (-1 for a gap), with the
tensor's scale s and 1/s. Per position, in float32 as the frame's torch path computes it::

    encode:   t = x s (+ u)                 -> base (kept for the recoveries)
              L = rint(t)   (stochastic: floor(t + xi))
              code = int(L) mod 2^b         -> codes (packed by :func:`pack_codes`)
              F[tensor] += H (int(L) mod 2^20)          (int64: any order gives the same sum)
              out = ((L - u) / s) * factor              (factor = -sum_j W_ij: the increment's start)
    recover:  L' = rint((base - k) * 2^-b) * 2^b + k    (k the received code, unpacked by :func:`unpack_codes`)
              F[tensor] += H (int(L') mod 2^20);  D[tensor] = max(D, |L' - base|) (theta="observed")
              out = fma((L' - u) / s, w, out)          (torch's ``add_(v, alpha=w)`` rounds once)
"""

from __future__ import annotations

import numpy as np

from ._jit import fma32, inline, kernel
from .dither import dither_run as dither

__all__ = ["coordinates", "encode", "pack_codes", "recover", "unpack_codes"]

_LOW20, _LOW31 = np.int64((1 << 20) - 1), np.int64((1 << 31) - 1)
_LCG_A, _LCG_C = np.int64(1103515245), np.int64(12345)


@inline
def _encode_runs(x, u, noise, starts, lengths, tensors, scale, inverse, hashes, factor, base, codes, fingerprints,
                 out, dithered, stochastic):
    p = 0
    for r in range(lengths.size):
        k, first, n = tensors[r], starts[r], lengths[r]
        s, inv, fp = scale[k], inverse[k], np.int64(0)
        for i in range(n):
            t = x[first + i] * s if first >= 0 else np.float32(0.0) * s
            if dithered:
                t = t + u[p + i]
            base[p + i] = t
            L = np.float32(np.floor(t + noise[p + i])) if stochastic else np.float32(np.rint(t))
            points = np.int64(L)
            codes[p + i] = np.uint8(points & 255)
            fp += (points & _LOW20) * np.int64(hashes[p + i])
            v = L - u[p + i] if dithered else L
            out[p + i] = (v * inv) * factor
        fingerprints[k] += fp
        p += n


@kernel
def encode(x, u, noise, starts, lengths, tensors, scale, inverse, hashes, factor, base, codes, fingerprints, out):
    """Encode one frame (see the module docstring); ``u`` (dither) and ``noise`` (stochastic rounding's xi) are
    empty when not used; ``codes`` receives one unpacked code byte per position (low bits: L mod 256)."""
    if u.size:
        _encode_runs(x, u, noise, starts, lengths, tensors, scale, inverse, hashes, factor, base, codes,
                     fingerprints, out, True, False)
    elif noise.size:
        _encode_runs(x, u, noise, starts, lengths, tensors, scale, inverse, hashes, factor, base, codes,
                     fingerprints, out, False, True)
    else:
        _encode_runs(x, u, noise, starts, lengths, tensors, scale, inverse, hashes, factor, base, codes,
                     fingerprints, out, False, False)


@inline
def _recover_runs(codes, base, u, lengths, tensors, inverse, hashes, weight, levels, fingerprints, distance, out,
                  dithered, observed):
    p, step = 0, np.float32(1.0) / levels
    for r in range(lengths.size):
        k, n = tensors[r], lengths[r]
        inv, fp, far = inverse[k], np.int64(0), np.float32(0.0)
        for i in range(n):
            code = np.float32(codes[p + i])
            L = np.float32(np.rint((base[p + i] - code) * step)) * levels + code
            fp += (np.int64(L) & _LOW20) * np.int64(hashes[p + i])
            if observed:
                far = max(far, abs(L - base[p + i]))
            v = L - u[p + i] if dithered else L
            out[p + i] = fma32(v * inv, weight, out[p + i])
        fingerprints[k] += fp
        if observed:
            distance[k] = max(distance[k], far)
        p += n


@kernel
def recover(codes, base, u, lengths, tensors, inverse, hashes, weight, levels, fingerprints, distance, out):
    """Recover one neighbour's frame (see the module docstring) from its unpacked ``codes``; ``distance`` is
    empty unless theta is observed, ``u`` empty without the dither."""
    if u.size and distance.size:
        _recover_runs(codes, base, u, lengths, tensors, inverse, hashes, weight, levels, fingerprints, distance,
                      out, True, True)
    elif u.size:
        _recover_runs(codes, base, u, lengths, tensors, inverse, hashes, weight, levels, fingerprints, distance,
                      out, True, False)
    elif distance.size:
        _recover_runs(codes, base, u, lengths, tensors, inverse, hashes, weight, levels, fingerprints, distance,
                      out, False, True)
    else:
        _recover_runs(codes, base, u, lengths, tensors, inverse, hashes, weight, levels, fingerprints, distance,
                      out, False, False)


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
    """The frame's per-position dither ``u`` (if ``u`` is not empty; stream ``key``, :mod:`.dither`) and
    fingerprint weights ``hashes`` (int32, :func:`mpicomm.codecs.lattice.coordinate_hashes`) at flat
    coordinate ``position + shifts[r]`` of every position of run r, positions counted from ``lo``."""
    p = 0
    for r in range(lengths.size):
        first = lo + p + shifts[r]
        for i in range(lengths[r]):
            c = np.int64(first + i)
            h = (((c & _LOW31) * _LCG_A + _LCG_C) & _LOW31) >> 11
            hashes[p + i] = np.int32(h | 1)
        if u.size:
            dither(key, first, u[p:p + lengths[r]])
        p += lengths[r]

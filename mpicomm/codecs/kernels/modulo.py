"""Moniqua's modulo codec (:class:`mpicomm.codecs.modulo.ModuloCodec`) encode and decode in one pass.

Per element, in float32 as the torch path computes it (``a = 2^b / B``, ``levels = 2^b``)::

    encode:  t = floor(x a + levels/2 (+ u))        u = (d + 32768.5) * 2^-16 (stochastic, d an int16 draw)
             k = t - levels floor(t / levels)       (exact on integer-valued floats) -> packed LSB first
    decode:  w = fma(r, -1/B, (k + centre) / levels)            (torch's ``sub_(r, alpha=1/B)``)
             x_hat = fma((w - floor(w)) - 1/2, B, r)            (torch's ``add(r, ., alpha=B)``)

Widths 1, 2, 4 and 8.
"""

from __future__ import annotations

import numpy as np

from ._jit import fma32, inline, kernel

__all__ = ["decode", "encode"]

_DRAW_OFFSET, _DRAW_SCALE, _HALF = np.float32(32768.5), np.float32(2.0**-16), np.float32(0.5)


@inline
def _code(x, draws, i, a, bits, stochastic):
    levels = np.float32(1 << bits)
    t = x[i] * a + levels * _HALF
    if stochastic:
        t = t + (np.float32(draws[i]) + _DRAW_OFFSET) * _DRAW_SCALE
    t = np.floor(t)
    t = t - np.floor(t * (np.float32(1.0) / levels)) * levels
    return np.uint32(np.int32(t))


@inline
def _encode(x, draws, a, out, bits, stochastic):
    per = 8 // bits
    full = x.size // per
    for b in range(full):
        acc = np.uint32(0)
        for j in range(per):
            acc |= _code(x, draws, b * per + j, a, bits, stochastic) << np.uint32(j * bits)
        out[b] = np.uint8(acc)
    if full * per < x.size:
        acc = np.uint32(0)
        for j in range(x.size - full * per):
            acc |= _code(x, draws, full * per + j, a, bits, stochastic) << np.uint32(j * bits)
        out[full] = np.uint8(acc)


@inline
def _encode_width(x, draws, a, out, bits, stochastic):
    if bits == 1:
        _encode(x, draws, a, out, 1, stochastic)
    elif bits == 2:
        _encode(x, draws, a, out, 2, stochastic)
    elif bits == 4:
        _encode(x, draws, a, out, 4, stochastic)
    else:
        _encode(x, draws, a, out, 8, stochastic)


@kernel
def encode(x, draws, a, bits, out):
    """Pack the codes of the float32 ``x`` at ``a = 2^b / B`` (float32) into ``out``; ``draws`` holds one int16
    per element for stochastic rounding, or is empty for nearest."""
    if draws.size:
        _encode_width(x, draws, a, out, bits, True)
    else:
        _encode_width(x, draws, a, out, bits, False)


@inline
def _value(byte, j, r, inv_b, B, centre, bits):
    w = fma32(r, -inv_b, (np.float32((byte >> (j * bits)) & ((1 << bits) - 1)) + centre) *
              (np.float32(1.0) / np.float32(1 << bits)))
    return fma32((w - np.floor(w)) - _HALF, B, r)


@inline
def _decode(packed, reference, inv_b, B, centre, out, bits):
    per = 8 // bits
    full = out.size // per
    for b in range(full):
        byte = np.int32(packed[b])
        for j in range(per):
            out[b * per + j] = _value(byte, j, reference[b * per + j], inv_b, B, centre, bits)
    for j in range(out.size - full * per):
        i = full * per + j
        out[i] = _value(np.int32(packed[full]), j, reference[i], inv_b, B, centre, bits)


@kernel
def decode(packed, reference, inv_b, B, centre, bits, out):
    """``x_hat`` for every code in ``packed`` against the float32 ``reference`` (``inv_b = 1/B``, ``B`` and
    ``centre``, 1/2 for nearest or 0 for stochastic rounding, float32) into ``out`` (which may be
    ``reference``)."""
    if bits == 1:
        _decode(packed, reference, inv_b, B, centre, out, 1)
    elif bits == 2:
        _decode(packed, reference, inv_b, B, centre, out, 2)
    elif bits == 4:
        _decode(packed, reference, inv_b, B, centre, out, 4)
    else:
        _decode(packed, reference, inv_b, B, centre, out, 8)

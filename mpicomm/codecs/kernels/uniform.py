"""The uniform quantizer's encode and decode (:class:`mpicomm.codecs.uniform.UniformCodec`) in one pass.

Encode, per element (all float32, as the torch path computes it)::

    y = (x - lo) * scale + r          r = 1/2 (nearest) or (d + 32768.5) * 2^-16 (stochastic, d an int16 draw)
    k = int(min(max(y, 0), levels))   -> bits-bit codes, packed LSB first (``bitpack``'s layout)

Decode: ``x_hat = float32(k) * delta + lo``. Widths 1, 2, 4 and 8 (a whole number of codes per byte); the
encoders also take 3, 5, 6 and 7 (eight codes to ``bits`` bytes), which HSQ's 6-bit norms use.
"""

from __future__ import annotations

import numpy as np

from ._jit import inline, kernel

__all__ = ["decode", "encode_nearest", "encode_stochastic", "encode_stochastic_segments"]

_HALF, _DRAW_OFFSET, _DRAW_SCALE = np.float32(0.5), np.float32(32768.5), np.float32(2.0**-16)


@inline
def _code(x, draws, i, lo, scale, levels, stochastic):
    y = (x[i] - lo) * scale
    if stochastic:
        y = y + (np.float32(draws[i]) + _DRAW_OFFSET) * _DRAW_SCALE
    else:
        y = y + _HALF
    return np.uint32(np.int32(min(max(y, np.float32(0.0)), levels)))


@inline
def _encode(x, draws, lo, scale, levels, out, bits, stochastic):
    per = 8 // bits
    full = x.size // per
    for b in range(full):
        acc = np.uint32(0)
        for j in range(per):
            acc |= _code(x, draws, b * per + j, lo, scale, levels, stochastic) << np.uint32(j * bits)
        out[b] = np.uint8(acc)
    if full * per < x.size:
        acc = np.uint32(0)
        for j in range(x.size - full * per):
            acc |= _code(x, draws, full * per + j, lo, scale, levels, stochastic) << np.uint32(j * bits)
        out[full] = np.uint8(acc)


@inline
def _encode_groups(x, draws, lo, scale, levels, out, bits, stochastic):
    """Any width: every 8 codes fill ``bits`` bytes (a little-endian 64-bit word), as ``bitpack`` packs 3, 5, 6, 7."""
    groups = -(-x.size // 8)
    for g in range(groups):
        acc = np.uint64(0)
        for j in range(min(8, x.size - 8 * g)):
            acc |= np.uint64(_code(x, draws, 8 * g + j, lo, scale, levels, stochastic)) << np.uint64(j * bits)
        for b in range(min(bits, (x.size * bits + 7) // 8 - g * bits)):
            out[g * bits + b] = np.uint8((acc >> np.uint64(8 * b)) & np.uint64(255))


@inline
def _encode_width(x, draws, lo, scale, levels, out, bits, stochastic):
    if bits == 1:
        _encode(x, draws, lo, scale, levels, out, 1, stochastic)
    elif bits == 2:
        _encode(x, draws, lo, scale, levels, out, 2, stochastic)
    elif bits == 4:
        _encode(x, draws, lo, scale, levels, out, 4, stochastic)
    elif bits == 8:
        _encode(x, draws, lo, scale, levels, out, 8, stochastic)
    else:
        _encode_groups(x, draws, lo, scale, levels, out, bits, stochastic)


@kernel
def encode_nearest(x, lo, scale, levels, bits, out):
    """Pack the nearest-rounded codes of the float32 array ``x`` into ``out`` (``ceil(n * bits / 8)`` bytes).

    ``lo``, ``scale`` and ``levels`` are float32 scalars; ``bits`` in 1..8.
    """
    _encode_width(x, x[:0], lo, scale, levels, out, bits, False)


@kernel
def encode_stochastic(x, draws, lo, scale, levels, bits, out):
    """:func:`encode_nearest` with stochastic rounding: ``draws`` holds one int16 per element of ``x``
    (``SeededGenerator.draw16``)."""
    _encode_width(x, draws, lo, scale, levels, out, bits, True)


@kernel
def encode_stochastic_segments(x, draws, starts, lo, scale, levels, bits, body_at, payload):
    """:func:`encode_stochastic` of every segment ``x[starts[s]:starts[s + 1]]`` (its own float32 ``lo[s]`` and
    ``scale[s]``) into ``payload`` from byte ``body_at[s]``: HSQ's per-layer norms in one call."""
    for seg in range(body_at.size):
        a, b, at = starts[seg], starts[seg + 1], body_at[seg]
        out = payload[at:at + ((b - a) * bits + 7) // 8]
        _encode_width(x[a:b], draws[a:b], lo[seg], scale[seg], levels, out, bits, True)


@inline
def _decode(packed, lo, delta, out, bits):
    per, mask = 8 // bits, (1 << bits) - 1
    full = out.size // per
    for b in range(full):
        byte = np.int32(packed[b])
        for j in range(per):
            out[b * per + j] = np.float32((byte >> (j * bits)) & mask) * delta + lo
    for j in range(out.size - full * per):
        out[full * per + j] = np.float32((np.int32(packed[full]) >> (j * bits)) & mask) * delta + lo


@kernel
def decode(packed, lo, delta, bits, out):
    """``float32(k) * delta + lo`` for every ``bits``-bit code ``k`` in ``packed``, into the float32 ``out``."""
    if bits == 1:
        _decode(packed, lo, delta, out, 1)
    elif bits == 2:
        _decode(packed, lo, delta, out, 2)
    elif bits == 4:
        _decode(packed, lo, delta, out, 4)
    else:
        _decode(packed, lo, delta, out, 8)

"""QSGD's and TernGrad's encode and decode (:class:`mpicomm.codecs.qsgd.QSGDCodec`) in one pass per bucket.

Per bucket of ``bucket`` elements (float32 throughout, as the torch path computes it)::

    m = max |x|                        -> the bucket's scale in the payload
    inv = (1 / m) * s                  (0 when m = 0: torch's ``s / tensor`` is a reciprocal and a product;
                                        TernGrad's one bucket: given by the caller, as the torch path rounds it)
    q = min(max(floor(fma(x, inv, u)), -s), s)     u = (d + 32768.5) * 2^-16, d an int16 draw
    code = q mod 2^bits                -> packed LSB first

torch's vectorised ``addcmul_`` rounds ``u + x * inv`` once (a fused multiply-add), so the kernel does too.
Decode: ``float32(q) * factor``, ``factor = m / s`` per bucket. A bucket must hold a whole number of bytes
of codes (``bucket * bits % 8 == 0``), except the tensor's last one.
"""

from __future__ import annotations

import numpy as np

from ._jit import fma32, inline, kernel

__all__ = ["bucket_scales", "decode", "encode", "encode_with_uniforms"]

_DRAW_OFFSET, _DRAW_SCALE = np.float32(32768.5), np.float32(2.0**-16)


@kernel
def bucket_scales(x, bucket, s, scales, invs):
    """Write ``max |x|`` of every ``bucket``-element bucket of ``x`` to ``scales`` and ``s / max`` (0 for a zero
    bucket) to ``invs`` (float32, rounded as torch's ``s / tensor``: ``(1 / max) * s``).

    The maximum is taken over the magnitudes' bit patterns (sign bit cleared) as int32, which order as the
    floats do and vectorise; a NaN (above every finite and infinite pattern) comes out as torch's ``amax``.
    """
    bits, maxima = x.view(np.int32), scales.view(np.int32)
    for k in range(scales.size):
        maxima[k] = _max_magnitude_bits(bits[k * bucket:(k + 1) * bucket])
        invs[k] = np.float32(1.0) / scales[k] * s if maxima[k] > 0 else np.float32(0.0)


@inline
def _max_magnitude_bits(bits):
    m = np.int32(0)
    for i in range(bits.size):
        m = max(m, bits[i] & np.int32(0x7FFFFFFF))
    return m


@inline
def _code(x, draws, i, inv, s, given):
    u = np.float32(draws[i]) if given else (np.float32(draws[i]) + _DRAW_OFFSET) * _DRAW_SCALE
    return np.uint32(np.int32(min(max(np.floor(fma32(x[i], inv, u)), -s), s)))


@inline
def _encode_span(x, draws, inv, out, bits, given):
    """The codes of one bucket ``x`` (its draws, its scale ``inv``) into its bytes ``out``."""
    per, mask, s = 8 // bits, np.uint32((1 << bits) - 1), np.float32((1 << (bits - 1)) - 1)
    full = x.size // per
    for b in range(full):
        acc = np.uint32(0)
        for j in range(per):
            acc |= (_code(x, draws, b * per + j, inv, s, given) & mask) << np.uint32(j * bits)
        out[b] = np.uint8(acc)
    if full * per < x.size:
        acc = np.uint32(0)
        for j in range(x.size - full * per):
            acc |= (_code(x, draws, full * per + j, inv, s, given) & mask) << np.uint32(j * bits)
        out[full] = np.uint8(acc)


@inline
def _encode(x, draws, invs, bucket, out, bits, given):
    for k in range(invs.size):
        start, stop = k * bucket, min(x.size, (k + 1) * bucket)
        _encode_span(x[start:stop], draws[start:stop], invs[k], out[start * bits // 8:], bits, given)


@inline
def _encode_width(x, draws, invs, bucket, out, bits, given):
    if bits == 2:
        _encode(x, draws, invs, bucket, out, 2, given)
    elif bits == 4:
        _encode(x, draws, invs, bucket, out, 4, given)
    else:
        _encode(x, draws, invs, bucket, out, 8, given)


@kernel
def encode(x, draws, invs, bucket, bits, out):
    """Pack the stochastically rounded codes of ``x`` (float32, one int16 draw per element in ``draws``), with
    ``invs[k]`` the scale of bucket ``k`` of ``bucket`` elements, into ``out``; ``bits`` in 2, 4, 8."""
    _encode_width(x, draws, invs, bucket, out, bits, False)


@kernel
def encode_with_uniforms(x, uniforms, invs, bucket, bits, out):
    """:func:`encode` rounding with the given float32 ``uniforms`` (``QSGDCodec.draw_uniforms``) instead of draws."""
    _encode_width(x, uniforms, invs, bucket, out, bits, True)


@inline
def _value(byte, j, f, bits):
    code = (byte >> (j * bits)) & ((1 << bits) - 1)
    return np.float32(code - ((code & (1 << (bits - 1))) << 1)) * f  # two's complement code -> q, times f


@inline
def _decode_span(packed, f, out, bits):
    """The values of one bucket ``out`` (its scale ``f``) from its bytes ``packed``."""
    per = 8 // bits
    full = out.size // per
    for b in range(full):
        byte = np.int32(packed[b])
        for j in range(per):
            out[b * per + j] = _value(byte, j, f, bits)
    for j in range(out.size - full * per):
        out[full * per + j] = _value(np.int32(packed[full]), j, f, bits)


@inline
def _decode(packed, factors, bucket, out, bits):
    for k in range(factors.size):
        start, stop = k * bucket, min(out.size, (k + 1) * bucket)
        _decode_span(packed[start * bits // 8:], factors[k], out[start:stop], bits)


@kernel
def decode(packed, factors, bucket, bits, out):
    """``float32(q) * factors[k]`` for every code of bucket ``k`` (``bucket`` elements) into the float32 ``out``."""
    if bits == 2:
        _decode(packed, factors, bucket, out, 2)
    elif bits == 4:
        _decode(packed, factors, bucket, out, 4)
    else:
        _decode(packed, factors, bucket, out, 8)

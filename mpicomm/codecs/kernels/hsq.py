"""HSQ's greedy choice and its decode (:class:`mpicomm.codecs.hsq.HSQCodec`) on a CPU.

:func:`argmax_magnitude` picks every chunk's codeword from the products BLAS computed (``abs`` +
``argmax`` + ``gather`` in one pass, the same choice: a selection, no arithmetic). :func:`decode_layers`
decodes every compressed layer's norms u_i (its ``UniformCodec`` header and codes) and chunks ``u_i c_{k_i}``
(float32 products, the last chunk cut at the layer's end) from the packed indices, with the float32
operations of ``HSQCodec._decode_norms`` and the per-layer ``index_select`` + ``mul_``.
"""

from __future__ import annotations

import numpy as np

from ._jit import inline, kernel

_MAGNITUDE, _INF = np.int32(0x7FFFFFFF), np.int32(0x7F800000)

__all__ = ["argmax_magnitude", "decode_layers"]


@kernel
def argmax_magnitude(p, idx, u):
    """For every row r of the float32 (n, K) products ``p``: ``idx[r]`` = the first index of the largest ``|p[r]|``
    (numpy's ``argmax(abs(p))``: the first NaN if there is one) and ``u[r] = p[r, idx[r]]``.

    The largest magnitude is taken over the bit patterns with the sign cleared, as int32 (they order as the
    floats do, NaN above infinity, and the maximum vectorises), then the row is scanned for its first index.
    """
    bits = p.view(np.int32)
    for r in range(p.shape[0]):
        m = np.int32(0)
        for k in range(p.shape[1]):
            m = max(m, bits[r, k] & _MAGNITUDE)
        at = 0
        if m > _INF:
            while (bits[r, at] & _MAGNITUDE) <= _INF:
                at += 1
        else:
            while (bits[r, at] & _MAGNITUDE) != m:
                at += 1
        idx[r], u[r] = at, p[r, at]


@inline
def _field(payload, base, i, bits):
    """Value i of ``bits`` (<= 8) bits packed LSB first from byte ``base``, read through a two-byte window
    (branch-free: a branch on whether the value straddles two bytes made this loop ten times slower)."""
    bit = i * bits
    at = base + (bit >> 3)
    window = np.uint32(payload[at]) | (np.uint32(payload[min(at + 1, payload.size - 1)]) << np.uint32(8))
    return np.int64((window >> np.uint32(bit & 7)) & np.uint32((1 << bits) - 1))


@inline
def _float32_at(payload, at):
    """The float32 stored little-endian at byte ``at`` of ``payload`` (any alignment)."""
    word = np.empty(1, dtype=np.uint32)
    word[0] = (np.uint32(payload[at]) | (np.uint32(payload[at + 1]) << np.uint32(8))
               | (np.uint32(payload[at + 2]) << np.uint32(16)) | (np.uint32(payload[at + 3]) << np.uint32(24)))
    return word.view(np.float32)[0]


@kernel
def decode_layers(payload, offsets, sizes, counts, norms_at, n_bit, bits, codebook, out):
    """Write ``u_i * codebook[k_i]`` for every chunk i of every compressed layer l into ``out``.

    Layer l: ``counts[l]`` chunks from flat offset ``offsets[l]``, ``sizes[l]`` values; at payload byte
    ``norms_at[l]`` its [lo, hi] float32 header and ``n_bit``-bit norm codes (``UniformCodec``: ``u = k step +
    lo``, step = (hi - lo) / (2^n_bit - 1) in float64 rounded to float32), then its indices, ``bits`` each
    (bitpack's layout up to 8 bits, else the low bytes then the high bits).
    """
    d = codebook.shape[1]
    if d == 8:
        _decode(payload, offsets, sizes, counts, norms_at, n_bit, bits, codebook, out, 8)
    elif d == 16:
        _decode(payload, offsets, sizes, counts, norms_at, n_bit, bits, codebook, out, 16)
    elif d == 32:
        _decode(payload, offsets, sizes, counts, norms_at, n_bit, bits, codebook, out, 32)
    else:
        _decode(payload, offsets, sizes, counts, norms_at, n_bit, bits, codebook, out, d)


@inline
def _decode(payload, offsets, sizes, counts, norms_at, n_bit, bits, codebook, out, d):
    for layer in range(offsets.size):
        n, head, start, size = counts[layer], norms_at[layer], offsets[layer], sizes[layer]
        lo, hi = _float32_at(payload, head), _float32_at(payload, head + 4)
        step = np.float32((np.float64(hi) - np.float64(lo)) / np.float64((1 << n_bit) - 1))
        codes, index = head + 8, head + 8 + (n * n_bit + 7) // 8
        norms, words = np.empty(n, dtype=np.float32), np.empty(n, dtype=np.int64)
        for i in range(n):  # the layer's norms and codeword indices first: the chunk loop below then vectorises
            norms[i] = np.float32(_field(payload, codes, i, n_bit)) * step + lo
            if bits <= 8:
                words[i] = _field(payload, index, i, bits)
            else:
                words[i] = (_field(payload, index + n, i, bits - 8) << 8) | np.int64(payload[index + i])
        full = size // d
        _chunks(norms[:full], words[:full], codebook, out[start:start + full * d], d)
        for j in range(size - full * d):  # the padded last chunk
            out[start + full * d + j] = codebook[words[full], j] * norms[full]


@inline
def _chunks(norms, words, codebook, out, d):
    for i in range(norms.size):
        k, v = words[i], norms[i]
        for j in range(d):
            out[i * d + j] = codebook[k, j] * v

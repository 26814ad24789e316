"""HSQ's decode (:class:`mpicomm.codecs.hsq.HSQCodec`) in one pass over every compressed layer.

Every compressed layer's norms u_i (its ``UniformCodec`` header and codes) and chunks ``u_i c_{k_i}``
(float32 products, the last chunk cut at the layer's end) from the packed indices, with the float32
operations of ``HSQCodec._decode_norms`` and the per-layer ``index_select`` + ``mul_``.
"""

from __future__ import annotations

import numpy as np

from ._jit import inline, kernel

__all__ = ["decode_layers"]


@inline
def _field(payload, base, i, bits):
    """Value i of ``bits`` bits packed from byte ``base`` (LSB first; it may straddle two bytes)."""
    bit = i * bits
    value = np.int64(payload[base + bit // 8]) >> (bit % 8)
    if bit % 8 + bits > 8:
        value |= np.int64(payload[base + bit // 8 + 1]) << (8 - bit % 8)
    return value & ((1 << bits) - 1)


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
    for layer in range(offsets.size):
        n, head, start, size = counts[layer], norms_at[layer], offsets[layer], sizes[layer]
        lo, hi = _float32_at(payload, head), _float32_at(payload, head + 4)
        step = np.float32((np.float64(hi) - np.float64(lo)) / np.float64((1 << n_bit) - 1))
        codes, index = head + 8, head + 8 + (n * n_bit + 7) // 8
        for i in range(n):
            v = np.float32(_field(payload, codes, i, n_bit)) * step + lo
            if bits <= 8:
                k = _field(payload, index, i, bits)
            else:
                k = (_field(payload, index + n, i, bits - 8) << 8) | np.int64(payload[index + i])
            first = start + i * d
            for j in range(min(d, size - i * d)):
                out[first + j] = codebook[k, j] * v

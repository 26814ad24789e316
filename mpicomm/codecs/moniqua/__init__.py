"""Moniqua's codec: b-bit modulo codes of a model on an integer lattice, recovered against the reader's model.

Lu, De Sa. "Moniqua: Modulo Quantized Communication in Decentralized SGD." ICML 2020.

Tensor l sends its rotating part (k + l) mod P at step k, on the grid s_l = 2^b (1 - 2 delta) / (2 theta_l),
with the dither u shared by every sender (keyed by seed, step and flat coordinate)::

    L = round(x s + u),  k = L mod 2^b                         (sender: b bits per coordinate)
    L' = k + 2^b round((r s + u - k) / 2^b),  x̂ = (L' - u) / s   (reader with model r)
    fingerprint_l = sum_c H_c (L_c mod 2^20)                    (int32 header: detects a wrapped recovery)

L' = L while |x - r| < theta_l. :class:`MoniquaCodec` is the synchronous message (Moniqua, Moniqua-D²);
:class:`MoniquaPullCodec` the same message with the publisher's version and grid in front (Moniqua-AD-PSGD).
On a CPU the frames run the fused kernels of :mod:`mpicomm.codecs.kernels.moniqua`. Details and the
reasoning behind the shared dither: ``docs/algorithms/moniqua.md``.
"""

from ._codec import MoniquaCodec
from ._lattice import (
    DITHER_CHUNK,
    ROUNDINGS,
    coordinate_hashes,
    delta,
    dither,
    lattice_decode,
    lattice_encode,
    lattice_value,
    stream_key,
)
from ._parts import PartLayout
from ._pull import MoniquaPullCodec

__all__ = [
    "DITHER_CHUNK",
    "ROUNDINGS",
    "MoniquaCodec",
    "MoniquaPullCodec",
    "PartLayout",
    "coordinate_hashes",
    "delta",
    "dither",
    "lattice_decode",
    "lattice_encode",
    "lattice_value",
    "stream_key",
]

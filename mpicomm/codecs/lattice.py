"""Moniqua's modulo codec on an integer lattice, with an optional shared subtractive dither.

Lu, De Sa. "Moniqua: Modulo Quantized Communication in Decentralized SGD." ICML 2020 (modulo recovery);
subtractive dither: Schuchman 1964, Gray & Stockham 1993.

In grid units (s = 2^b / B, B the modulus, u the dither in [-1/2, 1/2), 0 without one)::

    sender:    L = round(x s + u)       (stochastic: L = floor(x s + xi), xi ~ U[0, 1) private)
               k = L mod 2^b            (b bits on the wire)
    receiver:  L' = k + 2^b round((r s + u - k) / 2^b)      r: the receiver's own model
    value:     x̂ = (L' - u) / s        (the sender computes its own x̂ from L by the same float ops)

With the dither, x̂ - x = (L - u - x s)/s is uniform on [-1/2, 1/2)/s, independent of x and zero-mean:
no dead zone where two ranks in one cell feel no pull. L' = L exactly when |L - r s - u| < 2^(b-1), which
|x - r| < theta guarantees for ``B = 2 theta / (1 - 2 delta)``, delta = 2^-(b+1) (nearest, dithered) or
2^-b (stochastic; refused at 1 bit where B would be infinite). A wrap makes L' differ from L by a
multiple of 2^b, so a fingerprint of the integers L (sender) and L' (receiver) detects it.

The dither is drawn from a counter-based generator keyed by (seed, step, flat coordinate), so sender and
receivers regenerate it bit for bit and it costs zero bytes and no state. It is the same for every
sender (not keyed by the sender): two ranks holding the same value then get the same x̂ and feel no
noise, and in expectation over u the difference x̂_j - x̂_i is exactly x_j - x_i (a subtractive dither
shared by both sides of a difference), so the quantization noise vanishes at consensus instead of
keeping the ranks about one grid step apart (measured on the test MLP: 1 bit with a dither per sender
wraps at any theta, the noise alone pushing neighbours ~theta apart). Every function works
on one chunk of coordinates (the caller chunks); float32 holds L exactly for |L| < 2^24.
"""

from __future__ import annotations

import torch

from . import bitpack

__all__ = ["ROUNDINGS", "coordinate_hashes", "delta", "dither", "lattice_decode", "lattice_encode", "lattice_value",
           "stream_key"]

ROUNDINGS = ("dither", "nearest", "stochastic")
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


def _splitmix(z: int) -> int:
    """splitmix64's finaliser on a python int (64-bit)."""
    z = (z + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _C1) & _MASK64
    z = ((z ^ (z >> 27)) * _C2) & _MASK64
    return z ^ (z >> 31)


def stream_key(seed: int, step: int) -> int:
    """The dither stream's 64-bit key for (seed, step), as a signed int64 value."""
    return _signed(_splitmix(_splitmix(seed) ^ step))


_SC1, _SC2, _SGOLDEN = _signed(_C1), _signed(_C2), _signed(_GOLDEN)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on an int64 tensor in place (wrapping products, logical shifts by masking)."""
    z.bitwise_xor_(z.bitwise_right_shift(30).bitwise_and_((1 << 34) - 1)).mul_(_SC1)
    z.bitwise_xor_(z.bitwise_right_shift(27).bitwise_and_((1 << 37) - 1)).mul_(_SC2)
    return z.bitwise_xor_(z.bitwise_right_shift(31).bitwise_and_((1 << 33) - 1))


def dither(key: int, coords: torch.Tensor) -> torch.Tensor:
    """u in [-1/2, 1/2) (float32, multiples of 2^-24) at the flat coordinates ``coords`` (int64) of stream ``key``."""
    top = _mix64(coords.mul(_SGOLDEN).add_(key)).bitwise_right_shift_(40).bitwise_and_((1 << 24) - 1)
    return top.to(torch.float32).mul_(2.0**-24).sub_(0.5)


def coordinate_hashes(coords: torch.Tensor) -> torch.Tensor:
    """Odd 20-bit pseudo-random weights of the flat coordinates ``coords`` (the fingerprint's), int64."""
    c = coords.bitwise_and((1 << 31) - 1)
    return c.mul_(1103515245).add_(12345).bitwise_and_((1 << 31) - 1).bitwise_right_shift_(11).bitwise_or_(1)


def delta(bits: int, rounding: str) -> float:
    """Worst-case error in units of B: 2^-(b+1) (nearest, dither) or 2^-b (stochastic)."""
    return 2.0 ** -bits if rounding == "stochastic" else 2.0 ** -(bits + 1)


def lattice_encode(x: torch.Tensor, s: float, bits: int, u: torch.Tensor | None = None,
                   noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed codes, L)`` of the float chunk ``x`` at scale ``s``; ``u`` the dither, ``noise`` xi for stochastic."""
    t = x.to(torch.float32).mul(s)
    if noise is not None:
        L = t.add_(noise).floor_()
    else:
        L = (t.add_(u) if u is not None else t).round_()
    L = L.to(torch.int64)
    codes = L.bitwise_and((1 << bits) - 1).to(torch.uint8)
    return bitpack.pack(codes, bits, check=False), L


def lattice_value(L: torch.Tensor, s: float, u: torch.Tensor | None = None) -> torch.Tensor:
    """``x̂ = (L - u) / s`` in float32: the same ops on every rank, so every rank gets the same x̂."""
    v = L.to(torch.float32)
    if u is not None:
        v.sub_(u)
    return v.mul_(1.0 / s)


def lattice_decode(packed: torch.Tensor, reference: torch.Tensor, s: float, bits: int,
                   u: torch.Tensor | None = None) -> torch.Tensor:
    """``L'``: the integer congruent to the sent code mod 2^b nearest to ``reference * s + u`` (int64)."""
    m, levels = reference.numel(), float(1 << bits)
    k = bitpack.unpack(packed, bits, m).to(torch.float32)
    base = reference.to(torch.float32).mul(s)
    if u is not None:
        base.add_(u)
    wraps = base.sub_(k).mul_(1.0 / levels).round_()
    return wraps.mul_(levels).add_(k).to(torch.int64)


def packed_bytes(numel: int, bits: int) -> int:
    """Bytes of ``numel`` packed codes."""
    return bitpack.packed_bytes(numel, bits)

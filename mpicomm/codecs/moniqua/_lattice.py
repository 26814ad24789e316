"""Moniqua's integer lattice with a shared subtractive dither, on one chunk of coordinates at a time.

In grid units (s = 2^b / B, B the modulus, u the dither in [-1/2, 1/2), 0 without one)::

    sender:    L = round(x s + u)       (stochastic: L = floor(x s + xi), xi ~ U[0, 1) private)
               k = L mod 2^b            (b bits on the wire)
    receiver:  L' = k + 2^b round((r s + u - k) / 2^b)      r: the receiver's own model
    value:     x̂ = (L' - u) / s        (the sender computes its own x̂ from L by the same float ops)

L' = L exactly when |x - r| < theta for ``B = 2 theta / (1 - 2 delta)``. The dither is keyed by (seed,
step, flat coordinate), the same for every sender, so it costs no bytes and cancels in x̂_j - x̂_i. Why
the dither is shared, and the float32 argument: ``docs/algorithms/moniqua.md``. The per-tensor functions
here (:func:`lattice_encode`, :func:`lattice_decode`, :func:`lattice_value`) are the reference form of
what the frames (:mod:`._frame`) compute on many tensors at once.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import bitpack

__all__ = ["DITHER_CHUNK", "ROUNDINGS", "coordinate_hashes", "delta", "dither", "lattice_decode", "lattice_encode",
           "lattice_value", "stream_key"]

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


DITHER_CHUNK = 1 << 16
"""Coordinates per slice of ``dither``: its int64 temporaries (512 KiB each) stay in a core's L2 cache."""


def _mix_top24(z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Bits 40..63 of splitmix64's finaliser of the int64 tensor ``z`` (in place; ``w`` is scratch), as int64.

    The finaliser's last step ``z ^= z >>> 31`` leaves bits 33..63 unchanged, so it is skipped. Logical
    shifts are arithmetic shifts then a mask; products wrap.
    """
    torch.bitwise_right_shift(z, 30, out=w).bitwise_and_((1 << 34) - 1)
    z.bitwise_xor_(w).mul_(_SC1)
    torch.bitwise_right_shift(z, 27, out=w).bitwise_and_((1 << 37) - 1)
    z.bitwise_xor_(w).mul_(_SC2)
    return z.bitwise_right_shift_(40).bitwise_and_((1 << 24) - 1)


def _mix_top24_numpy(z: np.ndarray, w: np.ndarray) -> np.ndarray:
    """:func:`_mix_top24` on uint64 numpy arrays (logical shifts and wrapping products are native there)."""
    np.bitwise_xor(z, np.right_shift(z, np.uint64(30), out=w), out=z)
    np.multiply(z, np.uint64(_C1), out=z)
    np.bitwise_xor(z, np.right_shift(z, np.uint64(27), out=w), out=z)
    np.multiply(z, np.uint64(_C2), out=z)
    return np.right_shift(z, np.uint64(40), out=z)


def dither(key: int, coords: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """u in [-1/2, 1/2) (float32, multiples of 2^-24) at the flat coordinates ``coords`` (int64) of stream ``key``.

    u = (bits 40..63 of splitmix64's finaliser of ``coords * golden + key``) * 2^-24 - 1/2, computed in
    one pass on a CPU (:mod:`mpicomm.codecs.kernels.moniqua`), else in slices of ``DITHER_CHUNK`` coordinates
    (numpy's uint64 ufuncs with ``bitpack.use_backend("numpy")``, torch elsewhere): the same bits.
    Written into ``out`` (a contiguous float32 tensor of ``coords.numel()`` elements) if given.
    """
    coords = coords.reshape(-1).contiguous()
    n, dev = coords.numel(), coords.device
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=dev)
    elif out.shape != (n,) or out.dtype != torch.float32 or out.device != dev or not out.is_contiguous():
        raise ValueError(f"dither: out must be a contiguous float32 tensor of {n} elements on {dev}")
    if bitpack.kernels_enabled(dev):
        from ..kernels.moniqua import dither as fused
        fused(np.uint64(key & _MASK64), coords.numpy(), out.numpy())
        return out
    m = min(n, DITHER_CHUNK)
    z, w = torch.empty(m, dtype=torch.int64, device=dev), torch.empty(m, dtype=torch.int64, device=dev)
    fast = bitpack.numpy_enabled(dev)
    if fast:
        cn, zn, wn = coords.numpy().view(np.uint64), z.numpy().view(np.uint64), w.numpy().view(np.uint64)
        on = out.numpy()
    for lo in range(0, n, DITHER_CHUNK):
        hi = min(n, lo + DITHER_CHUNK)
        if fast:
            zc = np.multiply(cn[lo:hi], np.uint64(_GOLDEN), out=zn[: hi - lo])
            np.add(zc, np.uint64(key & _MASK64), out=zc)
            np.copyto(on[lo:hi], _mix_top24_numpy(zc, wn[: hi - lo]).view(np.int64), casting="unsafe")
        else:
            zc = torch.mul(coords[lo:hi], _SGOLDEN, out=z[: hi - lo]).add_(key)
            out[lo:hi].copy_(_mix_top24(zc, w[: hi - lo]))
    return out.mul_(2.0**-24).sub_(0.5)  # exact: the top 24 bits are < 2^24


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
    t = torch.mul(x, s) if x.dtype == torch.float32 else x.to(torch.float32).mul_(s)
    if noise is not None:
        L = t.add_(noise).floor_()
    else:
        L = (t.add_(u) if u is not None else t).round_()
    L = L.to(torch.int64)
    codes = L.to(torch.uint8)  # wraps modulo 256 (the low byte), so the mask below gives L mod 2^b
    if bits < 8:
        codes.bitwise_and_((1 << bits) - 1)
    return bitpack.pack(codes, bits, check=False), L


def lattice_value(L: torch.Tensor, s: float, u: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``x̂ = (L - u) / s`` in float32 (into ``out`` if given): the same ops on every rank, so all get the same x̂."""
    v = L.to(torch.float32) if out is None else out.copy_(L)
    if u is not None:
        v.sub_(u)
    return v.mul_(1.0 / s)


def lattice_decode(packed: torch.Tensor, reference: torch.Tensor, s: float, bits: int,
                   u: torch.Tensor | None = None) -> torch.Tensor:
    """``L'``: the integer congruent to the sent code mod 2^b nearest to ``reference * s + u`` (int64)."""
    m, levels, dev = reference.numel(), float(1 << bits), reference.device
    if bits in (1, 2, 4):  # one gather per byte straight to float32
        table = _code_table(bits, dev)
        k = bitpack.unpack_lookup(packed, bits, m, table, torch.empty(m, dtype=torch.float32, device=dev))
    else:
        k = bitpack.unpack(packed, bits, m).to(torch.float32)
    base = torch.mul(reference, s) if reference.dtype == torch.float32 else reference.to(torch.float32).mul_(s)
    if u is not None:
        base.add_(u)
    wraps = base.sub_(k).mul_(1.0 / levels).round_()
    return wraps.mul_(levels).add_(k).to(torch.int64)


_CODE_TABLES: dict = {}


def _code_table(bits: int, device: torch.device) -> torch.Tensor:
    """``[0, 1, ..., 2^b - 1]`` as float32 on ``device`` (cached): the lookup table of the codes' values."""
    key = (bits, device)
    if key not in _CODE_TABLES:
        _CODE_TABLES[key] = torch.arange(1 << bits, dtype=torch.float32, device=device)
    return _CODE_TABLES[key]


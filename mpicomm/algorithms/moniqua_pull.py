"""Moniqua-AD-PSGD's message: a rank's model on its own grid per tensor, and a reader's check-then-mix pull of it.

Lu, De Sa. "Moniqua: Modulo Quantized Communication in Decentralized SGD." ICML 2020 (Moniqua-AD-PSGD).

A rank publishes after each of its steps; v is its step count then (its version). The message, T tensors::

    version   int64       v (-1: nothing published yet)            } prefix, 8 + 4 T bytes
    scale     float32[T]  s_l = 2^b (1 - 2 delta) / (2 theta_l)    }
    fp        int32[T]    low 31 bits of sum_c H_c (L_c mod 2^20)  } a :class:`.PartLayout` message of
    slots                 b-bit codes L_c mod 2^b, part (v + l) mod P   } the same parts and bits

with L_c = round(x_c s_l + u_c), u_c the dither keyed by (seed, v, c) (:mod:`mpicomm.codecs.lattice`).
Everything a reader needs travels in the header: it recovers tensor l on the *publisher's* grid s_l, the
publisher's part of step v, with the publisher's dither stream (key (seed, v)): no collective, no
agreement between ranks. Reader i with model x_i, pulling publisher j's message, on every tensor's part::

    L'_j = k + 2^b round((x_i s_l + u - k) / 2^b)     (j's lattice point, if |x_i - x_j| < theta_l)
    L_i  = round(x_i s_l + u)                          (i's own point on j's grid, same dither)
    check: fingerprint of L'_j == j's fp_l, for every tensor, before x_i is touched
    mix:   x_i[S_l] += alpha (L'_j - L_i) / s_l        only on the tensors that passed

``(L'_j - L_i) / s_l = x̂_j - x̂_i``: the shared dither cancels, two ranks holding the same value feel no
pull, and E_u[x̂_j - x̂_i] = x_j - x_i (subtractive dither). With stochastic rounding (no dither) each
side's point is floor(x s + xi) with its own generator.
"""

from __future__ import annotations

import torch

from ..codecs import lattice
from ..codecs._layout import chunk_elems, chunk_ranges
from ..codecs._rng import SeededGenerator
from .moniqua_guard import LOW31, fingerprint
from .moniqua_parts import PartLayout

__all__ = ["PullMessage"]


class PullMessage:
    """The message format of Moniqua-AD-PSGD: :meth:`encode` a model into it, :meth:`pull` a peer's from it."""

    def __init__(self, layers, bits: int, parts: int, rounding: str, seed: int, rank_seed: int, device):
        self.layout = PartLayout(layers, parts, bits)
        self.bits, self.seed, self.count = bits, seed, self.layout.count
        self.prefix = 8 + 4 * self.count
        self.nbytes = self.prefix + self.layout.message_bytes
        self.delta = lattice.delta(bits, rounding)
        self.dithered = rounding == "dither"
        self.noise = SeededGenerator(rank_seed) if rounding == "stochastic" else None
        self.chunk = chunk_elems(torch.device(device))

    # ------------------------------------------------------------------ header fields
    def scales(self, theta: torch.Tensor) -> torch.Tensor:
        """float32 s_l = 2^b (1 - 2 delta) / (2 theta_l) of float64 ``theta``: the grid the header carries."""
        return ((1 << self.bits) * (1.0 - 2.0 * self.delta) / (2.0 * theta)).float()

    def thetas(self, scales: torch.Tensor) -> torch.Tensor:
        """theta_l (float64) of the header's ``scales``: the inverse of :meth:`scales`."""
        return (1 << self.bits) * (1.0 - 2.0 * self.delta) / (2.0 * scales.double())

    @staticmethod
    def version(message: torch.Tensor) -> int:
        """The publisher's step count (-1: nothing published yet)."""
        return int(message[:8].clone().view(torch.int64)[0])

    def header_scales(self, message: torch.Tensor) -> torch.Tensor:
        """The float32 s_l of every tensor (a copy)."""
        return message[8:self.prefix].clone().view(torch.float32)

    def fingerprints(self, message: torch.Tensor) -> torch.Tensor:
        """The int32 fingerprint of every tensor's part (a view)."""
        return self.layout.header(message[self.prefix:])

    def empty(self, message: torch.Tensor) -> None:
        """Make ``message`` say "nothing published yet" (version -1, before an adaptive theta is known)."""
        message.zero_()
        message[:8].copy_(torch.tensor([-1], dtype=torch.int64).view(torch.uint8))

    # ------------------------------------------------------------------ the two operations
    def encode(self, x: torch.Tensor, version: int, theta: torch.Tensor, message: torch.Tensor) -> None:
        """Write ``x`` (flat fp32) at ``version`` on the grid of float64 ``theta`` (per tensor) into ``message``."""
        scales = self.scales(theta)
        message[:8].copy_(torch.tensor([version], dtype=torch.int64).view(torch.uint8))
        message[8:self.prefix].copy_(scales.view(torch.uint8))
        body, key = message[self.prefix:], self._key(version)
        own = torch.zeros(self.count, dtype=torch.int64)
        for tensor, (start, stop) in enumerate(self.layout.parts_at(version)):
            s, slot = float(scales[tensor]), self.layout.slots[tensor]
            for lo, hi in chunk_ranges(stop - start, self.chunk):
                coords, u = self._coords(key, start + lo, start + hi, x.device)
                packed, L = lattice.lattice_encode(x[start + lo:start + hi], s, self.bits, u, self._noise(hi - lo, x))
                at = slot + lo * self.bits // 8
                body[at:at + packed.numel()].copy_(packed)
                own[tensor] += fingerprint(L, lattice.coordinate_hashes(coords))
        self.layout.header(body).copy_(own.bitwise_and_(LOW31))

    def pull(self, message: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Check: ``(increment, wrapped)`` of a peer's ``message`` at this rank's ``x``, which is not touched.

        ``increment``: x̂_j - x̂_i on every tensor's part, concatenated in tensor order (float32);
        ``wrapped``: bool per tensor, True where the fingerprint of the recovered points differs from the header's.
        """
        version, scales = self.version(message), self.header_scales(message)
        body, key, sent = message[self.prefix:], self._key(version), self.fingerprints(message).tolist()
        parts = self.layout.parts_at(version)
        increment = torch.empty(sum(b - a for a, b in parts), dtype=torch.float32, device=x.device)
        wrapped = torch.zeros(self.count, dtype=torch.bool)
        at = 0
        for tensor, (start, stop) in enumerate(parts):
            s, slot, got = float(scales[tensor]), self.layout.slots[tensor], 0
            for lo, hi in chunk_ranges(stop - start, self.chunk):
                coords, u = self._coords(key, start + lo, start + hi, x.device)
                mine = x[start + lo:start + hi]
                packed = body[slot + lo * self.bits // 8:slot + (hi * self.bits + 7) // 8]
                theirs = lattice.lattice_decode(packed, mine, s, self.bits, u)
                got += fingerprint(theirs, lattice.coordinate_hashes(coords))
                _, own = lattice.lattice_encode(mine, s, self.bits, u, self._noise(hi - lo, x))
                torch.mul(theirs.sub_(own), 1.0 / s, out=increment[at + lo:at + hi])
            wrapped[tensor] = (got & LOW31) != sent[tensor]
            at += stop - start
        return increment, wrapped

    def mix(self, x: torch.Tensor, version: int, increment: torch.Tensor, wrapped: torch.Tensor, alpha: float) -> None:
        """``x[S_l] += alpha increment_l`` on the parts of ``version`` of the tensors that did not wrap."""
        at = 0
        for flag, (start, stop) in zip(wrapped.tolist(), self.layout.parts_at(version)):
            if not flag:
                x[start:stop].add_(increment[at:at + stop - start], alpha=alpha)
            at += stop - start

    # ------------------------------------------------------------------ helpers
    def _key(self, version: int) -> int | None:
        return lattice.stream_key(self.seed, version) if self.dithered else None

    def _coords(self, key, lo: int, hi: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        coords = torch.arange(lo, hi, device=device)
        return coords, None if key is None else lattice.dither(key, coords)

    def _noise(self, n: int, like: torch.Tensor) -> torch.Tensor | None:
        """xi ~ U[0, 1) for stochastic rounding from this rank's generator (None otherwise)."""
        if self.noise is None:
            return None
        return self.noise.uniform_(torch.empty(n, dtype=torch.float32, device=like.device))

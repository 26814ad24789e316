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
side's point is floor(x s + xi) with its own generator (xi drawn tensor by tensor, chunk by chunk of its part).

Work per encode and per pull: frame by frame over the body's code positions at version v
(:meth:`.PartLayout.plan`, frames of 2^16 positions on a CPU), every tensor of a frame in one pass of tensor
operations with a scale, dither and fingerprint weight per position (:class:`.Frame`, shared with the
synchronous :mod:`.moniqua`), so the number of operations does not grow with the number of tensors. The
fingerprints are summed and compared on x's device; the host reads the version and then the wrap flags,
once per pull, nothing per tensor or frame. Results are bit for bit those of a tensor-by-tensor loop (same
float32 operations per coordinate); the unused end of a slot holds code 0.
"""

from __future__ import annotations

import torch

from ..codecs import lattice
from ..codecs._layout import chunk_elems
from ..codecs._rng import SeededGenerator
from .moniqua_frame import Frame, frame_elems, message_noise, per_run
from .moniqua_guard import LOW31
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
        self.chunk = chunk_elems(torch.device(device))  # stochastic rounding draws its xi per piece of a part this long
        self.frame = frame_elems(torch.device(device))  # code positions per Frame

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
        """Write ``x`` (flat fp32) at ``version`` on the grid of float64 ``theta`` (per tensor) into ``message``.

        Frame by frame over the body's code positions at ``version`` (:meth:`.PartLayout.plan`), every tensor
        of a frame in one pass (:class:`.Frame`); the unused code positions of the slots are written as 0.
        The fingerprints stay on the device: the host reads nothing.
        """
        scales = self.scales(theta)
        message[:8].copy_(torch.tensor([version], dtype=torch.int64).view(torch.uint8))
        message[8:self.prefix].copy_(scales.view(torch.uint8))
        dev, body = x.device, message[self.prefix:]
        codes, scale = body[self.layout.header_bytes:], per_run(scales, dev)
        noise, key = self._noise(version, dev), self._key(version)
        own = torch.zeros(self.count + 1, dtype=torch.int64, device=dev)  # the last entry collects the gaps'
        for chunk in self.layout.plan(version, self.frame):
            frame = Frame(chunk, dev, key)
            own.index_add_(0, frame.tensors, frame.pack(frame.lattice(x, scale, noise), self.bits, codes))
        self.layout.header(body).copy_(own[:-1].bitwise_and_(LOW31))

    def pull(self, message: torch.Tensor, x: torch.Tensor,
             version: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Check: ``(increment, wrapped)`` of a peer's ``message`` at this rank's ``x``, which is not touched.

        ``increment``: x̂_j - x̂_i on every tensor's part, concatenated in tensor order (float32, on x's device);
        ``wrapped``: bool per tensor (on the host), True where the fingerprint of the recovered points differs
        from the header's. ``version``: the message's :meth:`version` if the caller has read it already.
        Frame by frame like :meth:`encode`, the fingerprints compared on the device: the host reads the
        version (unless given) and then only the wrap flags, once.
        """
        version = self.version(message) if version is None else version
        dev = x.device
        body, parts = message[self.prefix:], self.layout.parts_at(version)
        scales = self.header_scales(message)
        scale, inverse = per_run(scales, dev), per_run(1.0 / scales.double(), dev)  # 1/s: float64, then float32
        noise, key = self._noise(version, dev), self._key(version)
        codes = body[self.layout.header_bytes:]
        increment = torch.empty(sum(b - a for a, b in parts), dtype=torch.float32, device=dev)
        got = torch.zeros(self.count + 1, dtype=torch.int64, device=dev)
        at = 0
        for chunk in self.layout.plan(version, self.frame):
            frame = Frame(chunk, dev, key)
            own = frame.lattice(x, scale, noise)  # L_i, and t = x_i s + u for the recovery
            theirs = frame.recover(codes, self.bits)  # L'_j
            got.index_add_(0, frame.tensors, frame.fingerprints(theirs))
            at += frame.parts(theirs.sub_(own).mul_(frame.spread(inverse)), increment[at:])
        wrapped = torch.ne(got[:-1].bitwise_and_(LOW31), self.fingerprints(message)).cpu()  # the one host read
        return increment, wrapped

    def mix(self, x: torch.Tensor, version: int, increment: torch.Tensor, wrapped: torch.Tensor, alpha: float) -> None:
        """``x[S_l] += alpha increment_l`` on the parts of ``version`` of the tensors that did not wrap.

        ``wrapped`` is :meth:`pull`'s, on the host: reading it does not wait for the device.
        """
        at = 0
        for flag, (start, stop) in zip(wrapped.tolist(), self.layout.parts_at(version)):
            if not flag:
                x[start:stop].add_(increment[at:at + stop - start], alpha=alpha)
            at += stop - start

    # ------------------------------------------------------------------ helpers
    def _key(self, version: int) -> int | None:
        return lattice.stream_key(self.seed, version) if self.dithered else None

    def _noise(self, version: int, device) -> torch.Tensor | None:
        """xi ~ U(0, 1) of stochastic rounding at every code position of ``version``'s message, from this rank's
        generator, drawn tensor by tensor and chunk by chunk of its part (None for the other roundings)."""
        if self.noise is None:
            return None
        return message_noise(self.layout, version, self.chunk, self.noise, device)

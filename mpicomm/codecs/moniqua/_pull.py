"""Moniqua's message made self-describing, for one-sided reads (Moniqua-AD-PSGD).

A rank publishes after each of its steps; v is its step count then (its version). The message, T tensors::

    version   int64       v (-1: nothing published yet)            } prefix, 8 + 4 T bytes
    scale     float32[T]  s_l = 2^b (1 - 2 delta) / (2 theta_l)    }
    fp, slots             the synchronous message of step v (:mod:`._codec`) on the grid s_l

A reader i with model x_i recovers publisher j's tensor l on j's grid, part and dither (all in the
header: no collective), checks every fingerprint before touching x_i, then mixes the tensors that passed::

    L'_j = k + 2^b round((x_i s_l + u - k) / 2^b),   L_i = round(x_i s_l + u)
    x_i[S_l] += alpha (L'_j - L_i) / s_l             (= alpha (x̂_j - x̂_i): the shared dither cancels)

The host reads the version and then the wrap flags, once per pull; results are bit for bit those of a
tensor-by-tensor loop. The unused end of a slot holds code 0.
"""

from __future__ import annotations

import torch

from ..base import Codec
from ._codec import PartsMessage
from ._frame import LOW31, Frame, frame_elems, per_run

__all__ = ["MoniquaPullCodec"]


class MoniquaPullCodec(PartsMessage, Codec):
    """Moniqua-AD-PSGD's message: :meth:`encode` a model into it, :meth:`pull` a peer's from it and :meth:`mix`.

    Arguments as :class:`~._codec.PartsMessage`. Frames of :func:`._frame.frame_elems` code positions.
    """

    name = "moniqua_pull"

    def __init__(self, layers, bits: int, parts: int, rounding: str, seed: int, rank_seed: int, device):
        super().__init__(layers, bits, parts, rounding, seed, rank_seed, device)
        self.prefix = 8 + 4 * self.count
        self.nbytes = self.prefix + self.layout.message_bytes
        self.frame = frame_elems(torch.device(device))  # code positions per Frame
        self._model: torch.Tensor | None = None

    def payload_bytes(self, numel: int) -> int:
        """The message's bytes: the prefix and the synchronous message."""
        self._check_numel(numel, "MoniquaPullCodec.payload_bytes")
        return self.nbytes

    # ------------------------------------------------------------------ header fields
    def scales(self, theta: torch.Tensor) -> torch.Tensor:
        """float32 s_l = 2^b (1 - 2 delta) / (2 theta_l) of float64 ``theta``: the grid the header carries."""
        return self.grid(theta).float()

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
        self._model = x

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

    def decode(self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """What a reader holding the model last encoded takes from ``payload`` at alpha = 1: that model plus
        x̂_j - x̂_i on the parts of the tensors that did not wrap (float32, into ``out``)."""
        self._check_numel(numel, "MoniquaPullCodec.decode")
        out = self._model.detach().clone() if out is None else out.copy_(self._model)
        version = self.version(payload)
        if version >= 0:
            increment, wrapped = self.pull(payload, self._model, version)
            self.mix(out, version, increment, wrapped, 1.0)
        return out

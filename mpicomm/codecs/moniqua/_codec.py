"""Moniqua's message as a codec: every tensor's rotating part as b-bit lattice codes after a fingerprint header.

Message of step k for T tensors (:class:`._parts.PartLayout`)::

    fp      int32[T]   low 31 bits of sum_c H_c (L_c mod 2^20) over tensor l's part
    slots              b-bit codes L_c mod 2^b of tensor l's part (k + l) mod P, code 0 in the unused end

Encode and recover run frame by frame over the body's code positions (:class:`._frame.Frame`), every tensor
of a frame in one pass, so the work does not grow with the number of tensors.
"""

from __future__ import annotations

from numbers import Real

import torch

from .. import kernels
from .._layout import check_numel, chunk_elems, prepare_out
from .._rng import SeededGenerator
from ..base import Codec, check_flat_float
from ._frame import LOW31, Frame, message_noise, per_run
from ._lattice import ROUNDINGS, delta, stream_key
from ._parts import PartLayout

__all__ = ["MoniquaCodec", "PartsMessage"]


class PartsMessage:
    """What both forms of Moniqua's message share: the layout of the parts, the grid, the dither's stream and
    stochastic rounding's generator.

    ``layers``: the flat model's tensors (``offset`` and ``numel`` each, e.g. ``FlatParameters.layers``).
    ``bits``: 1, 2, 4 or 8. ``parts``: P. ``rounding``: "dither", "nearest" or "stochastic" (bits >= 2).
    ``seed`` keys the dither (the same on every rank); ``rank_seed`` seeds this rank's stochastic rounding.
    """

    def __init__(self, layers, bits: int, parts: int, rounding: str, seed: int, rank_seed: int, device):
        if isinstance(bits, bool) or bits not in kernels.WIDTHS:
            raise ValueError(f"bits must be one of {kernels.WIDTHS}, got {bits!r}")
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        if rounding == "stochastic" and bits == 1:
            raise ValueError("rounding='stochastic' needs bits >= 2 (at 1 bit its error is a whole grid step)")
        self.layout = PartLayout(layers, parts, bits)
        self.bits, self.seed, self.count = bits, seed, self.layout.count
        self.numel = sum(self.layout.sizes)
        self.delta = delta(bits, rounding)
        self.dithered = rounding == "dither"
        self.noise = SeededGenerator(rank_seed) if rounding == "stochastic" else None
        self.chunk = chunk_elems(torch.device(device))  # stochastic rounding draws its xi per piece this long

    @property
    def _rng(self):
        """Stochastic rounding's generator, whose state :meth:`Codec.state_dict` carries (None otherwise)."""
        return self.noise

    def grid(self, theta: torch.Tensor) -> torch.Tensor:
        """s_l = 2^b (1 - 2 delta) / (2 theta_l) (float64) of the float64 ``theta``: recovery is exact while
        |x_i - x_j| < theta_l on every coordinate of tensor l."""
        return (1 << self.bits) * (1.0 - 2.0 * self.delta) / (2.0 * theta)

    def _check_numel(self, numel: int, who: str) -> None:
        if check_numel(numel, who) != self.numel:
            raise ValueError(f"{who}: this codec's model has {self.numel} elements, got numel={numel}")

    def _key(self, step: int) -> int | None:
        return stream_key(self.seed, step) if self.dithered else None

    def _noise(self, step: int, device) -> torch.Tensor | None:
        """xi ~ U(0, 1) of stochastic rounding at every code position of ``step``'s message, from this rank's
        generator, drawn tensor by tensor and chunk by chunk of its part (None for the other roundings)."""
        if self.noise is None:
            return None
        return message_noise(self.layout, step, self.chunk, self.noise, device)


class MoniquaCodec(PartsMessage, Codec):
    """Moniqua's synchronous message: at each step every rank encodes on the same agreed grid, then recovers
    its in-neighbours' messages against the model it encoded (the modulo recovery needs the reader's model).

    :meth:`encode` then :meth:`recover` is the algorithms' path (the neighbours' x̂ summed with their mixing
    weights); :meth:`decode` recovers one message, as the :class:`~mpicomm.codecs.Codec` interface reads.
    ``theta``: the grid's theta when :meth:`encode` is given none (a number, or one per tensor).
    """

    name = "moniqua"

    def __init__(self, layers, bits: int, parts: int = 1, rounding: str = "dither", seed: int = 0,
                 rank_seed: int = 0, device="cpu", theta=1.0):
        super().__init__(layers, bits, parts, rounding, seed, rank_seed, device)
        self.theta = theta
        self.frames: list[Frame] = []
        self._grid: tuple | None = None  # the last encode's (s, 1/s) per run and s per tensor
        self._default_grid: tuple | None = None
        self._model: torch.Tensor | None = None
        self._own: torch.Tensor | None = None

    def payload_bytes(self, numel: int) -> int:
        """The message's bytes: ``4 T`` header bytes and the slots, rounded up to a multiple of 4."""
        self._check_numel(numel, "MoniquaCodec.payload_bytes")
        return self.layout.message_bytes

    def _grid_of(self, theta, device) -> tuple:
        """``(s, 1/s)`` per run (:func:`per_run`) and s per tensor for ``theta`` (None: the codec's, computed once)."""
        if theta is None and self._default_grid is not None and self._default_grid[0].device == device:
            return self._default_grid
        chosen = self.theta if theta is None else theta
        if isinstance(chosen, Real):
            chosen = torch.full((self.count,), float(chosen), dtype=torch.float64)
        scales = self.grid(chosen)
        out = (per_run(scales, device), per_run(1.0 / scales, device), scales)
        if theta is None:
            self._default_grid = out
        return out

    def encode(self, x: torch.Tensor, step: int = 0, theta=None, out: torch.Tensor | None = None, *,
               mixing: torch.Tensor | None = None, factor: float = 1.0) -> torch.Tensor:
        """The message of the flat model ``x`` at ``step`` on the grid of ``theta`` (float64 per tensor, or a
        number; default the codec's), into ``out`` if given.

        Also writes ``factor * x̂`` (this rank's own reconstruction) at every code position into ``mixing``
        (float32, ``layout.codes`` long; an internal buffer if None), and keeps the frames, the grid and
        ``x`` for :meth:`recover` and :meth:`decode`: ``x`` must not change until they are done.
        """
        check_flat_float(x, "MoniquaCodec.encode")
        self._check_numel(x.numel(), "MoniquaCodec.encode")
        dev = x.device
        scale, inverse, _ = self._grid = self._grid_of(theta, dev)
        key = self._key(step)
        payload = torch.empty(self.layout.message_bytes, dtype=torch.uint8, device=dev) if out is None else out
        body = payload[self.layout.header_bytes:]
        mixing = self._own_buffer(dev) if mixing is None else mixing
        noise = self._noise(step, dev)
        own = torch.zeros(self.count + 1, dtype=torch.int64, device=dev)  # the last entry collects the gaps'
        self.frames = []
        for chunk in self.layout.plan(step, self.chunk):
            frame = Frame(chunk, dev, key)  # frame.base: the receivers' t, with their own x, for every recovery
            frame.encode(x, scale, inverse, noise, self.bits, body, own, factor, mixing[chunk.lo:chunk.hi])
            self.frames.append(frame)
        self.layout.header(payload).copy_(own[:-1].bitwise_and_(LOW31))
        self._model = x
        return payload

    def _own_buffer(self, device) -> torch.Tensor:
        if self._own is None or self._own.device != device:
            self._own = torch.empty(self.layout.codes, dtype=torch.float32, device=device)
        return self._own

    def recover(self, rows: torch.Tensor, weights, mixing: torch.Tensor, observed: bool = False) -> torch.Tensor:
        """After :meth:`encode`: add ``sum_k weights[k] x̂_k`` of the messages ``rows`` (one per row), recovered
        against the encoded model, to ``mixing``; return per tensor the number of rows whose fingerprint differs
        from their header (float32), followed if ``observed`` by the largest ``|x̂_k - x|`` over the rows.

        A difference means the recovery wrapped (|x - x_k| exceeded theta on some coordinate of that part).
        The frames, grid and model kept by :meth:`encode` are released: nothing per step is held after it.
        """
        bits, dev = self.bits, mixing.device
        body, count = self.layout.header_bytes, self.count
        fingerprints = torch.zeros(len(rows), count + 1, dtype=torch.int64, device=dev)
        _, inverse, scales = self._grid
        distance = torch.zeros(count + 1, dtype=torch.float32, device=dev) if observed else None
        for frame in self.frames:  # frame by frame, so that a frame's slice of mixing stays in cache
            lo, hi = frame.chunk.lo, frame.chunk.hi
            for k, (w, row) in enumerate(zip(weights, rows)):
                frame.recover_into(row[body:], bits, inverse, w, fingerprints[k], distance, mixing[lo:hi])
        headers = rows[:, :body].view(torch.int32)
        mismatched = fingerprints[:, :count].bitwise_and_(LOW31).ne_(headers).sum(0).to(torch.float32)
        if distance is not None:  # lattice units until divided by s
            mismatched = torch.cat([mismatched, distance[:count] / scales.to(distance)])
        self.frames, self._grid, self._model = [], None, None
        return mismatched

    def decode(self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """x̂ of the sender of ``payload`` (a message of the step last encoded), recovered against the model
        :meth:`encode` read: on the coordinates of the parts sent, that model's own values elsewhere (float32,
        into ``out``, which must not be that model)."""
        self._check_numel(numel, "MoniquaCodec.decode")
        x, dev = self._model, payload.device
        out = prepare_out(out, numel, dev, "MoniquaCodec.decode")
        if self.layout.parts > 1:  # the coordinates not sent this step
            out.copy_(x)
        inverse = self._grid[1]
        fingerprints = torch.zeros(self.count + 1, dtype=torch.int64, device=dev)
        codes = payload[self.layout.header_bytes:]
        for frame in self.frames:
            lo, hi = frame.chunk.lo, frame.chunk.hi
            start = frame.coordinate_start()
            if start is not None:  # one run of one tensor: recovered in place
                into = out[start:start + hi - lo].zero_()
                frame.recover_into(codes, self.bits, inverse, 1.0, fingerprints, None, into)
            else:
                values = torch.zeros(hi - lo, dtype=torch.float32, device=dev)
                frame.recover_into(codes, self.bits, inverse, 1.0, fingerprints, None, values)
                frame.place(values, out)
        return out

"""One chunk of a Moniqua message (a frame): what encodes or recovers every tensor of it in one pass.

:meth:`.PartLayout.plan` cuts a step's message body into chunks of code positions, each a sequence of
runs (a tensor's part, or a gap). A :class:`Frame` holds one chunk's runs on the device with the scale,
dither u and fingerprint weight H_c of every position, so that the lattice (:mod:`._lattice`) runs on
the whole chunk at once::

    t  = x s + u                                   x gathered run by run, 0 in the gaps
    L  = round(t)            (stochastic: floor(x s + xi))         -> b-bit codes, fingerprints per run
    L' = k + 2^b round((t - k) / 2^b)                k the received codes, t from the reader's x

The per-coordinate float32 operations are those of ``lattice_encode`` / ``lattice_decode`` on one
tensor at a time (a float32 scale per position instead of one per call), and a run's fingerprint
``sum_c H_c (L_c mod 2^20)`` is exact int64 arithmetic, so the results are bit for bit those of a
tensor-by-tensor loop; nothing is read by the host.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import bitpack, kernels
from .._layout import chunk_elems, chunk_ranges
from . import _lattice as lattice
from ._parts import Chunk, PartLayout

__all__ = ["FRAME_CPU", "LOW31", "Frame", "frame_elems", "int64_pair", "message_noise", "per_run",
           "run_fingerprints"]

_EMPTY = np.empty(0, dtype=np.float32)  # an absent dither, noise or distance, for the kernels
_HASH_MASK = (1 << 20) - 1
LOW31 = 0x7FFFFFFF
"""The header holds a fingerprint's low 31 bits (a non-negative int32)."""

FRAME_CPU = 1 << 16
"""Code positions per frame on a CPU: a frame's int64 temporaries (512 KiB each) stay in a core's L2 cache and
are reused by the allocator. At the codecs' 2^18 they are 2 MiB, mapped anew (page faults) on every call:
Moniqua-AD-PSGD's 1-bit encode and pull of all of ResNet-20 took about twice as long."""


def frame_elems(device: torch.device) -> int:
    """Code positions per frame on ``device`` (a multiple of 8): :data:`FRAME_CPU` on a CPU, else the codecs' chunk."""
    return FRAME_CPU if device.type == "cpu" else chunk_elems(device)


class Frame:
    """One chunk of a step's message on this rank: its runs on the device, dither and hashes (built on first use)
    and, after :meth:`lattice`, ``t = x s + u``.

    On a CPU, :meth:`encode` and :meth:`recover_into` run the fused kernels of
    :mod:`mpicomm.codecs.kernels.moniqua`, which recompute u, the hashes and t per position from the
    model instead of storing them: nothing per position is kept between the encode and the recoveries, and
    the model must not change in between (it does not: the increment is applied after every recovery).
    """

    def __init__(self, chunk: Chunk, device, key: int | None):
        self.chunk, self.device, self.key = chunk, torch.device(device), key
        self.lengths = torch.tensor(chunk.lengths, device=device)
        self.tensors = torch.tensor(chunk.tensors, device=device)
        self.ends = torch.tensor(chunk.ends, device=device)
        self.base: torch.Tensor | None = None
        self._u: torch.Tensor | None = None
        self._hashes: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._pair: torch.Tensor | None = None
        self._encoded: tuple | None = None  # the fused encode's model and scales, for the recoveries

    @property
    def u(self) -> torch.Tensor | None:
        """The dither at every position (float32; None without one)."""
        if self.key is not None and self._u is None:
            self._coordinates()
        return self._u

    @property
    def hashes(self) -> torch.Tensor:
        """The fingerprint weight H_c of every position (int32, < 2^20)."""
        if self._hashes is None:
            self._coordinates()
        return self._hashes

    def _coordinates(self) -> None:
        chunk, n, dev = self.chunk, self.chunk.hi - self.chunk.lo, self.device
        if bitpack.kernels_enabled(dev):  # one pass, no coordinate tensor
            from ..kernels import moniqua as fused

            self._u = None if self.key is None else torch.empty(n, dtype=torch.float32)
            self._hashes = torch.empty(n, dtype=torch.int32)
            fused.coordinates(chunk.lo, self.lengths.numpy(), self._shifts(), self._key(),
                                      _EMPTY if self._u is None else self._u.numpy(), self._hashes.numpy())
            return
        shift = torch.tensor(chunk.shifts, device=dev).repeat_interleave(self.lengths, output_size=n)
        coords = torch.arange(chunk.lo, chunk.hi, device=dev).add_(shift)
        self._u = None if self.key is None else lattice.dither(self.key, coords)
        self._hashes = lattice.coordinate_hashes(coords).to(torch.int32)  # < 2^20: half the bytes kept per step

    def encode(self, x: torch.Tensor, scale: torch.Tensor, inverse: torch.Tensor, noise: torch.Tensor | None,
               bits: int, codes: torch.Tensor, own: torch.Tensor, factor: float, out: torch.Tensor) -> None:
        """This rank's part of the frame: ``L`` of ``x`` (:meth:`lattice`), its codes packed into ``codes``
        (:meth:`pack`), every run's fingerprint added to ``own`` (per tensor, T + 1 entries), and
        ``factor * x̂`` written to ``out`` (one value per position).

        ``scale``/``inverse``: s and 1/s per tensor (:func:`per_run`). On a CPU one fused pass
        (:func:`mpicomm.codecs.kernels.moniqua.encode`), bit for bit the torch ops it replaces.
        """
        if not self._fused(x, bits):
            L = self.lattice(x, scale, noise)
            own.index_add_(0, self.tensors, self.pack(L, bits, codes))
            torch.mul(self.value(L, self.spread(inverse)), factor, out=out)
            return
        from ..kernels import moniqua as fused

        chunk, n = self.chunk, self.chunk.hi - self.chunk.lo
        points = torch.empty(n, dtype=torch.uint8)
        self._encoded = (x.detach().numpy(), self._runs(), scale.numpy())
        model, runs, s = self._encoded
        xi = _EMPTY if noise is None else noise[chunk.lo:chunk.hi].numpy()
        fused.encode(model, xi, *runs, s, inverse.numpy(), np.float32(factor), (1 << bits) - 1, points.numpy(),
                     own.numpy(), out.numpy())
        bitpack.pack(points, bits, out=codes[chunk.lo * bits // 8:chunk.hi * bits // 8], check=False)

    def recover_into(self, codes: torch.Tensor, bits: int, inverse: torch.Tensor, weight: float,
                     fingerprints: torch.Tensor, distance: torch.Tensor | None, out: torch.Tensor) -> None:
        """Recover a neighbour's frame from its message's code bytes ``codes`` (:meth:`recover`) after
        :meth:`encode`: every run's fingerprint added to ``fingerprints`` (per tensor), ``max |L' - t|`` per
        tensor into ``distance`` (if given), and ``weight * x̂_j`` added to ``out`` (one value per position).

        On a CPU one fused pass (:func:`mpicomm.codecs.kernels.moniqua.recover`) against the model
        :meth:`encode` read, bit for bit the torch ops it replaces.
        """
        if self._encoded is None:
            L = self.recover(codes, bits)
            if self._pair is None:  # int64_pair's scratch, shared by every row
                self._pair = torch.empty(2 * L.numel(), dtype=torch.int64, device=L.device)
            fingerprints.index_add_(0, self.tensors, self.fingerprints(L, self._pair))
            if distance is not None:  # (L - base) / s = x̂_j - x_i: lattice units until divided by s
                distance.scatter_reduce_(0, self.positions(), torch.sub(L, self.base).abs_(), "amax")
            out.add_(self.value(L, self.spread(inverse)), alpha=weight)
            return
        from ..kernels import moniqua as fused

        lo, hi = self.chunk.lo, self.chunk.hi
        received = bitpack.unpack(codes[lo * bits // 8:hi * bits // 8], bits, hi - lo)
        model, runs, s = self._encoded
        fused.recover(received.numpy(), model, *runs, s, inverse.numpy(), np.float32(weight),
                              np.float32(1 << bits), fingerprints.numpy(),
                              _EMPTY if distance is None else distance.numpy(), out.numpy())

    def _fused(self, x: torch.Tensor, bits: int) -> bool:
        """Whether the fused CPU kernels run this frame: a CPU, a float32 model, a whole number of codes per byte."""
        return bitpack.kernels_enabled(x.device) and x.dtype == torch.float32 and bits in kernels.WIDTHS

    def _shifts(self) -> np.ndarray:
        return np.array(self.chunk.shifts, dtype=np.int64)

    def _key(self) -> np.uint64:
        return np.uint64(0 if self.key is None else self.key % (1 << 64))

    def _runs(self) -> tuple:
        """The kernels' description of the runs: starts (-1 for a gap), lengths, tensors, shifts, lo, dithered, key."""
        starts = np.array([-1 if a is None else a for a in self.chunk.starts], dtype=np.int64)
        return (starts, self.lengths.numpy(), self.tensors.numpy(), self._shifts(), self.chunk.lo,
                self.key is not None, self._key())

    def positions(self) -> torch.Tensor:
        """The tensor (T for a gap) of every position of the chunk (int64, built on first use)."""
        if self._positions is None:
            self._positions = self.tensors.repeat_interleave(self.lengths, output_size=self.chunk.hi - self.chunk.lo)
        return self._positions

    def spread(self, per_tensor: torch.Tensor) -> torch.Tensor:
        """The float32 value of each run's tensor at each of its positions (``per_tensor`` has T + 1 entries)."""
        return per_tensor[self.tensors].repeat_interleave(self.lengths, output_size=self.chunk.hi - self.chunk.lo)

    def lattice(self, x: torch.Tensor, scale: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 lattice points ``L`` of the flat model ``x`` at this chunk's positions; keeps ``t`` as
        :attr:`base`.

        ``t = x s + u`` (s from ``scale``, :func:`per_run`), ``L = round(t)``; with ``noise`` (xi of stochastic
        rounding at every code position of the message, :func:`message_noise`) ``L = floor(x s + xi)``.
        """
        chunk = self.chunk
        gap = x.new_zeros(max(chunk.lengths))
        t = torch.cat([gap[:n] if a is None else x[a:a + n] for n, a in zip(chunk.lengths, chunk.starts)])
        t = t.to(torch.float32).mul_(self.spread(scale))
        if self.u is not None:
            t.add_(self.u)
        self.base = t
        return t.add(noise[chunk.lo:chunk.hi]).floor_() if noise is not None else t.round()

    def pack(self, L: torch.Tensor, bits: int, codes: torch.Tensor) -> torch.Tensor:
        """Pack ``L mod 2^b`` into this chunk's bytes of ``codes`` (the message's code bytes); return the
        fingerprint of every run (int64)."""
        points, work = int64_pair(L)
        small = torch.bitwise_and(points, (1 << bits) - 1, out=work).to(torch.uint8)
        bitpack.pack(small, bits, out=codes[self.chunk.lo * bits // 8:self.chunk.hi * bits // 8], check=False)
        return run_fingerprints(points, self.hashes, self.ends, work)

    def recover(self, codes: torch.Tensor, bits: int) -> torch.Tensor:
        """``L'`` (float32): the points congruent to the received codes mod 2^b nearest to :attr:`base`.

        ``codes``: the sender's code bytes (all of its message's, this chunk's are read).
        """
        lo, hi = self.chunk.lo, self.chunk.hi
        code = bitpack.unpack(codes[lo * bits // 8:hi * bits // 8], bits, hi - lo).to(torch.float32)
        levels = float(1 << bits)
        return torch.sub(self.base, code).mul_(1.0 / levels).round_().mul_(levels).add_(code)

    def fingerprints(self, L: torch.Tensor, pair: torch.Tensor | None = None) -> torch.Tensor:
        """The fingerprint of every run of the float32 points ``L`` (int64; ``pair`` as in :func:`int64_pair`)."""
        points, work = int64_pair(L, pair)
        return run_fingerprints(points, self.hashes, self.ends, work)

    def value(self, L: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        """``x̂ = (L - u) / s`` in place on the float32 lattice points ``L`` (``inverse``: 1/s at each position)."""
        if self.u is not None:
            L.sub_(self.u)
        return L.mul_(inverse)

    def coordinate_start(self) -> int | None:
        """The flat coordinate of the frame's first position when the frame is one run of one tensor's part
        (its positions then map onto consecutive coordinates), else None."""
        starts = self.chunk.starts
        return starts[0] if len(starts) == 1 else None

    def place(self, values: torch.Tensor, out: torch.Tensor) -> None:
        """Copy ``values`` (one per position) of every tensor run to its coordinates of the flat ``out``."""
        p = 0
        for n, a in zip(self.chunk.lengths, self.chunk.starts):
            if a is not None:
                out[a:a + n].copy_(values[p:p + n])
            p += n

    def parts(self, values: torch.Tensor, out: torch.Tensor) -> int:
        """Copy ``values`` (one per position) of the runs that are tensor parts, not gaps, in order, to the head
        of ``out``; return how many. One gather whose index is built on the device (no host read)."""
        kept = [(end + 1 - n, n) for n, a, end in zip(self.chunk.lengths, self.chunk.starts, self.chunk.ends)
                if a is not None]
        m = sum(n for _, n in kept)
        if m == values.numel():
            out[:m].copy_(values)
        elif m:
            shifts, at = [], 0
            for first, n in kept:
                shifts.append(first - at)
                at += n
            lengths = torch.tensor([n for _, n in kept], device=values.device)
            index = torch.arange(m, device=values.device).add_(
                torch.tensor(shifts, device=values.device).repeat_interleave(lengths, output_size=m))
            torch.index_select(values, 0, index, out=out[:m])
        return m


def int64_pair(L: torch.Tensor, pair: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``L`` as int64 and a work buffer of its size, both in ``pair`` (2 |L| int64, allocated if None): one
    allocation where two fresh ones would each be mapped anew by the C allocator (page faults)."""
    n = L.numel()
    pair = torch.empty(2 * n, dtype=torch.int64, device=L.device) if pair is None else pair
    return pair[:n].copy_(L), pair[n:]


def per_run(per_tensor: torch.Tensor, device) -> torch.Tensor:
    """Values per tensor as float32 on ``device``, with a last entry 1 for the gaps (whose x is 0)."""
    return torch.cat([per_tensor, per_tensor.new_ones(1)]).to(device=device, dtype=torch.float32)


def message_noise(layout: PartLayout, step: int, chunk: int, generator, device) -> torch.Tensor:
    """xi of stochastic rounding at every code position of ``step``'s message (0 in the gaps), drawn from the
    :class:`~mpicomm.codecs._rng.SeededGenerator` ``generator`` tensor by tensor and ``chunk`` by ``chunk`` of
    its part: the stream does not depend on how the message is cut into frames."""
    noise = torch.zeros(layout.codes, dtype=torch.float32, device=device)
    for position, (start, stop) in zip(layout.positions, layout.parts_at(step)):
        for lo, hi in chunk_ranges(stop - start, chunk):
            generator.uniform_(noise[position + lo:position + hi])
    return noise


def run_fingerprints(L: torch.Tensor, hashes: torch.Tensor, ends: torch.Tensor, running: torch.Tensor) -> torch.Tensor:
    """``sum_c H_c (L_c mod 2^20)`` over each run of coordinates ending (inclusive) at ``ends``, int64.

    ``L``: the int64 lattice points, overwritten; ``hashes``: the coordinates' odd 20-bit H_c; runs are
    consecutive and cover ``L`` from its start; ``running``: an int64 buffer of L's size for the running
    sum. Exact: a running int64 sum (below 2^40 per term), read at the run ends and differenced. A wrap
    moves some L_c by a multiple of 2^b, so a receiver's fingerprint differs from the sender's (cancelling
    wraps go unnoticed with probability about 2^-20).
    """
    sums = torch.cumsum(L.bitwise_and_(_HASH_MASK).mul_(hashes), 0, out=running)[ends]
    return torch.diff(sums, prepend=sums.new_zeros(1))

"""One chunk of a Moniqua message on the device: what encodes or decodes every tensor of it in one pass.

:meth:`.PartLayout.plan` cuts a step's message body into chunks of code positions, each a sequence of
runs (a tensor's part, or a gap). A :class:`Frame` holds one chunk's runs on the device with the scale,
dither u and fingerprint weight H_c of every position, so that the lattice codec of
:mod:`mpicomm.codecs.lattice` runs on the whole chunk at once::

    t  = x s + u                                   x gathered run by run, 0 in the gaps
    L  = round(t)            (stochastic: floor(x s + xi))         -> b-bit codes, fingerprints per run
    L' = k + 2^b round((t - k) / 2^b)                k the received codes, t from the reader's x

The per-coordinate float32 operations are those of ``lattice_encode`` / ``lattice_decode`` on one
tensor at a time (a float32 scale per position instead of one per call), and a run's fingerprint
``sum_c H_c (L_c mod 2^20)`` is exact int64 arithmetic (:func:`.run_fingerprints`), so the results are
bit for bit those of a tensor-by-tensor loop; nothing is read by the host. Used by the synchronous
Moniqua (:mod:`.moniqua`) and by Moniqua-AD-PSGD's message (:mod:`.moniqua_pull`).
"""

from __future__ import annotations

import torch

from ..codecs import bitpack, lattice
from ..codecs._layout import chunk_elems, chunk_ranges
from .moniqua_guard import run_fingerprints
from .moniqua_parts import Chunk, PartLayout

__all__ = ["FRAME_CPU", "Frame", "frame_elems", "int64_pair", "message_noise", "per_run"]

FRAME_CPU = 1 << 16
"""Code positions per frame on a CPU: a frame's int64 temporaries (512 KiB each) stay in a core's L2 cache and
are reused by the allocator. At the codecs' 2^18 they are 2 MiB, mapped anew (page faults) on every call:
Moniqua-AD-PSGD's 1-bit encode and pull of all of ResNet-20 took about twice as long."""


def frame_elems(device: torch.device) -> int:
    """Code positions per frame on ``device`` (a multiple of 8): :data:`FRAME_CPU` on a CPU, else the codecs' chunk."""
    return FRAME_CPU if device.type == "cpu" else chunk_elems(device)


class Frame:
    """One chunk of a step's message on this rank: its runs on the device, dither, hashes and (after
    :meth:`lattice`) ``t = x s + u``."""

    def __init__(self, chunk: Chunk, device, key: int | None):
        self.chunk = chunk
        n = chunk.hi - chunk.lo
        self.lengths = torch.tensor(chunk.lengths, device=device)
        self.tensors = torch.tensor(chunk.tensors, device=device)
        self.ends = torch.tensor(chunk.ends, device=device)
        shift = torch.tensor(chunk.shifts, device=device).repeat_interleave(self.lengths, output_size=n)
        coords = torch.arange(chunk.lo, chunk.hi, device=device).add_(shift)
        self.u = None if key is None else lattice.dither(key, coords)
        self.hashes = lattice.coordinate_hashes(coords).to(torch.int32)  # < 2^20: half the bytes kept per step
        self.base: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None

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

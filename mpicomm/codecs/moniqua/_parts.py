"""Moniqua's message layout: which contiguous part of each tensor is sent at a step, and where it sits.

With ``parts = P`` tensor l sends, at step k, its part p = (k + l) mod P: the coordinates
``[o_l + floor(p n_l / P), o_l + floor((p + 1) n_l / P))`` of the flat model (o_l its offset, n_l its
size). Its packed codes take a fixed slot of ``ceil(ceil(n_l / P) b / 8)`` bytes, so the message has
the same size every step: ``4 T`` header bytes (one int32 fingerprint per tensor) plus the slots,
rounded up to a multiple of 4 bytes.

The body after the header holds ``Q = 8 (message bytes - 4 T) / b`` code positions (b in 1, 2, 4, 8
divides 8, so every slot starts on a code position). :meth:`PartLayout.plan` describes them at a step
as runs: a tensor's part, or a gap (the unused end of a slot, the final rounding), cut into chunks of
at most ``chunk`` positions. The codec encodes and decodes a whole chunk in one pass of tensor
operations, whatever the number of tensors: a gap is encoded as the value 0, whose code is 0 and
whose lattice point is 0 under any dither in [-1/2, 1/2), so it changes no fingerprint.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..bitpack import packed_bytes

__all__ = ["FINGERPRINT_BYTES", "Chunk", "PartLayout"]

FINGERPRINT_BYTES = 4
"""Header bytes per tensor (an int32 fingerprint of its part)."""


@dataclass(frozen=True)
class Chunk:
    """Code positions ``[lo, hi)`` of the message body at one step, as runs in position order.

    ``lengths[r]``: positions of run r (all > 0). ``tensors[r]``: its tensor, or T (the tensor count)
    for a gap. ``starts[r]``: the flat model coordinate of its first position (None for a gap).
    ``shifts[r]``: coordinate minus position on run r (0 for a gap). ``ends[r]``: its last position
    relative to ``lo``.
    """

    lo: int
    hi: int
    lengths: tuple[int, ...]
    tensors: tuple[int, ...]
    starts: tuple
    shifts: tuple[int, ...]
    ends: tuple[int, ...]


class PartLayout:
    """The rotating parts of every tensor and their slots in a message of ``message_bytes`` bytes."""

    def __init__(self, layers, parts: int, bits: int):
        self.offsets = [layer.offset for layer in layers]
        self.sizes = [layer.numel for layer in layers]
        self.parts, self.bits, self.count = parts, bits, len(self.sizes)
        self.header_bytes = FINGERPRINT_BYTES * self.count
        self.slots = []
        at = self.header_bytes
        for n in self.sizes:
            self.slots.append(at)
            at += packed_bytes(-(-n // parts), bits)
        self.message_bytes = -(-at // FINGERPRINT_BYTES) * FINGERPRINT_BYTES  # rows stay int32-aligned
        self.codes = 8 * (self.message_bytes - self.header_bytes) // bits
        self.positions = [8 * (slot - self.header_bytes) // bits for slot in self.slots]
        self._plans: dict[tuple[int, int], list[Chunk]] = {}
        self._parts: dict[int, list[tuple[int, int]]] = {}

    def part(self, tensor: int, step: int) -> tuple[int, int]:
        """Flat ``(start, stop)`` of the part tensor ``tensor`` sends at ``step``."""
        p, n, o = (step + tensor) % self.parts, self.sizes[tensor], self.offsets[tensor]
        return o + p * n // self.parts, o + (p + 1) * n // self.parts

    def header(self, message: torch.Tensor) -> torch.Tensor:
        """The int32 fingerprints at the head of ``message`` (a view)."""
        return message[:self.header_bytes].view(torch.int32)

    def parts_at(self, step: int) -> list[tuple[int, int]]:
        """:meth:`part` of every tensor at ``step`` (cached per phase)."""
        key = step % self.parts
        if key not in self._parts:
            self._parts[key] = [self.part(tensor, step) for tensor in range(self.count)]
        return self._parts[key]

    def plan(self, step: int, chunk: int) -> list[Chunk]:
        """The body's ``Q`` code positions at ``step`` in chunks of ``chunk`` (a multiple of 8); cached per phase."""
        key = (step % self.parts, chunk)
        if key not in self._plans:
            self._plans[key] = self._cut(self._runs(step), chunk)
        return self._plans[key]

    def _runs(self, step: int) -> list[tuple[int, int, int, int | None]]:
        """``(position, length, tensor or T, coordinate or None)`` of every non-empty run, in position order."""
        runs, ends = [], self.positions[1:] + [self.codes]
        for tensor, (position, end, (start, stop)) in enumerate(zip(self.positions, ends, self.parts_at(step))):
            runs.append((position, stop - start, tensor, start))
            runs.append((position + stop - start, end - position - (stop - start), self.count, None))
        return [run for run in runs if run[1] > 0]

    def _cut(self, runs, chunk: int) -> list[Chunk]:
        out = []
        for lo in range(0, self.codes, chunk):
            hi = min(self.codes, lo + chunk)
            pieces = []
            for position, length, tensor, start in runs:
                a, b = max(position, lo), min(position + length, hi)
                if a < b:
                    pieces.append((b - a, tensor, None if start is None else start + a - position,
                                   0 if start is None else start - position))
            lengths = [p[0] for p in pieces]
            ends = [end - 1 for end in itertools.accumulate(lengths)]
            out.append(Chunk(lo, hi, tuple(lengths), tuple(p[1] for p in pieces), tuple(p[2] for p in pieces),
                             tuple(p[3] for p in pieces), tuple(ends)))
        return out


"""Moniqua's message layout: which contiguous part of each tensor is sent at a step, and where it sits.

With ``parts = P`` tensor l sends, at step k, its part p = (k + l) mod P: the coordinates
``[o_l + floor(p n_l / P), o_l + floor((p + 1) n_l / P))`` of the flat model (o_l its offset, n_l its
size). Its packed codes take a fixed slot of ``ceil(ceil(n_l / P) b / 8)`` bytes, so the message has
the same size every step: ``4 T`` header bytes (one int32 fingerprint per tensor) plus the slots,
rounded up to a multiple of 4 bytes.
"""

from __future__ import annotations

import torch

from ..codecs.lattice import packed_bytes

__all__ = ["FINGERPRINT_BYTES", "PartLayout", "tensor_inf"]

FINGERPRINT_BYTES = 4
"""Header bytes per tensor (an int32 fingerprint of its part)."""


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
        self.lengths = torch.tensor(self.sizes, dtype=torch.int64)

    def part(self, tensor: int, step: int) -> tuple[int, int]:
        """Flat ``(start, stop)`` of the part tensor ``tensor`` sends at ``step``."""
        p, n, o = (step + tensor) % self.parts, self.sizes[tensor], self.offsets[tensor]
        return o + p * n // self.parts, o + (p + 1) * n // self.parts

    def slot(self, message: torch.Tensor, tensor: int, count: int) -> torch.Tensor:
        """The bytes of ``message`` holding the first ``count`` codes of tensor ``tensor``'s part."""
        at = self.slots[tensor]
        return message[at:at + packed_bytes(count, self.bits)]

    def header(self, message: torch.Tensor) -> torch.Tensor:
        """The int32 fingerprints at the head of ``message`` (a view)."""
        return message[:self.header_bytes].view(torch.int32)


def tensor_inf(flat: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``||t_l||_inf`` of every tensor t_l of the flat vector ``flat`` (sizes ``lengths``), float64."""
    return torch.segment_reduce(flat.detach().abs(), "max", lengths=lengths.to(flat.device), unsafe=True).double().cpu()

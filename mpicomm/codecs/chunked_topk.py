"""Chunked top-k with low-bit values: SparseLoCo's compressor (Sarfi et al. 2025, arXiv:2508.15706).

x (n elements) is cut into m = ceil(n / c) chunks of c = min(chunk, n) elements (the last one zero-padded).
Each chunk keeps its k = ceil(density * c) (in [1, c]) largest magnitudes; their values are quantized to
``bits`` bits on the chunk's own uniform grid [lo, hi] (lo, hi the min and max of the kept values,
nearest rounding, as :class:`~mpicomm.codecs.uniform.UniformCodec`), and their positions inside the chunk
take b = max(1, ceil(log2 c)) bits. Payload, ``8m + ceil(mk bits / 8) + sum_w ceil(mk w / 8)`` bytes with
the index bits cut into bytes (w = 8, 8, ..., the rest)::

    [lo, hi] float32 per chunk | value codes (bits each) | index bits 0-7 | index bits 8-15 | ...

Decode scatters lo + code (hi - lo) / (2^bits - 1) into zeros. Ties at the k-th magnitude are broken by
``torch.topk``; the size depends on n only, so ranks exchange payloads with an allgather.
"""

from __future__ import annotations

import math

import torch

from . import bitpack
from ._layout import check_numel, prepare_out, read_field, write_field
from .base import Codec, check_flat_float, check_payload

__all__ = ["ChunkedTopKCodec"]


class ChunkedTopKCodec(Codec):
    """Top-k per chunk of ``chunk`` elements (``density`` of each chunk kept), values at ``bits`` bits."""

    name = "chunked_topk"

    def __init__(self, density: float = 0.02, chunk: int = 4096, bits: int = 2):
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
            raise ValueError(f"density must be a number in (0, 1], got {density!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
        bitpack.packed_bytes(0, bits)  # validates bits
        self.density, self.chunk, self.bits = float(density), chunk, bits
        self.levels = (1 << bits) - 1

    def layout(self, numel: int) -> tuple[int, int, int, int]:
        """(chunk length c, chunks m, kept per chunk k, index bits b) for a tensor of ``numel`` elements."""
        c = min(self.chunk, numel)
        if c == 0:
            return 0, 0, 0, 1
        k = min(c, max(1, math.ceil(self.density * c - 1e-6)))
        return c, -(-numel // c), k, max(1, (c - 1).bit_length())

    @staticmethod
    def _widths(b: int) -> list[int]:
        return [min(8, b - s) for s in range(0, b, 8)]

    def payload_bytes(self, numel: int) -> int:
        """``8`` bytes per chunk, then the value codes and the index bits of the m k kept elements."""
        c, m, k, b = self.layout(check_numel(numel, "ChunkedTopKCodec.payload_bytes"))
        return 8 * m + bitpack.packed_bytes(m * k, self.bits) + sum(bitpack.packed_bytes(m * k, w)
                                                                     for w in self._widths(b))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Keep each chunk's k largest magnitudes; write their [lo, hi], value codes and positions."""
        check_flat_float(x, "ChunkedTopKCodec.encode")
        n = x.numel()
        c, m, k, b = self.layout(n)
        payload = torch.empty(self.payload_bytes(n), dtype=torch.uint8, device=x.device)
        if n == 0:
            return payload
        rows = torch.zeros(m * c, dtype=torch.float32, device=x.device)
        rows[:n] = x.detach()
        rows = rows.view(m, c)
        index = torch.topk(rows.abs(), k, dim=1, sorted=False).indices
        values = rows.gather(1, index)
        lo, hi = values.amin(dim=1), values.amax(dim=1)
        write_field(payload, 0, torch.stack((lo, hi), dim=1))
        scale = torch.where(hi > lo, self.levels / (hi.double() - lo.double()), 0.0).float()
        codes = values.sub_(lo[:, None]).mul_(scale[:, None]).add_(0.5).clamp_(0.0, self.levels)
        at = 8 * m
        size = bitpack.packed_bytes(m * k, self.bits)
        bitpack.pack(codes.to(torch.uint8).reshape(-1), self.bits, out=payload[at:at + size])
        at += size
        flat_index = index.reshape(-1)
        shift = 0
        for w in self._widths(b):
            size = bitpack.packed_bytes(m * k, w)
            piece = ((flat_index >> shift) & ((1 << w) - 1)).to(torch.uint8)
            bitpack.pack(piece, w, out=payload[at:at + size])
            at, shift = at + size, shift + w
        return payload

    def decode(self, payload: torch.Tensor, numel: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Zeros, with each chunk's kept values ``lo + code (hi - lo) / (2^bits - 1)`` at their positions."""
        check_payload(payload, self.payload_bytes(numel), "ChunkedTopKCodec.decode")
        out = prepare_out(out, numel, payload.device, "ChunkedTopKCodec.decode")
        c, m, k, b = self.layout(numel)
        if numel == 0:
            return out
        bounds = read_field(payload, 0, 2 * m, torch.float32).view(m, 2)
        lo, hi = bounds[:, 0], bounds[:, 1]
        delta = ((hi.double() - lo.double()) / self.levels).float()
        at = 8 * m
        size = bitpack.packed_bytes(m * k, self.bits)
        codes = bitpack.unpack(payload[at:at + size], self.bits, m * k).view(m, k)
        at += size
        index = torch.zeros(m * k, dtype=torch.int64, device=payload.device)
        shift = 0
        for w in self._widths(b):
            size = bitpack.packed_bytes(m * k, w)
            index |= bitpack.unpack(payload[at:at + size], w, m * k).to(torch.int64) << shift
            at, shift = at + size, shift + w
        values = codes.float().mul_(delta[:, None]).add_(lo[:, None])
        rows = torch.zeros(m, c, dtype=torch.float32, device=payload.device)
        rows.scatter_(1, index.view(m, k), values)
        out.copy_(rows.view(-1)[:numel])
        return out

    def __repr__(self) -> str:
        return f"ChunkedTopKCodec(density={self.density}, chunk={self.chunk}, bits={self.bits})"
